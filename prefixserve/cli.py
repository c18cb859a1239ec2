"""`prefixserve serve | route | simulate | plan | lint`: the command line.

One parser for every command: each flag shows its help and its default, and no flag may be
abbreviated (argparse would otherwise take `--replica 8` for `--replicas 8` without a word).
`serve` and `route` keep their flags beside the servers they build (server/serve_launch.py,
router/route_launch.py); `simulate` and `plan` keep theirs in commands/ (they glue the router's replay,
the engine's calibration and the planners together, which no one package may import).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from .commands.lint_command import LINT_SUMMARY, add_lint_arguments, lint
from .commands.plan import add_plan_arguments, plan
from .commands.simulate import add_simulate_arguments, simulate
from .router.route_launch import add_route_arguments, route
from .server.serve_launch import add_serve_arguments, serve


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help already names its default or there is
    nothing to show: a switch (its help says what giving it does), or None, whose meaning the help text
    says in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or isinstance(action.default, bool) or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixserve", allow_abbrev=False, description="LLM serving with a token-exact prefix KV cache"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        subparser = commands.add_parser(
            name, help=summary, description=summary, formatter_class=HelpFormatter, allow_abbrev=False
        )
        subparser.set_defaults(usage_error=subparser.error)  # a command's mistakes shown with its own usage
        return subparser

    add_serve_arguments(command("serve", "OpenAI-compatible server (a small default model is built in)"))
    add_route_arguments(command("route", "cache-aware router in front of 'prefixserve serve' replicas"))
    add_simulate_arguments(
        command("simulate", "replay a request trace over simulated replicas and compare routing policies")
    )
    add_plan_arguments(
        command(
            "plan",
            "planners on measured or given inputs (tiers: when fetching a prefix's KV "
            "from host RAM or disk beats recomputing it)",
        )
    )
    add_lint_arguments(command("lint", LINT_SUMMARY))
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args, unknown = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:
        args.usage_error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "serve":
        return serve(args)
    if args.command == "route":
        return route(args)
    if args.command == "plan":
        return plan(args)
    if args.command == "lint":
        return lint(args)
    return simulate(args)


if __name__ == "__main__":
    sys.exit(main())
