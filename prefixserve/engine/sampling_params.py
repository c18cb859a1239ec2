"""What a caller asks of one generation; validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Union


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = no limit
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            problems.append(f"temperature must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            problems.append(f"top_k must be -1 (no limit) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(stop, str) or not stop for stop in self.stop):
            problems.append("stop must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            problems.append(f"n must be an integer between 1 and 128, got {self.n!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sample(self, index: int) -> "SamplingParams":
        """Params of the index-th of n samples: a seeded request's samples get seed + index, so
        they differ from each other yet reproduce run to run."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=self.seed + index, n=1)
