"""The README and docs/ hold together: their Python examples compile, every `prefixserve` command they show
parses with the real command line, and the README's links reach files in the repository. (What an example
prints is checked where it runs: tests/test_readme.py, tests/test_lint.py; `mkdocs build --strict` in .ci/run
checks the docs' own links and anchors.)"""

import ast
import re
import shlex

import pytest
from docs_text import PAGES, ROOT, fenced

from prefixserve.cli import build_parser


def _blocks(language: str) -> list[tuple[str, str]]:
    return [(page.name, block) for page in PAGES for block in fenced(page.read_text(), language)]


def _commands() -> list[tuple[str, str]]:
    """Every `prefixserve ...` line of a bash block (continuation lines joined; pipes and `&&` cut off)."""
    found = []
    for page, block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\||&|;", line):
                words = part.strip()
                if words.startswith("prefixserve "):
                    found.append((page, words))
    return found


def test_the_pages_show_examples_at_all():
    assert len(_blocks("python")) >= 8 and len(_commands()) >= 10


@pytest.mark.parametrize("page, code", _blocks("python"), ids=lambda value: value if value.endswith(".md") else "")
def test_every_python_example_compiles(page, code):
    ast.parse(code, filename=page)


@pytest.mark.parametrize("page, command", _commands(), ids=lambda value: value[:60])
def test_every_command_shown_parses(page, command):
    words = shlex.split(command, comments=True)[1:]
    try:
        args, unknown = build_parser().parse_known_args(words)
    except SystemExit as refused:
        raise AssertionError(f"{page}: `{command}` is refused by the command line (exit {refused.code})") from None
    assert not unknown, f"{page}: `{command}`: unknown arguments {unknown}"


def test_the_readme_links_reach_files():
    readme = (ROOT / "README.md").read_text()
    targets = [target for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme) if "://" not in target]
    assert targets, "the README links into docs/"
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, missing


def test_no_file_cites_a_document_the_repository_lacks():
    cited = re.compile(r"\b(DESIGN|STYLE)\.md\b")
    files = [
        *ROOT.joinpath("prefixserve").rglob("*.py"),
        *ROOT.joinpath("tests").glob("*.py"),
        *PAGES,
        ROOT / "pyproject.toml",
    ]
    citing = [str(path.relative_to(ROOT)) for path in files if cited.search(path.read_text())]
    assert not citing, citing
