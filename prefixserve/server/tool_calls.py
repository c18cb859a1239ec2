"""Tool calls in a model's output, in the formats the served families write (vLLM's --tool-call-parser names):

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call (Hermes, Qwen 2/2.5/3,
                  and SmolLM2's form, a JSON list of calls inside one block); what a template without tools is taught
    llama3_json   {"name": ..., "parameters": {...}} (or "arguments"), calls separated by ";", after an optional
                  <|python_tag|> (Llama 3.1-3.3)

parse() splits a whole output into content and calls; ToolCallStream does it as deltas arrive, holding back only
text that may begin a call. A block that does not parse stays content, as in vLLM.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

from ..chat_tools import HERMES_CLOSE, HERMES_OPEN

PARSERS = ("hermes", "llama3_json")
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.S)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: Optional[int] = None) -> dict:
        call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call_of(value: object, arguments_key: str) -> Optional[ParsedCall]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _hermes_block(body: str) -> Optional[list[ParsedCall]]:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    values = value if isinstance(value, list) else [value]  # SmolLM2 writes a list of calls in one block
    calls = [_call_of(each, "arguments") for each in values]
    return calls if calls and all(calls) else None


def _parse_hermes(text: str, cut: bool = False) -> tuple[Optional[str], list[ParsedCall]]:
    calls, content, last = [], [], 0
    if cut:  # a call max_tokens ended inside, or the start of its marker: never content
        text = text[: len(text) - _held_back(text, HERMES_OPEN)]
    for match in _HERMES_BLOCK.finditer(text):
        parsed = _hermes_block(match.group(1).strip())
        if parsed is None and cut and match.end() == len(text) and not match.group(0).endswith(HERMES_CLOSE):
            content.append(text[last : match.start()])
            last = match.end()
            break
        if parsed is None:
            continue
        content.append(text[last : match.start()])
        calls += parsed
        last = match.end()
    content.append(text[last:])
    joined = "".join(content).strip()
    if cut and not calls:
        return "".join(content), calls
    return (joined or None) if calls else text, calls


def _parse_llama3(text: str, cut: bool = False) -> tuple[Optional[str], list[ParsedCall]]:
    body = text.strip()
    body = body[len(PYTHON_TAG) :].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(body):
        try:
            value, position = decoder.raw_decode(body, position)
        except ValueError:
            if cut:  # max_tokens ended inside this call: the finished ones only, never the cut JSON
                return None, calls
            return text, []
        call = _call_of(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        rest = body[position:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        position = len(body) - len(rest)
    return None, calls


def parse(
    parser: str, text: str, cut: bool = False, max_calls: Optional[int] = None
) -> tuple[Optional[str], list[ParsedCall]]:
    """(content, calls) of a whole output: content None when the output was calls alone. `cut`: the output
    ended at max_tokens, and a call it ended inside is dropped (the finished calls stay), never sent as text.
    `max_calls` (1 under parallel_tool_calls false): calls past it are dropped, never sent as text either."""
    content, calls = _parse_hermes(text, cut) if parser == "hermes" else _parse_llama3(text, cut)
    return content, calls if max_calls is None else calls[:max_calls]


def _held_back(text: str, marker: str) -> int:
    """How many of text's last characters may begin `marker` (and so are held back from content)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """One streamed choice: push() each delta of text, get (content delta, new calls); finish() the rest."""

    def __init__(self, parser: str, max_calls: Optional[int] = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # 1 under parallel_tool_calls false: later calls are dropped
        self._pending = ""  # text not yet sent: a possible call, or its start
        self._sent_any = False
        self.calls: list[ParsedCall] = []

    def push(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._pending += delta
        if self.parser == "llama3_json":
            return self._push_llama3()
        content, calls = "", []
        while True:
            start = self._pending.find(HERMES_OPEN)
            if start < 0:
                keep = _held_back(self._pending, HERMES_OPEN)
                content += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                break
            content += self._pending[:start]
            self._pending = self._pending[start:]
            end = self._pending.find(HERMES_CLOSE)
            if end < 0:
                break
            block = self._pending[: end + len(HERMES_CLOSE)]
            self._pending = self._pending[end + len(HERMES_CLOSE) :]
            parsed = _hermes_block(block[len(HERMES_OPEN) : -len(HERMES_CLOSE)].strip())
            if parsed is None:
                content += block
            else:
                calls += parsed
        return self._sent(content, calls)

    def _push_llama3(self) -> tuple[str, list[ParsedCall]]:
        if self._sent_any:  # the output began as text: it is content
            content, self._pending = self._pending, ""
            return self._sent(content, [])
        head = self._pending.lstrip()
        if not head or head.startswith("{") or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)]):
            return "", []  # may be calls: held until the end
        content, self._pending = self._pending, ""
        return self._sent(content, [])

    def finish(self, cut: bool = False) -> tuple[str, list[ParsedCall]]:
        """What is left at the end: calls parsed from it, or content; `cut` (max_tokens) drops a call it ended
        inside."""
        rest, self._pending = self._pending, ""
        if not rest:
            return "", []
        content, calls = parse(self.parser, rest, cut)
        if self._sent_any and content:  # content already began: keep its spacing
            content = rest if not calls else content
        return self._sent(content or "", calls)

    def _sent(self, content: str, calls: list[ParsedCall]) -> tuple[str, list[ParsedCall]]:
        if self.max_calls is not None:
            calls = calls[: max(self.max_calls - len(self.calls), 0)]
        self._sent_any = self._sent_any or bool(content) or bool(calls)
        self.calls += calls
        return content, calls
