"""What a per-request value looks like: the lint's detectors, and the JSON it finds in a prompt.

A detector is a named regular expression; where two match at the point where requests start to differ,
the one listed first wins (a timestamp holds numbers, a request id may look like a number).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional

_MONTHS = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|Jun(?:e)?|Jul(?:y)?|Aug(?:ust)?|"
    r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_WEEKDAYS = r"(?:(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day|Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_CLOCK = r"\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?[AaPp][Mm])?(?:\s?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2}))?"


@dataclass(frozen=True)
class Detector:
    kind: str
    pattern: re.Pattern
    group: str = ""  # the named group that is the value (default: the whole match)


DETECTORS = (
    Detector(
        "timestamp",
        re.compile(
            rf"\b\d{{4}}-\d{{2}}-\d{{2}}[T ]{_CLOCK}"  # ISO 8601
            rf"|\b(?:{_WEEKDAYS},?\s+)?\d{{1,2}}\s+{_MONTHS}\s+\d{{4}}\s+{_CLOCK}"  # RFC 2822
            rf"|\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}},?\s+{_CLOCK}"
            rf"|\b1\d{{9}}(?:\d{{3}})?\b"  # Unix seconds or milliseconds
            rf"|\b{_CLOCK}"
        ),
    ),
    Detector(
        "date",
        re.compile(
            rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}}\b"
            rf"|\b(?:{_WEEKDAYS},?\s+)?{_MONTHS}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b"
            rf"|\b(?:{_WEEKDAYS},?\s+)?\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTHS}\.?,?\s+\d{{4}}\b"
            rf"|\b{_WEEKDAYS}\b"
        ),
    ),
    Detector("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")),
    Detector(
        "request id",
        re.compile(
            r"\b(?:req|request|trace|span|session|sess|msg|call|run|chatcmpl|id)[-_][A-Za-z0-9]{6,}\b"
            r"|\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"
        ),
    ),
    Detector(
        "user name",
        re.compile(
            r"(?i)\b(?:user_?name|user|name|customer|client|account)\b[\"']?\s*[:=]\s*[\"']?"
            r"(?P<value>[^\"'\n,;{}\[\]]*[^\"'\n,;{}\[\]\s])"
        ),
        group="value",
    ),
    Detector("number", re.compile(r"(?<![\w.])\d+(?:\.\d+)?")),
)


class Span(NamedTuple):
    kind: str
    start: int
    end: int
    ordinal: int  # among this detector's matches on the same line: which one (0-based)


def matches(text: str, kind: str, line_start: int, line_end: int) -> list[tuple[int, int]]:
    """(start, end) of every match of a detector inside text[line_start:line_end]."""
    detector = next(detector for detector in DETECTORS if detector.kind == kind)
    found = []
    for match in detector.pattern.finditer(text, line_start, line_end):
        start, end = match.span(detector.group or 0)
        if end > start:
            found.append((start, end))
    return found


def line_bounds(text: str, position: int) -> tuple[int, int]:
    """(start, end) of the line holding position, without its newline."""
    end = text.find("\n", position)
    return text.rfind("\n", 0, position) + 1, len(text) if end < 0 else end


def covering(text: str, kind: str, position: int) -> Optional[Span]:
    """This detector's match on position's line that covers position, if any."""
    line_start, line_end = line_bounds(text, position)
    for ordinal, (start, end) in enumerate(matches(text, kind, line_start, line_end)):
        if start <= position < end:
            return Span(kind, start, end, ordinal)
    return None


def mask(text: str) -> str:
    """The text with every detected value replaced by its kind: what stays when per-request values go."""
    for detector in DETECTORS:
        text = detector.pattern.sub(functools.partial(_masked, detector=detector), text)
    return text


def _masked(match: re.Match, detector: Detector) -> str:
    if not detector.group:
        return f"<{detector.kind}>"
    start, end = match.span(detector.group)
    whole_start = match.start()
    return match.group()[: start - whole_start] + f"<{detector.kind}>" + match.group()[end - whole_start :]


class JsonSpan(NamedTuple):
    start: int
    end: int
    value: Any


def json_objects(text: str) -> Iterator[JsonSpan]:
    """The JSON objects written in text (outermost ones, left to right)."""
    decoder, position = json.JSONDecoder(), text.find("{")
    while position >= 0:
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            position = text.find("{", position + 1)
            continue
        if isinstance(value, dict):
            yield JsonSpan(position, end, value)
            position = text.find("{", end)
        else:
            position = text.find("{", position + 1)


def json_object_at(text: str, position: int) -> Optional[JsonSpan]:
    return next((span for span in json_objects(text) if span.start <= position < span.end), None)


def key_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every object key as its path from the top, in the order written: what key order means."""
    paths = []
    if isinstance(value, dict):
        for key, child in value.items():
            paths.append(path + (key,))
            paths.extend(key_paths(child, path + (key,)))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            paths.extend(key_paths(child, path + (index,)))
    return paths


def differ_in_key_order(first: Any, second: Any) -> bool:
    """The same keys (at the same paths), written in a different order."""
    first_paths, second_paths = key_paths(first), key_paths(second)
    return first_paths != second_paths and sorted(map(repr, first_paths)) == sorted(map(repr, second_paths))


def canonical_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)
