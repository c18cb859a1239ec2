"""`prefixserve serve | route | simulate` — the command-line entry point."""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="prefixserve", description="LLM serving with a token-exact prefix KV cache")
    commands = parser.add_subparsers(dest="command", required=True)

    from .router.launch import add_route_arguments, route
    from .server.launch import add_serve_arguments, serve

    add_serve_arguments(commands.add_parser("serve", help="OpenAI-compatible server (default model built in)"))
    add_route_arguments(commands.add_parser("route", help="cache-aware router in front of serve replicas"))
    commands.add_parser("simulate", help="replay a trace over simulated replicas (see 'prefixserve simulate -h')",
                        add_help=False)
    if argv and argv[0] == "simulate":
        from .router.simulate import main as simulate_main

        return simulate_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "route":
        return route(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
