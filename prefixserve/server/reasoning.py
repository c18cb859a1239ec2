"""Reasoning models: the chat template's thinking switch, and the <think> text their outputs begin with.

reasoning_effort (chat) / reasoning.effort (Responses)
    a model whose template has the switch (Qwen3, SmolLM3: `enable_thinking`): "none" and "minimal" turn
    thinking off, "low", "medium", "high" on (the templates have no finer knob); not given, the template's
    default (on, for both). A model without one: a 400 naming the model, as OpenAI answers for a model that
    does not reason.
the output of a thinking turn: "<think>R</think>C"
    R is the reasoning (chat: message.reasoning_content, streamed as delta.reasoning_content; Responses: a
    reasoning item), C the content, as vLLM's qwen3 reasoning parser splits it. Until </think> everything is
    reasoning (a template may open <think> in the prompt); a turn cut before </think> is reasoning alone.
"""

from __future__ import annotations

from typing import Optional

from ..http import APIError

THINKING_SWITCH = "enable_thinking"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EFFORTS = ("none", "minimal", "low", "medium", "high")


def has_thinking_switch(template: Optional[str]) -> bool:
    return THINKING_SWITCH in (template or "")


def thinking_of(template: Optional[str], effort: Optional[str], model: str, param: str) -> tuple[dict, bool]:
    """(extra chat-template variables, whether the output is read for reasoning) for this effort."""
    if not has_thinking_switch(template):
        if effort is None:
            return {}, False
        raise APIError(
            400,
            f"{param}: model {model!r} does not reason (its chat template has no {THINKING_SWITCH} switch); "
            f"leave {param} out",
            param=param,
            code="unsupported_parameter",
        )
    if effort is None:
        return {}, True
    thinking = effort not in ("none", "minimal")
    return {THINKING_SWITCH: thinking}, thinking


def _held_back(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split_reasoning(text: str) -> tuple[Optional[str], str]:
    """(reasoning, content) of a whole thinking output: reasoning None when it has none."""
    body = text[len(THINK_OPEN) :] if text.startswith(THINK_OPEN) else text
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body or None, ""
    return body[:end] or None, body[end + len(THINK_CLOSE) :]


class ReasoningStream:
    """A thinking output as it streams: push() each delta, get (reasoning delta, content delta)."""

    def __init__(self) -> None:
        self._pending = ""
        self._started = False  # past a leading <think> (or sure there is none)
        self._thinking = True  # before </think>

    def push(self, delta: str) -> tuple[str, str]:
        if not self._thinking:
            return "", delta
        self._pending += delta
        if not self._started:
            if len(self._pending) < len(THINK_OPEN) and THINK_OPEN.startswith(self._pending):
                return "", ""  # may still be the opening tag
            if self._pending.startswith(THINK_OPEN):
                self._pending = self._pending[len(THINK_OPEN) :]
            self._started = True
        end = self._pending.find(THINK_CLOSE)
        if end >= 0:
            reasoning, content = self._pending[:end], self._pending[end + len(THINK_CLOSE) :]
            self._pending, self._thinking = "", False
            return reasoning, content
        keep = _held_back(self._pending, THINK_CLOSE)
        reasoning = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What was held back at the end: reasoning (the turn ended before </think>)."""
        rest, self._pending = self._pending, ""
        if not self._started and rest.startswith(THINK_OPEN):
            rest = rest[len(THINK_OPEN) :]
        return (rest, "") if self._thinking else ("", rest)
