"""One finding: what varies where requests of a family stop agreeing, and the rewrite that moves it away.

The search (lint.py) finds the first character where the requests' rendered prompts differ; this file
says what is there and how every request would look with it fixed:

    position p ─> part (tools, message i, prompt), line, column
               ─> the tool order / the key order / a detected value / plain text that differs
               ─> a rewrite applied to every request: sort the tools, sort the keys, or cut the value
                  and append it to the last message (the end of the prompt), where it costs nothing
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Callable, Optional

from .lint_input import Part, Prompt, tool_name, tools_text
from .lint_patterns import (
    DETECTORS,
    canonical_json,
    covering,
    differ_in_key_order,
    json_object_at,
    key_paths,
    line_bounds,
    matches,
)

Rewrite = Callable[[Prompt], Prompt]


@dataclass(frozen=True)
class Location:
    part: str  # "tools", "messages[0] (system)", "prompt"
    message_index: Optional[int]
    line: int  # 1-based, within the part's text
    column: int  # 1-based
    offset: int  # characters into the rendered prompt where the requests first differ (the stable prefix)


@dataclass(frozen=True)
class Finding:
    kind: str  # a detector's kind, "tool order", "key order", "text" or "structure"
    location: Location
    line_text: str  # the offending line, as the family's first request has it
    mark_start: int  # the variable span within line_text, 0-based [start, end)
    mark_end: int
    examples: tuple[str, ...]  # what two requests hold there
    suggestion: str


@dataclass(frozen=True)
class Step:
    finding: Finding
    rewrite: Optional[Rewrite]  # None: nothing the lint can rewrite (text that differs), the search stops


def classify(first: Prompt, other: Prompt, position: int) -> Step:
    """What differs between two prompts whose rendered texts first differ at `position`."""
    witness = first if position < len(first.render().text) else other
    part_index, offset = _part_at(witness, position)
    if part_index is None or _part_at(other if witness is first else first, position)[0] != part_index:
        return _structure(first, other, position)
    part, other_part = _part_or_empty(first, part_index), _part_or_empty(other, part_index)
    if part.label == "tools":
        step = _tools_step(first, other, part_index, offset, position)
        if step is not None:
            return step
    else:
        step = _json_key_order_step(part, other_part, part_index, offset, position)
        if step is not None:
            return step
    step = _value_step(first, part, other_part, part_index, offset, position)
    return step if step is not None else _text_step(first, part, other_part, offset, position)


def _part_at(prompt: Prompt, position: int) -> tuple[Optional[int], int]:
    """The part whose text holds position (its end included), and the offset in it; None in markup."""
    rendered = prompt.render()
    for index in reversed(range(len(prompt.parts))):
        start = rendered.part_starts[index]
        if start <= position <= start + len(prompt.parts[index].text):
            return index, position - start
    return None, 0


def _part_or_empty(prompt: Prompt, index: int) -> Part:
    return prompt.parts[index] if index < len(prompt.parts) else Part("", "", "")


def _location(part: Part, offset: int, position: int) -> Location:
    line_start, _ = line_bounds(part.text, offset)
    line = part.text.count("\n", 0, offset) + 1
    return Location(part.label, part.message_index, line, offset - line_start + 1, position)


def _finding(
    kind: str, part: Part, offset: int, position: int, span: tuple[int, int], examples: tuple[str, ...], suggestion: str
) -> Finding:
    line_start, line_end = line_bounds(part.text, offset)
    end = max(min(span[1], line_end), span[0] + 1)
    # The location is where the variable part starts (a timestamp's first digit), not the first differing one.
    return Finding(
        kind,
        _location(part, span[0], position),
        part.text[line_start:line_end],
        span[0] - line_start,
        end - line_start,
        examples,
        suggestion,
    )


def _tools_step(first: Prompt, other: Prompt, part_index: int, offset: int, position: int) -> Optional[Step]:
    part = first.parts[part_index]
    names, other_names = [tool_name(tool) for tool in first.tools], [tool_name(tool) for tool in other.tools]
    line_start, line_end = line_bounds(part.text, offset)
    tool_index = part.text.count("\n", 0, offset)  # one tool per line
    if names != other_names and sorted(names) == sorted(other_names):
        quoted_name = json.dumps(names[min(tool_index, len(names) - 1)], ensure_ascii=False)
        name_at = part.text.find(quoted_name, line_start, line_end)
        span = (name_at, name_at + len(quoted_name)) if name_at >= 0 else (offset, line_end)
        return Step(
            _finding(
                "tool order",
                part,
                offset,
                position,
                span,
                (", ".join(names), ", ".join(other_names)),
                "sort the tools by name before sending them (the same tools arrive in different orders)",
            ),
            _sort_tools,
        )
    if (
        names == other_names
        and tool_index < len(other.tools)
        and differ_in_key_order(first.tools[tool_index], other.tools[tool_index])
    ):
        return Step(
            _finding(
                "key order",
                part,
                offset,
                position,
                _key_span(part.text, offset),
                _first_keys(first.tools[tool_index], other.tools[tool_index]),
                "serialize the tool schemas with sort_keys=True (the same schema arrives with its keys "
                "in different orders)",
            ),
            _sort_tool_keys,
        )
    return None


def _json_key_order_step(part: Part, other_part: Part, part_index: int, offset: int, position: int) -> Optional[Step]:
    found, other_found = json_object_at(part.text, offset), json_object_at(other_part.text, offset)
    if found is None or other_found is None or found.start != other_found.start:
        return None
    if not differ_in_key_order(found.value, other_found.value):
        return None
    line = part.text.count("\n", 0, found.start) + 1
    return Step(
        _finding(
            "key order",
            part,
            offset,
            position,
            _key_span(part.text, offset),
            _first_keys(found.value, other_found.value),
            f"serialize the JSON on line {line} of {_part_name(part)} with json.dumps(..., sort_keys=True)",
        ),
        lambda prompt: _sort_json_keys(prompt, part_index, found.start),
    )


def _value_step(
    first: Prompt, part: Part, other_part: Part, part_index: int, offset: int, position: int
) -> Optional[Step]:
    texts = [text for text in (part.text, other_part.text) if offset < len(text)]
    for detector in DETECTORS:
        spans = [covering(text, detector.kind, offset) for text in texts]
        if not spans or None in spans:
            continue
        shown, line = spans[0], part.text.count("\n", 0, offset)
        examples = tuple(text[found.start : found.end] for text, found in zip(texts, spans))
        where = f"line {line + 1} of {_part_name(part)}"
        if part.label == "tools":
            suggestion = f"take the {detector.kind} out of the tool block ({where}); send it at {_destination(first)}"
        else:
            suggestion = f"move the {detector.kind} on {where} to {_destination(first)}"
        return Step(
            _finding(detector.kind, part, offset, position, (shown.start, shown.end), examples, suggestion),
            functools.partial(_move_value, part_index=part_index, line=line, kind=detector.kind, ordinal=shown.ordinal),
        )
    return None


def _text_step(first: Prompt, part: Part, other_part: Part, offset: int, position: int) -> Step:
    examples = tuple(_rest_of_line(text, offset) for text in (part.text, other_part.text))
    line = part.text.count("\n", 0, offset) + 1
    suggestion = (
        f"{_part_name(part)} differs between requests from line {line} on: keep it identical, or move the "
        f"per-request text to {_destination(first)}"
    )
    return Step(
        _finding("text", part, offset, position, (offset, line_bounds(part.text, offset)[1]), examples, suggestion),
        None,
    )


def _structure(first: Prompt, other: Prompt, position: int) -> Step:
    """The requests part in the chat markup: a message's role, or the number of template messages."""
    suggestion = (
        "the requests differ in which messages come before the conversation (their roles or number); "
        "send the same system messages, in the same order, with every request"
    )
    texts = [prompt.render().text for prompt in (first, other)]
    examples = tuple(_rest_of_line(text, text.rfind("\n", 0, position) + 1) for text in texts)
    part = Part("markup", "", texts[0])
    return Step(_finding("structure", part, position, position, (position, position + 1), examples, suggestion), None)


def _key_span(text: str, offset: int) -> tuple[int, int]:
    """The key where two serializations part: from the first differing character to its closing quote."""
    start = text.rfind('"', 0, offset + 1) if text[offset : offset + 1] != '"' else offset
    end = text.find('"', max(start, offset) + 1)
    return (start, end + 1) if 0 <= start and end > 0 else (offset, offset + 1)


def _part_name(part: Part) -> str:
    if part.label == "tools":
        return "the tool block"
    if part.label == "prompt":
        return "the prompt"
    return f"the {part.role} message (messages[{part.message_index}])"


def _destination(prompt: Prompt) -> str:
    if prompt.kind == "completion":
        return "the end of the prompt"
    return "the end of the last user message" if prompt.parts[-1].role == "user" else "the end of the last message"


def _rest_of_line(text: str, offset: int) -> str:
    rest = text[offset : line_bounds(text, offset)[1]] if offset < len(text) else ""
    return rest if len(rest) <= 40 else rest[:37] + "..."


def _first_keys(first: object, other: object) -> tuple[str, ...]:
    """The key order where two objects first disagree, as "a, b" strings."""
    paths, other_paths = key_paths(first), key_paths(other)
    index = next(index for index, (a, b) in enumerate(zip(paths, other_paths)) if a != b)
    siblings = [
        [path[-1] for path in keys if path[:-1] == keys[index][:-1] and len(path) == len(keys[index])]
        for keys in (paths, other_paths)
    ]
    return tuple(", ".join(map(str, names)) for names in siblings)


# ---- rewrites: each gives the request as it would be sent with one finding fixed -----------------------


def _with_tools(prompt: Prompt, tools: tuple[dict, ...]) -> Prompt:
    parts = (dataclasses.replace(prompt.parts[0], text=tools_text(tools)),) + prompt.parts[1:]
    return dataclasses.replace(prompt, tools=tools, parts=parts)


def _sort_tools(prompt: Prompt) -> Prompt:
    return _with_tools(prompt, tuple(sorted(prompt.tools, key=tool_name)))


def _sort_tool_keys(prompt: Prompt) -> Prompt:
    return _with_tools(prompt, tuple(json.loads(canonical_json(tool)) for tool in prompt.tools))


def _with_text(prompt: Prompt, part_index: int, text: str) -> Prompt:
    parts = list(prompt.parts)
    parts[part_index] = dataclasses.replace(parts[part_index], text=text)
    tools = prompt.tools
    if parts[part_index].label == "tools":  # keep the tools in step, so a later sort keeps this fix
        try:
            parsed = tuple(json.loads(line) for line in text.split("\n"))
        except json.JSONDecodeError:
            parsed = ()
        if parsed and all(isinstance(tool, dict) for tool in parsed):
            tools = parsed
    return dataclasses.replace(prompt, tools=tools, parts=tuple(parts))


def _sort_json_keys(prompt: Prompt, part_index: int, start: int) -> Prompt:
    if part_index >= len(prompt.parts):
        return prompt
    text = prompt.parts[part_index].text
    found = json_object_at(text, start)
    if found is None or found.start != start:
        return prompt
    return _with_text(prompt, part_index, text[:start] + canonical_json(found.value) + text[found.end :])


def _move_value(prompt: Prompt, part_index: int, line: int, kind: str, ordinal: int) -> Prompt:
    """Cut the ordinal-th `kind` value on this line (the whole line if the request has none there) and append
    it to the last part, on a line of its own."""
    if part_index >= len(prompt.parts):
        return prompt
    text = prompt.parts[part_index].text
    lines = text.split("\n")
    if line >= len(lines):
        return prompt
    line_start = sum(len(earlier) + 1 for earlier in lines[:line])
    line_end = line_start + len(lines[line])
    found = matches(text, kind, line_start, line_end)
    start, end = found[ordinal] if ordinal < len(found) else (line_start, min(line_end + 1, len(text)))
    moved = _with_text(prompt, part_index, text[:start] + text[end:])
    last = len(moved.parts) - 1
    return _with_text(moved, last, moved.parts[last].text + "\n" + text[start:end].strip("\n"))
