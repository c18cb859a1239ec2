"""What the engine's steps add up to: prompt tokens computed and served, output tokens, each token's time.

Read by the engine snapshot (async_engine.EngineSnapshot) for /metrics, under our names and vLLM's.
"""

from __future__ import annotations

import time
from typing import Iterable

from .request import Request


class StepCounters:
    def __init__(self) -> None:
        self.num_prefill_tokens_computed = 0  # prompt tokens run through the model (cache hits not counted)
        self.num_prompt_tokens = 0  # whole prompts of requests that reached their first token (vllm:prompt_tokens)
        self.num_generation_tokens = 0

    def scheduled(self, scheduled: Iterable[tuple[Request, int]]) -> None:
        """A step is about to compute these (request, new tokens)."""
        for request, num_new in scheduled:
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.num_prefill_tokens_computed += min(
                    num_new, request.num_prompt_tokens - request.num_computed_tokens
                )

    def produced(self, updated: list[Request], num_tokens: int) -> None:
        """These requests got output tokens in the step just run, num_tokens in all (a drafted request more
        than one)."""
        self.num_generation_tokens += num_tokens
        now = time.monotonic()
        for request in updated:
            if request.metrics.first_token_time is None:
                self.num_prompt_tokens += request.num_prompt_tokens
            request.metrics.record_token(now)
