"""The README and the docs site's pages as text: find a section by its title, and its fenced blocks."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def section(title: str) -> str:
    """The section whose heading starts with `title` (in the README or any docs page), up to the next heading
    of its level or above."""
    for page in PAGES:
        text = page.read_text()
        heading = re.search(rf"^(#+) {re.escape(title)}", text, flags=re.M)
        if heading is None:
            continue
        level = len(heading.group(1))
        following = re.compile(rf"^#{{1,{level}}} ", flags=re.M).search(text, heading.end())
        return text[heading.start() : following.start() if following else len(text)]
    raise LookupError(f"no heading starts with {title!r} in the README or docs/")


def fenced(text: str, language: str) -> list[str]:
    """The bodies of the fenced blocks of this language ('' for plain output blocks), in order."""
    blocks, current, current_language = [], None, None
    for line in text.splitlines():
        if current is None and line.startswith("```"):
            current, current_language = [], line[3:].strip()
        elif current is not None and line.strip() == "```":
            if current_language == language:
                blocks.append("\n".join(current) + "\n")
            current = None
        elif current is not None:
            current.append(line)
    return blocks
