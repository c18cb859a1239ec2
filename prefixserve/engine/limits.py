"""What a request may ask for: one table, read by SamplingParams and the input processor (offline)
and by the server's pydantic bodies (HTTP), so both refuse the same values for the same reason.

    RANGES            numeric fields: bounds, the phrase an error uses, pydantic's Field arguments
    MAX_* below       lengths of lists and strings
    fit_max_tokens    a prompt and its max_tokens against max_model_len: the one rule for both paths
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_N = 16
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_NAME_CHARS = 256  # a cache salt or a tenant name
MAX_TOKENIZE_IDS = 1 << 20  # token ids one /detokenize may carry
MAX_LOGIT_BIAS = 1024  # token ids one logit_bias may name
MAX_BAD_WORDS = 64  # bad_words per request, each at most MAX_STOP_STRING_CHARS characters
SEED_MIN = -(2**63)  # any signed or unsigned 64-bit integer
SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class Range:
    """A numeric field's bounds: `low` (exclusive when `open_low`) to `high`, both optional."""

    kind: type  # int or float (a float field takes ints too; neither takes a bool)
    low: Optional[float] = None
    high: Optional[float] = None
    open_low: bool = False
    phrase: str = ""  # what an error says the field must be

    def admits(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else int):
            return False
        if self.kind is float and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or value <= self.high

    def problem(self, name: str, value: object) -> str:
        return f"{name} must be {self.phrase}, got {value!r}"

    def field(self) -> dict:
        """pydantic Field(...) arguments for the same bounds (a 422 naming the field over HTTP)."""
        bounds: dict = {}
        if self.low is not None:
            bounds["gt" if self.open_low else "ge"] = self.low
        if self.high is not None:
            bounds["le"] = self.high
        if self.kind is float:
            bounds["allow_inf_nan"] = False
        return bounds


RANGES = {
    "max_tokens": Range(int, 1, phrase="an integer of at least 1"),
    "temperature": Range(float, 0.0, MAX_TEMPERATURE, phrase=f"a number between 0 and {MAX_TEMPERATURE}"),
    "top_p": Range(float, 0.0, 1.0, open_low=True, phrase="a number in (0, 1]"),
    "top_k": Range(int, -1, phrase="-1 (no limit) or a positive integer"),
    "seed": Range(int, SEED_MIN, SEED_MAX, phrase=f"an integer between {SEED_MIN} and {SEED_MAX}"),
    "n": Range(int, 1, MAX_N, phrase=f"an integer between 1 and {MAX_N}"),
    "logprobs": Range(int, 0, MAX_LOGPROBS, phrase=f"an integer between 0 and {MAX_LOGPROBS} (or None)"),
    "ttl": Range(float, 0.0, open_low=True, phrase="positive seconds (or None)"),  # a cache_ttl, a pin's ttl
    "min_p": Range(float, 0.0, 1.0, phrase="a number between 0 and 1"),
    "presence_penalty": Range(float, -2.0, 2.0, phrase="a number between -2 and 2"),  # OpenAI's range
    "frequency_penalty": Range(float, -2.0, 2.0, phrase="a number between -2 and 2"),
    "repetition_penalty": Range(float, 0.0, 10.0, open_low=True, phrase="a number in (0, 10] (1: off)"),
    "min_tokens": Range(int, 0, phrase="an integer of at least 0"),
    "continued_output_tokens": Range(int, 0, phrase="an integer of at least 0"),
    "logit_bias": Range(float, -100.0, 100.0, phrase="a number between -100 and 100"),  # each value
}


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate within max_model_len (HTTP: 413)."""


class ContextLengthError(ValueError):
    """The prompt fits, but not with the max_tokens asked for (HTTP: 400)."""


def fit_max_tokens(
    num_prompt_tokens: int, requested: Optional[int], max_model_len: int, default: Optional[int] = None
) -> int:
    """The max_tokens a request runs with: `requested` when prompt and output fit max_model_len (else
    ContextLengthError naming the room), or, when none was asked for, `default` cut to the room (no
    default: the whole room, vLLM's max_tokens=None). PromptTooLongError when no room is left."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise PromptTooLongError(
            f"the prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}, "
            "which leaves no room to generate; shorten the prompt"
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens + requested} "
            f"were requested ({num_prompt_tokens} in the prompt, {requested} in the completion); reduce the "
            f"prompt or max_tokens to at most {room}"
        )
    return requested
