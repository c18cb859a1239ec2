"""Anthropic's response shapes: the message, its usage, the stream's events, and the error body.

usage as Anthropic defines it: cache_read_input_tokens were read from the cache, cache_creation_input_tokens
were written to it for a cache_control breakpoint (the uncached tokens up to the last one), input_tokens are the
rest; the three add up to the prompt.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from fastapi.responses import JSONResponse

from ..anthropic_chat import anthropic_error_body
from ..engine.outputs import RequestOutput
from .tool_calls import ParsedCall, ToolCallStream, parse


def anthropic_error(status: int, message: str, headers: Optional[dict] = None) -> JSONResponse:
    status = 400 if status == 422 else status  # Anthropic answers a malformed field with a 400
    return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)


def error_event(status: int, message: str) -> str:
    return event("error", anthropic_error_body(status, message))


def usage_of(out: RequestOutput, cache_until: int) -> dict:
    """`cache_until`: the prompt tokens up to the last breakpoint (0 without one)."""
    read = out.num_cached_tokens
    creation = max(0, min(cache_until, len(out.prompt_token_ids)) - read)
    return {
        "input_tokens": len(out.prompt_token_ids) - read - creation,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
        "output_tokens": len(out.token_ids),
    }


def stop_reason_of(out: RequestOutput, called: bool) -> tuple[str, Optional[str]]:
    if called and out.finish_reason == "stop":
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def tool_use_block(call: ParsedCall) -> dict:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def message_body(
    message_id: str,
    model: str,
    out: RequestOutput,
    parser: Optional[str],
    cache_until: int,
    max_calls: Optional[int] = None,
) -> dict:
    cut = out.finish_reason == "length"
    content_text, calls = parse(parser, out.text, cut, max_calls) if parser else (out.text, [])
    content = ([{"type": "text", "text": content_text}] if content_text else []) + [tool_use_block(c) for c in calls]
    stop_reason, stop_sequence = stop_reason_of(out, bool(calls))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_of(out, cache_until),
    }


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


class MessageStream:
    """Anthropic's stream events for one output: message_start, a text block's deltas, one block per tool call
    (its input as one input_json_delta), message_delta with the stop reason and usage, message_stop."""

    def __init__(
        self, message_id: str, model: str, parser: Optional[str], cache_until: int, max_calls: Optional[int] = None
    ) -> None:
        self.message_id, self.model, self.cache_until = message_id, model, cache_until
        self.tools = ToolCallStream(parser, max_calls) if parser else None
        self.started = False
        self.blocks = 0  # content blocks opened so far
        self.text_open = False

    def events(self, out: RequestOutput) -> list[str]:
        events = []
        if not self.started:
            self.started = True
            usage = {**usage_of(out, self.cache_until), "output_tokens": 0}
            events.append(
                event(
                    "message_start",
                    {
                        "type": "message_start",
                        "message": {
                            "id": self.message_id,
                            "type": "message",
                            "role": "assistant",
                            "model": self.model,
                            "content": [],
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": usage,
                        },
                    },
                )
            )
        text, calls = self.tools.push(out.delta_text) if self.tools else (out.delta_text, [])
        if out.finished and self.tools:
            more_text, more_calls = self.tools.finish(out.finish_reason == "length")
            text, calls = text + more_text, calls + more_calls
        if text:
            events += self._text(text)
        for call in calls:
            events += self._close_text()
            block = tool_use_block(call)
            events.append(
                event(
                    "content_block_start",
                    {"type": "content_block_start", "index": self.blocks, "content_block": {**block, "input": {}}},
                )
            )
            events.append(
                event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": self.blocks,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                    },
                )
            )
            events.append(event("content_block_stop", {"type": "content_block_stop", "index": self.blocks}))
            self.blocks += 1
        if out.finished:
            events += self._close_text()
            stop_reason, stop_sequence = stop_reason_of(out, bool(self.tools and self.tools.calls))
            usage = usage_of(out, self.cache_until)
            events.append(
                event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": usage,
                    },
                )
            )
            events.append(event("message_stop", {"type": "message_stop"}))
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if not self.text_open:
            self.text_open = True
            events.append(
                event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": self.blocks,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
            )
        events.append(
            event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.blocks, "delta": {"type": "text_delta", "text": text}},
            )
        )
        return events

    def _close_text(self) -> list[str]:
        if not self.text_open:
            return []
        self.text_open = False
        self.blocks += 1
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]
