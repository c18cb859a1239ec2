"""Output processing: each step's new tokens -> text with stop strings cut -> RequestOutput.

Holds one RequestDetokenizer per live request. It reports a stop string it found; the
scheduler, the one place requests finish, ends the request.
"""

from __future__ import annotations

from typing import Optional

from .detokenizer import RequestDetokenizer
from .model_version import CurrentVersion
from .outputs import RequestOutput
from .request import Request
from .request_log import RequestLog


class OutputProcessor:
    def __init__(self, current: CurrentVersion) -> None:
        self.current = current
        self._texts: dict[str, RequestDetokenizer] = {}
        self.request_log = RequestLog()  # keys and lengths of recent requests, for the capacity planner

    def add(self, request: Request) -> None:
        if request.request_id in self._texts:
            raise ValueError(f"request id {request.request_id!r} is already in use; give each request its own id")
        self._texts[request.request_id] = RequestDetokenizer(
            self.current.version.tokenizer, request.prompt, request.prompt_token_ids, request.sampling_params.stop
        )

    def forget(self, request_id: str) -> None:
        self._texts.pop(request_id, None)

    def detokenize(self, request: Request) -> Optional[str]:
        """Decode the request's new tokens; returns the stop string that completed, if one did (may raise)."""
        # An EOS / stop token is not part of the text.
        drop_last = request.finish_reason == "stop" and request.stop_reason in request.token_ids[-1:]
        return self._texts[request.request_id].update(request.token_ids, request.is_finished, drop_last)

    def make_output(self, request: Request) -> RequestOutput:
        """What the caller sees now: deltas since the previous output; forgets a finished request."""
        texts = self._texts[request.request_id]
        finished = request.is_finished
        self.request_log.observe(request)
        delta_text = texts.take_delta_text(finished)
        start, end = texts.take_delta_range(request.num_output_tokens)
        output_ids = request.output_token_ids
        logprobs = request.logprobs
        output = RequestOutput(
            request_id=request.request_id,
            prompt=texts.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=output_ids,
            text=texts.emitted_text,
            num_cached_tokens=request.num_cached_tokens,
            finished=finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            delta_text=delta_text,
            delta_token_ids=output_ids[start:end],
            logprobs=None if logprobs is None else list(logprobs),
            delta_logprobs=[] if logprobs is None else logprobs[start:end],
            error=request.error,
            metrics=request.metrics,
        )
        if finished:
            del self._texts[request.request_id]
        return output
