"""What a caller asks of one generation; validated where it is built.

The limits below are the single source for the engine and the HTTP server alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Union

# Temperatures below this are greedy (vLLM's convention): dividing logits by a smaller number
# only sharpens the distribution onto its argmax, and in float32 can overflow to inf / NaN.
SAMPLING_EPS = 1e-5
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_N = 16
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
SEED_MIN = -(2**63)  # any signed or unsigned 64-bit integer
SEED_MAX = 2**64 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below SAMPLING_EPS (0 included) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = no limit
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    # Any iterable of ids; stored as a frozenset so the per-token membership test is O(1).
    stop_token_ids: Union[frozenset[int], Iterable[int]] = field(default_factory=frozenset)
    ignore_eos: bool = False
    n: int = 1
    logprobs: Optional[int] = None  # None: off; 0: the sampled token's; k: also the top k

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        problems = self._check_numbers() + self._check_stops()
        if problems:
            raise ValueError("; ".join(problems))

    def _check_numbers(self) -> list[str]:
        problems = []
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            problems.append(f"temperature must be a number between 0 and {MAX_TEMPERATURE}, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            problems.append(f"top_k must be -1 (no limit) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            problems.append(f"seed must be an integer between {SEED_MIN} and {SEED_MAX}, got {self.seed!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            problems.append(f"n must be an integer between 1 and {MAX_N}, got {self.n!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            problems.append(f"logprobs must be an integer between 0 and {MAX_LOGPROBS} (or None), got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        return problems

    def _check_stops(self) -> list[str]:
        problems = []
        if any(not isinstance(stop, str) or not stop for stop in self.stop):
            problems.append("stop must be a non-empty string or a list of non-empty strings")
        elif len(self.stop) > MAX_STOP_STRINGS:
            problems.append(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        elif any(len(stop) > MAX_STOP_STRING_CHARS for stop in self.stop):
            problems.append(f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters long")
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            problems.append(f"stop_token_ids must be a list of token ids, got {ids!r}")
            return problems
        ids = list(ids)
        if any(not _is_int(token_id) or token_id < 0 for token_id in ids):
            problems.append("stop_token_ids must be a list of non-negative integer token ids")
        elif len(ids) > MAX_STOP_TOKEN_IDS:
            problems.append(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        else:
            self.stop_token_ids = frozenset(ids)
        return problems

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def for_sample(self, index: int) -> "SamplingParams":
        """Params of the index-th of n samples: a seeded request's samples get seed + index, so
        they differ from each other yet reproduce run to run."""
        if self.seed is None or index == 0:
            return self
        seed = self.seed + index
        if seed > SEED_MAX:  # wrap within 64 bits: seeds are hashed modulo 2**64 anyway
            seed -= 2**64
        return replace(self, seed=seed, n=1)
