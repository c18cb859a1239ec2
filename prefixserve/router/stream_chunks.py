"""Each chunk of a relayed stream as the client gets it, and what each choice has sent so far.

`ClientChunks` is the half of `streams.StreamRelay` that reads chunks: it notes per
choice what reached the client (prompt ids, output ids, text, finish reason), which a
continuation needs; strips the token ids the relay asked for unless the client asked
too; keeps the first stream's envelope (id, created, model) on every later chunk; and,
once choice 0 is continued on another replica, reshapes that replica's completion
chunks into the client's stream (continuation.py).
"""

from __future__ import annotations

from typing import Iterator, Optional

from ..http import fingerprint_version
from .continuation import ChoiceProgress, ContinuedText, reshape_chunk, usage_of
from .inbound import ClientRequest
from .sse import sse

ENVELOPE = ("id", "object", "created", "model", "system_fingerprint")  # continuations keep them (same version)


class ClientChunks:
    """What the client has been sent of a stream, choice by choice, and the chunks to send it next."""

    def __init__(self, request: ClientRequest) -> None:
        self.request = request
        self.choices: dict[int, ChoiceProgress] = {}
        self.envelope: Optional[dict] = None  # id, object, created, model, fingerprint of the stream the client sees
        options = request.body.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.usage_sent = False
        self.continued: Optional[ContinuedText] = None  # set once choice 0 is produced by a continuation
        self.stopped_here = False  # the router found a stop string the continuing replica could not see

    @property
    def version(self) -> Optional[str]:
        """The model version the stream began on, as its first chunk's system_fingerprint names it (the replica
        writes the version that serves the request, read inside its reload gate); None before any chunk, or when
        the replica named none. The router's own record of the replica's version may be older than the stream."""
        return fingerprint_version(self.envelope.get("system_fingerprint")) if self.envelope is not None else None

    def _pieces(self, chunk: dict) -> Iterator[bytes]:
        if self.envelope is None:
            self.envelope = {k: chunk[k] for k in ENVELOPE if k in chunk}
        if self.continued is not None:
            yield from self._continued_pieces(chunk)
            return
        chunk.update(self.envelope)  # a replayed request keeps the id the client already has
        choices = chunk.get("choices") if isinstance(chunk.get("choices"), list) else []
        kept = [choice for choice in choices if isinstance(choice, dict) and self._note(choice)]
        if "usage" in chunk and chunk["usage"] is not None:
            self.usage_sent = True
        elif choices and not kept:
            return  # only token ids the client did not ask for
        chunk["choices"] = kept
        yield sse(chunk)

    def _note(self, choice: dict) -> bool:
        """Record what this choice sends; False when nothing in it is for the client."""
        progress = self.choices.setdefault(choice.get("index", 0), ChoiceProgress())
        wants = self.request.wants_token_ids
        prompt_ids = choice.get("prompt_token_ids") if wants else choice.pop("prompt_token_ids", None)
        if progress.prompt_token_ids is None and isinstance(prompt_ids, list):
            progress.prompt_token_ids = list(prompt_ids)
        token_ids = choice.get("token_ids") if wants else choice.pop("token_ids", None)
        if isinstance(token_ids, list):
            progress.output_token_ids.extend(token_ids)
        if self.request.is_chat:
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if "role" in delta and progress.role_sent:
                delta.pop("role")  # a replay's role chunk; the client has one
            progress.role_sent = progress.role_sent or "role" in delta
            text = delta.get("content")
            visible = "role" in delta
        else:
            text = choice.get("text")
            visible = False
        if isinstance(text, str):
            progress.text_sent += text
            visible = visible or bool(text)
        if choice.get("finish_reason") is not None:
            progress.finish_reason = choice["finish_reason"]
            visible = True
        return visible or wants or choice.get("logprobs") is not None

    def _continued_pieces(self, chunk: dict) -> Iterator[bytes]:
        progress = self.choices[0]
        choices = chunk.get("choices") if isinstance(chunk.get("choices"), list) else []
        if not choices and isinstance(chunk.get("usage"), dict):
            if self.include_usage:
                self.usage_sent = True
                yield sse({**self.envelope, "choices": [], "usage": usage_of([progress], 1, chunk["usage"])})
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            token_ids = [t for t in choice.get("token_ids") or [] if isinstance(t, int)]
            progress.output_token_ids.extend(token_ids)
            finish_reason = choice.get("finish_reason")
            text, stopped = self.continued.push(token_ids, finish_reason)
            if stopped:
                finish_reason, self.stopped_here = "stop", True
            progress.text_sent += text
            progress.finish_reason = finish_reason
            if text or finish_reason or choice.get("logprobs") is not None or self.request.wants_token_ids:
                yield sse(
                    reshape_chunk(
                        self.envelope,
                        self.request.is_chat,
                        text,
                        finish_reason,
                        choice.get("logprobs"),
                        token_ids if self.request.wants_token_ids else None,
                    )
                )
            if stopped:
                return
