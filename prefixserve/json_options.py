"""An option object (a frozen dataclass such as KVEventsConfig or SpeculativeConfig) from what a user gives: JSON
text (a command-line flag), a dict (the offline LLM(...)), or the object itself; a ValueError names the option,
the field and the fix. Plain Python: the CLI and the router read it without torch."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any


def parse_option(cls, value: Any, name: str, example: str):
    """`value` as a `cls` (None stays None); `name` is the option's name in messages, `example` valid JSON."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{name} is not valid JSON ({error.msg} at character {error.pos}); give e.g. {example}"
            ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {item.name for item in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {unknown}; the fields are {sorted(known)}")
    return cls(**value)
