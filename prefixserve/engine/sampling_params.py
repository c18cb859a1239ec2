"""What a caller asks of one generation; validated where it is built, against limits.py's table
(which the HTTP server's bodies read too).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Union

from .limits import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RANGES,
    SEED_MAX,
)
from .structured_output import StructuredOutputs

# Temperatures below this are greedy (vLLM's convention): dividing logits by a smaller number
# only sharpens the distribution onto its argmax, and in float32 can overflow to inf / NaN.
SAMPLING_EPS = 1e-5
NUMERIC_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "logprobs",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "continued_output_tokens",
)
OPTIONAL_FIELDS = ("max_tokens", "seed", "logprobs")  # None: as many as fit, unseeded, no logprobs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: Optional[int] = 16  # None: as many as max_model_len leaves room for (vLLM's None)
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
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest (vLLM's); 0: off
    # What the logits go through first (logits_processors.py): OpenAI's penalties and bias, vLLM's others.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit
    min_tokens: int = 0  # no end-of-sequence or stop token id before this many tokens
    bad_words: list[str] = field(default_factory=list)  # never generated (tokenized per request)
    # The last tokens of the prompt that an earlier part of this same generation produced (a stream a
    # router continues on another replica): the penalties, min_tokens and bad_words count them as output.
    continued_output_tokens: int = 0
    # A grammar the output follows (structured_output.py): a JSON schema, any JSON object, a regex, a choice.
    structured_outputs: Optional[StructuredOutputs] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        problems = self._check_numbers() + self._check_stops() + self._check_lists()
        if problems:
            raise ValueError("; ".join(problems))

    def _check_numbers(self) -> list[str]:
        problems = []
        for name in NUMERIC_FIELDS:
            value = getattr(self, name)
            if not (value is None and name in OPTIONAL_FIELDS) and not RANGES[name].admits(value):
                problems.append(RANGES[name].problem(name, value))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            problems.append("structured_outputs must be a StructuredOutputs (prefixserve.StructuredOutputs)")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        return problems

    def _check_lists(self) -> list[str]:
        problems = []
        prior = self.continued_output_tokens if _is_int(self.continued_output_tokens) else 0
        if (
            self.max_tokens is not None
            and _is_int(self.min_tokens)
            and _is_int(self.max_tokens)
            and self.min_tokens > self.max_tokens + prior
        ):
            problems.append(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
                + (f" plus continued_output_tokens ({prior})" if prior else "")
            )
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                problems.append(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
            elif any(not _is_int(token) or token < 0 for token in bias):
                problems.append("logit_bias keys must be non-negative integer token ids")
            elif any(not RANGES["logit_bias"].admits(value) for value in bias.values()):
                problems.append(f"logit_bias values must be {RANGES['logit_bias'].phrase}")
            else:
                self.logit_bias = {token: float(value) for token, value in bias.items()} or None
        words = self.bad_words
        if (
            not isinstance(words, list)
            or len(words) > MAX_BAD_WORDS
            or any(not isinstance(word, str) or not word.strip() or len(word) > MAX_STOP_STRING_CHARS for word in words)
        ):
            problems.append(
                f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                f"{MAX_STOP_STRING_CHARS} characters"
            )
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
