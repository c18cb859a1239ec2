"""`prefixserve lint FILE.jsonl`: read a request log, load the tokenizer, print the lint (plan/lint.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..server.engine_flags import add_engine_argument
from .paths import output_path

LINT_SUMMARY = (
    "prompt cacheability lint: per prompt family in a JSONL of OpenAI request bodies, the stable prefix, "
    "what varies early (timestamps, ids, user names, tool or key order) and the hit rate today and "
    "with it moved to the end"
)


def add_lint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        metavar="FILE.jsonl",
        help="one OpenAI request body per line (chat completions or completions; a Batch API line "
        "with a 'body' works too), in the order they were sent; '-' reads stdin",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the report here as JSON (default: no JSON)")
    parser.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="count characters instead of the built-in model's tokens (loads nothing)",
    )
    add_engine_argument(parser, "block_size")  # as 'prefixserve serve' takes it


def lint(args: argparse.Namespace) -> int:
    from ..plan.lint_input import LintInputError

    try:
        return _lint(args)
    except (OSError, LintInputError, ValueError) as error:
        print(f"prefixserve lint: error: {error}", file=sys.stderr)
        return 2


def _lint(args: argparse.Namespace) -> int:
    from ..plan.lint import lint_prompts
    from ..plan.lint_input import bodies_from_jsonl, prompts_from_bodies
    from ..plan.lint_report import format_report, report_json

    if args.block_size < 1:
        raise ValueError(f"--block-size must be a positive number of tokens, got {args.block_size}")
    json_path = output_path("--json", args.json) if args.json else None
    where = "stdin" if args.file == "-" else args.file
    prompts = prompts_from_bodies(bodies_from_jsonl(_read_lines(args.file)))
    report = lint_prompts(prompts, None if args.no_tokenizer else _builtin_tokenizer(), args.block_size)
    print(f"prefixserve lint {where}: " + "\n".join(format_report(report)))
    if json_path:
        json_path.write_text(json.dumps(report_json(report), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    return 0


def _read_lines(file: str) -> list[str]:
    if file == "-":
        return sys.stdin.read().splitlines()
    path = Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"{file}: no such file; give the path of a JSONL request log, or '-' for stdin")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{file} is not UTF-8 text (byte {error.start}); give a JSONL file of request bodies"
        ) from None


def _builtin_tokenizer():
    """The built-in model's tokenizer, read from the package data the model directory is made from: the same
    tokens as the server's, without generating the model's weights."""
    from ..model import default
    from ..model.tokenizers.tokenizer import Tokenizer

    return Tokenizer.from_dir(Path(default.__file__).parent / "data")
