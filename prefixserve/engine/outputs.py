"""What the engine hands back after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .request import RequestMetrics


@dataclass
class TokenLogprob:
    """Log-probability of one output token under the raw model logits (before temperature,
    top-k and top-p, as vLLM's default), with its rank and the top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id among the whole vocabulary
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]  # output tokens so far
    text: str  # output text so far (stop strings cut off)
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    finished: bool
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None  # the stop string or stop token id, when one ended it
    delta_text: str = ""  # text new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)  # output ids new since the previous output
    logprobs: Optional[list[TokenLogprob]] = None  # one per output token so far; None when not asked
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)  # those of delta_token_ids
    error: Optional[str] = None  # why it finished with "error"
    # num_cached_tokens by where the blocks came from: {"device", "host", "disk", "remote"}
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    metrics: Optional[RequestMetrics] = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, text={self.text!r}, "
            f"num_cached_tokens={self.num_cached_tokens}, finished={self.finished}, "
            f"finish_reason={self.finish_reason!r}" + (f", error={self.error!r})" if self.error else ")")
        )
