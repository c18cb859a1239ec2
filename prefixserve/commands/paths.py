"""Checks on the paths and lists a command's flags name, made before any long run."""

from __future__ import annotations

from pathlib import Path


def output_path(flag: str, value: str | Path) -> Path:
    """The absolute path a flag names for writing, checked before any long run: a file in an existing folder."""
    path = Path(value).expanduser().resolve()
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {value}: is a directory; name a file to write")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{flag} {value}: folder {path.parent} does not exist; create it or pick another path")
    return path


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list positive integers, got {text!r}")
    return values
