"""vLLM's `speculative_config`, checked: what `LLM(speculative_config=...)` and `serve --speculative-config JSON` take.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}

proposes, each decode step, the k tokens that followed the latest earlier occurrence of the sequence's last n..m
tokens (prompt lookup), and verifies them in one step of the target model (engine/speculation.py). A draft model
(`{"model": ..., "num_speculative_tokens": k}`) is vLLM's other spelling; it is refused here, naming the field,
until it is served. Plain Python: the CLI and the router read it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .json_options import parse_option

MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    model: Optional[str] = None

    def __post_init__(self) -> None:
        where = "speculative_config"
        if self.model is not None:
            raise ValueError(
                f"{where}.model: draft-model speculation is not served yet; use "
                '{"method": "ngram", "num_speculative_tokens": k} (prompt lookup)'
            )
        if self.method != "ngram":
            raise ValueError(f"{where}.method must be 'ngram' (prompt lookup), got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"{where}.num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        # vLLM's defaults: 5 and 5 when neither is given, else the one given for both
        longest, shortest = self.prompt_lookup_max, self.prompt_lookup_min
        if longest is None and shortest is None:
            longest = shortest = 5
        longest = shortest if longest is None else longest
        shortest = longest if shortest is None else shortest
        for name, value in (("prompt_lookup_max", longest), ("prompt_lookup_min", shortest)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"{where}.{name} must be an integer from 1 to 64, got {value!r}")
        if shortest > longest:
            raise ValueError(f"{where}.prompt_lookup_min ({shortest}) must be at most prompt_lookup_max ({longest})")
        object.__setattr__(self, "prompt_lookup_max", longest)
        object.__setattr__(self, "prompt_lookup_min", shortest)

    @classmethod
    def parse(cls, value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """From what a user gives: JSON text (the --speculative-config flag), a dict, or the config itself."""
        return parse_option(cls, value, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 4}')
