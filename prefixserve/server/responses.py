"""Response bodies and stream chunks of /v1/completions and /v1/chat/completions.

One shape per endpoint builds both the streamed chunks and the whole response,
so the two can never disagree. Logprobs follow OpenAI's two formats (chat:
`content` entries with `bytes` and `top_logprobs`; completions: parallel lists),
and vLLM's `return_token_ids` extension adds the token ids.
"""

from __future__ import annotations

import functools
from typing import Optional

from ..engine.outputs import RequestOutput, TokenLogprob
from ..model import Tokenizer
from .protocol import Usage
from .reasoning import ReasoningStream, split_reasoning
from .tool_calls import ToolCallStream, parse

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; a token the model rules out reports this (as vLLM does)


def usage_of(finals: list[RequestOutput], n: int) -> dict:
    """Usage of outputs in request order; the n samples of a prompt count its prompt once, as OpenAI does."""
    firsts = finals[::n]
    prompt_tokens = sum(len(out.prompt_token_ids) for out in firsts)
    cached = sum(out.num_cached_tokens for out in firsts)
    by_tier: dict[str, int] = {}
    for out in firsts:
        for tier, tokens in out.cached_tokens_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + tokens
    completion = sum(len(out.token_ids) for out in finals)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details={"cached_tokens": cached, "cached_tokens_by_tier": by_tier},
    ).model_dump()


def _tool_finish(finish_reason: Optional[str], called: bool) -> Optional[str]:
    """OpenAI's finish_reason "tool_calls" for an output that ended after calling tools."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class TokenTexts:
    """Text and bytes of single tokens, for logprobs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token_id))


def _finite(logprob: float) -> float:
    """JSON-safe: -inf and NaN (a model that produced NaN logits) report the floor."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


class _Shape:
    """What both endpoints share: ids, token ids on request, per-choice stream state."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        texts: TokenTexts,
        *,
        return_token_ids: bool,
        num_logprobs: Optional[int],
        system_fingerprint: Optional[str] = None,
    ) -> None:
        self.response_id, self.created, self.model = response_id, created, model
        self.system_fingerprint = system_fingerprint  # the model version that served it (changes on a reload)
        self.texts = texts
        self.return_token_ids = return_token_ids
        self.num_logprobs = num_logprobs
        self._prompt_ids_sent: set[int] = set()

    def has_news(self, out: RequestOutput) -> bool:
        """Whether this output deserves a chunk: new text, the end, or new tokens the client asked to see."""
        wants_tokens = self.return_token_ids or self.num_logprobs is not None
        return bool(out.delta_text or out.finished or (wants_tokens and out.delta_token_ids))

    def _envelope(self, object_name: str, choices: list) -> dict:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }

    def _add_token_ids(self, choice: dict, index: int, out: RequestOutput, token_ids: list[int]) -> dict:
        if self.return_token_ids:
            if index not in self._prompt_ids_sent:
                self._prompt_ids_sent.add(index)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choice["token_ids"] = list(token_ids)
        return choice

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage}


class CompletionShape(_Shape):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args, echo: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self._text_offsets: dict[int, int] = {}

    def chunk(self, index: int, out: RequestOutput) -> dict:
        choice = {
            "index": index,
            "text": out.delta_text,
            "logprobs": self._logprobs(index, out.delta_logprobs),
            "finish_reason": out.finish_reason if out.finished else None,
        }
        return self._envelope(self.chunk_object_name, [self._add_token_ids(choice, index, out, out.delta_token_ids)])

    def response(self, finals: list[RequestOutput], usage: dict) -> dict:
        choices = []
        for index, out in enumerate(finals):
            choice = {
                "index": index,
                "text": (out.prompt or "") * self.echo + out.text,
                "logprobs": self._logprobs(index, out.logprobs or []),
                "finish_reason": out.finish_reason,
            }
            choices.append(self._add_token_ids(choice, index, out, out.token_ids))
        return {**self._envelope(self.object_name, choices), "usage": usage}

    def _logprobs(self, index: int, entries: list[TokenLogprob]) -> Optional[dict]:
        if self.num_logprobs is None:
            return None
        text = self.texts.text
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = self._text_offsets.get(index, 0)
        for entry in entries:
            token = text(entry.token_id)
            tokens.append(token)
            token_logprobs.append(_finite(entry.logprob))
            alternatives = {token: _finite(entry.logprob)}
            for token_id, logprob in entry.top:
                alternatives.setdefault(text(token_id), _finite(logprob))
            top_logprobs.append(alternatives)
            offsets.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


class ChatShape(_Shape):
    """With `tool_parser` (tool_calls.py's PARSERS), tool calls in the output become message.tool_calls (streamed:
    tool_calls deltas, each call whole) and finish_reason "tool_calls". With `reasoning` (a thinking turn of a
    reasoning model, reasoning.py), the text before </think> is message.reasoning_content (streamed:
    delta.reasoning_content), and calls are read from the rest."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        *args,
        tool_parser: Optional[str] = None,
        max_calls: Optional[int] = None,
        reasoning: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.max_calls = max_calls  # 1 under parallel_tool_calls false
        self.reasoning = reasoning
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._reasoning_streams: dict[int, ReasoningStream] = {}

    def role_chunk(self, index: int, prompt_token_ids: list[int]) -> dict:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        if self.return_token_ids:
            self._prompt_ids_sent.add(index)
            choice["prompt_token_ids"] = list(prompt_token_ids)
            choice["token_ids"] = []
        return self._envelope(self.chunk_object_name, [choice])

    def chunk(self, index: int, out: RequestOutput) -> dict:
        delta, finish_reason = self._delta(index, out)
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(out.delta_logprobs),
            "finish_reason": finish_reason,
        }
        return self._envelope(self.chunk_object_name, [self._add_token_ids(choice, index, out, out.delta_token_ids)])

    def _delta(self, index: int, out: RequestOutput) -> tuple[dict, Optional[str]]:
        finish_reason = out.finish_reason if out.finished else None
        reasoning, text = "", out.delta_text
        if self.reasoning:
            thinking = self._reasoning_streams.setdefault(index, ReasoningStream())
            reasoning, text = thinking.push(text)
            if out.finished:
                more_reasoning, more_text = thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        thought = {"reasoning_content": reasoning} if reasoning else {}
        if self.tool_parser is None:
            return ({**thought, "content": text} if text else thought), finish_reason
        stream = self._tool_streams.setdefault(index, ToolCallStream(self.tool_parser, self.max_calls))
        content, calls = stream.push(text)
        if out.finished:
            more_content, more_calls = stream.finish(out.finish_reason == "length")
            content, calls = content + more_content, calls + more_calls
        delta: dict = {**thought, "content": content} if content else thought
        if calls:
            first = len(stream.calls) - len(calls)
            delta["tool_calls"] = [call.as_openai(first + i) for i, call in enumerate(calls)]
        return delta, _tool_finish(finish_reason, bool(stream.calls))

    def _message(self, out: RequestOutput) -> tuple[dict, Optional[str]]:
        reasoning, text = split_reasoning(out.text) if self.reasoning else (None, out.text)
        thought = {"reasoning_content": reasoning} if self.reasoning else {}
        if self.tool_parser is None:
            return {"role": "assistant", "content": text, **thought}, out.finish_reason
        content, calls = parse(self.tool_parser, text, out.finish_reason == "length", self.max_calls)
        message = {"role": "assistant", "content": content, **thought}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return message, _tool_finish(out.finish_reason, bool(calls))

    def response(self, finals: list[RequestOutput], usage: dict) -> dict:
        choices = []
        for index, out in enumerate(finals):
            message, finish_reason = self._message(out)
            choice = {
                "index": index,
                "message": message,
                "logprobs": self._logprobs(out.logprobs or []),
                "finish_reason": finish_reason,
            }
            choices.append(self._add_token_ids(choice, index, out, out.token_ids))
        return {**self._envelope(self.object_name, choices), "usage": usage}

    def _logprobs(self, entries: list[TokenLogprob]) -> Optional[dict]:
        if self.num_logprobs is None:
            return None
        texts = self.texts

        def item(token_id: int, logprob: float) -> dict:
            return {"token": texts.text(token_id), "logprob": _finite(logprob), "bytes": texts.bytes(token_id)}

        content = [
            {
                **item(entry.token_id, entry.logprob),
                "top_logprobs": [item(token_id, logprob) for token_id, logprob in entry.top],
            }
            for entry in entries
        ]
        return {"content": content, "refusal": None}
