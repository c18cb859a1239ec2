"""The Responses API's response object and its stream of typed events, built from one engine output.

One ResponseShape builds both the whole object and the events, so a streamed response ends with exactly the
object GET /v1/responses/{id} returns:

    response.created, response.in_progress
    a message item:  output_item.added, content_part.added, output_text.delta ..., output_text.done,
                     content_part.done, output_item.done
    each call:       output_item.added, function_call_arguments.delta, function_call_arguments.done,
                     output_item.done
    response.completed (or response.incomplete, cut by max_output_tokens), every event with its sequence_number

Tool calls are read from the output as on /v1/chat/completions (tool_calls.py): the text before a call is the
message, a call is a function_call item; a call cut by max_output_tokens never reaches the client as text. A
reasoning model's thinking (reasoning.py) comes first, as a reasoning item (response.reasoning_text.delta /
.done between its output_item.added and .done).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Iterator, Optional

from ..engine.outputs import RequestOutput
from .reasoning import ReasoningStream, split_reasoning
from .tool_calls import ParsedCall, ToolCallStream, parse


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(out: RequestOutput) -> dict:
    return {
        "input_tokens": len(out.prompt_token_ids),
        "input_tokens_details": {
            "cached_tokens": out.num_cached_tokens,
            "cached_tokens_by_tier": dict(out.cached_tokens_by_tier),
        },
        "output_tokens": len(out.token_ids),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
    }


def _event(kind: str, sequence: int, **fields) -> str:
    payload = {"type": kind, "sequence_number": sequence, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ResponseShape:
    """The response object of one turn; `request` is what the object echoes (tools, text, metadata, ...). With
    `reasoning` (a thinking turn of a reasoning model, reasoning.py) the text before </think> is a reasoning item,
    first in the output."""

    def __init__(
        self,
        response_id: str,
        model: str,
        request: dict,
        tool_parser: Optional[str],
        max_calls: Optional[int] = None,
        reasoning: bool = False,
    ) -> None:
        self.response_id, self.model, self.request = response_id, model, request
        self.tool_parser = tool_parser
        self.max_calls = max_calls  # 1 under parallel_tool_calls false
        self.reasoning = reasoning
        self.created_at = int(time.time())
        self.message_id, self.reasoning_id = item_id("msg"), item_id("rs")
        self._stream = ToolCallStream(tool_parser, max_calls) if tool_parser else None
        self._thinking = ReasoningStream() if reasoning else None
        self._sequence = 0
        self.message_text = ""  # the message's text (streamed: sent so far)
        self.reasoning_text = ""
        self.finished_body: Optional[dict] = None  # the object once the output finished
        self._open: dict[str, int] = {}  # "reasoning" / "message" -> output index, while streaming it
        self._output: list[dict] = []  # finished items, in output order
        self._held: list[ParsedCall] = []  # calls read from the stream, sent once the message is closed
        self.calls: list[dict] = []  # function_call items, as they were sent

    # ---- the whole object ------------------------------------------------------------------------
    def body(self, status: str, output: list[dict], usage: Optional[dict], reason: Optional[str] = None) -> dict:
        request = self.request
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": request.get("instructions"),
            "max_output_tokens": request.get("max_output_tokens"),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
            "previous_response_id": request.get("previous_response_id"),
            "reasoning": request.get("reasoning") or {"effort": None, "summary": None},
            "temperature": request.get("temperature", 1.0),
            "top_p": request.get("top_p", 1.0),
            "tool_choice": request.get("tool_choice") or "auto",
            "tools": request.get("tools") or [],
            "text": request.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": request.get("store", True),
            "metadata": request.get("metadata") or {},
            "usage": usage,
        }

    def final(self, out: RequestOutput) -> dict:
        """The finished object of a whole (unstreamed) output."""
        cut = out.finish_reason == "length"
        reasoning, text = split_reasoning(out.text) if self.reasoning else (None, out.text)
        content, calls = parse(self.tool_parser, text, cut, self.max_calls) if self.tool_parser else (text, [])
        output = []
        if reasoning:
            self.reasoning_text = reasoning
            output.append(self._reasoning_item(reasoning, "completed"))
        self.message_text = content or ""
        if content:
            output.append(self._message_item(content, "completed"))
        self.calls = [self._call_item(call) for call in calls]
        return self._finished_body(out, output + self.calls)

    def _finished_body(self, out: RequestOutput, output: list[dict]) -> dict:
        cut = out.finish_reason == "length"
        reason = "max_output_tokens" if cut else None
        self.finished_body = self.body("incomplete" if cut else "completed", output, usage_of(out), reason)
        return self.finished_body

    def _message_item(self, text: str, status: str) -> dict:
        parts = [self._text_part(text)] if status == "completed" or text else []
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": parts}

    def _reasoning_item(self, text: str, status: str) -> dict:
        parts = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {"id": self.reasoning_id, "type": "reasoning", "status": status, "summary": [], "content": parts}

    @staticmethod
    def _text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _call_item(call: ParsedCall, status: str = "completed") -> dict:
        return {
            "id": item_id("fc"),
            "type": "function_call",
            "status": status,
            "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": call.name,
            "arguments": call.arguments,
        }

    # ---- the stream ------------------------------------------------------------------------------
    def _next(self, kind: str, **fields) -> str:
        text = _event(kind, self._sequence, **fields)
        self._sequence += 1
        return text

    def failed(self, message: str, code: Optional[str]) -> str:
        """The last event of a stream whose request failed (response.failed, with the error)."""
        failed = {**self.body("failed", [], None), "error": {"code": code or "server_error", "message": message}}
        return self._next("response.failed", response=failed)

    def opening(self) -> Iterator[str]:
        started = self.body("in_progress", [], None)
        yield self._next("response.created", response=started)
        yield self._next("response.in_progress", response=started)

    def events(self, out: RequestOutput) -> Iterator[str]:
        """The events one engine output adds; the closing ones when it is the last."""
        text = out.delta_text
        if self._thinking is not None:
            reasoning, text = self._thinking.push(text)
            if out.finished:
                more_reasoning, more_text = self._thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                yield from self._reasoning_delta(reasoning)
            if text or out.finished:
                yield from self._close_reasoning()
        if self._stream is not None:
            content, calls = self._stream.push(text)
            if out.finished:
                more_content, more_calls = self._stream.finish(out.finish_reason == "length")
                content, calls = content + more_content, calls + more_calls
        else:
            content, calls = text, []
        if content:
            yield from self._text_delta(content)
        self._held += calls
        if out.finished:
            yield from self._close_message()
            for call in self._held:
                yield from self._call_events(call)
            self._held = []
            finished = self._finished_body(out, self._output)
            kind = "response.incomplete" if finished["status"] == "incomplete" else "response.completed"
            yield self._next(kind, response=finished)

    def _reasoning_delta(self, delta: str) -> Iterator[str]:
        if "reasoning" not in self._open:
            index = self._open["reasoning"] = len(self._output)
            yield self._next(
                "response.output_item.added", output_index=index, item=self._reasoning_item("", "in_progress")
            )
        self.reasoning_text += delta
        yield self._next(
            "response.reasoning_text.delta",
            item_id=self.reasoning_id,
            output_index=self._open["reasoning"],
            content_index=0,
            delta=delta,
        )

    def _close_reasoning(self) -> Iterator[str]:
        index = self._open.pop("reasoning", None)
        if index is None:
            return
        item = self._reasoning_item(self.reasoning_text, "completed")
        yield self._next(
            "response.reasoning_text.done",
            item_id=self.reasoning_id,
            output_index=index,
            content_index=0,
            text=self.reasoning_text,
        )
        yield self._next("response.output_item.done", output_index=index, item=item)
        self._output.append(item)

    def _text_delta(self, delta: str) -> Iterator[str]:
        if "message" not in self._open:
            index = self._open["message"] = len(self._output)
            yield self._next(
                "response.output_item.added", output_index=index, item=self._message_item("", "in_progress")
            )
            yield self._next(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=index,
                content_index=0,
                part=self._text_part(""),
            )
        self.message_text += delta
        yield self._next(
            "response.output_text.delta",
            item_id=self.message_id,
            output_index=self._open["message"],
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def _close_message(self) -> Iterator[str]:
        index = self._open.pop("message", None)
        if index is None:
            return
        part = self._text_part(self.message_text)
        item = self._message_item(self.message_text, "completed")
        yield self._next(
            "response.output_text.done",
            item_id=self.message_id,
            output_index=index,
            content_index=0,
            text=self.message_text,
            logprobs=[],
        )
        yield self._next(
            "response.content_part.done", item_id=self.message_id, output_index=index, content_index=0, part=part
        )
        yield self._next("response.output_item.done", output_index=index, item=item)
        self._output.append(item)

    def _call_events(self, call: ParsedCall) -> Iterator[str]:
        index = len(self._output)
        item = self._call_item(call)
        yield self._next(
            "response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}
        )
        yield self._next(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=call.arguments
        )
        yield self._next(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=call.arguments,
            name=call.name,
        )
        yield self._next("response.output_item.done", output_index=index, item=item)
        self._output.append(item)
        self.calls.append(item)
