"""Input processing: a prompt as a caller gives it -> a validated Request, ready to schedule.

Runs in the caller (thread-safe: it reads the served version once per request, and a version
never changes; a reload swaps in another), so bad input fails there, before the engine sees it.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any, Optional, Union

from ..config import CACHE_RETENTIONS
from ..lora.adapter import LoRAAdapter
from ..lora.lora_request import LoRARequest
from ..lora.registry import AdapterRegistry
from ..prompts import is_token_ids
from .limits import MAX_NAME_CHARS, RANGES, fit_max_tokens
from .model_version import CurrentVersion, ModelVersion
from .request import Request
from .sampling_params import SamplingParams
from .structured_output import Grammar, compiler_for

PromptType = Union[str, list[int], dict[str, Any]]
PROMPT_DICT_FIELDS = {"prompt", "prompt_token_ids", "cache_salt", "cache_retention"}
_STRICTNESS = {None: 0, "device": 1, "none": 2}


def stricter_retention(*retentions: Optional[str]) -> Optional[str]:
    """The strictest of several retention wishes (a tenant's setting and a request's): none > device > None."""
    for retention in retentions:
        if retention is not None and retention not in CACHE_RETENTIONS:
            raise ValueError(f"cache_retention must be one of {list(CACHE_RETENTIONS)} (or absent), got {retention!r}")
    return max(retentions, key=lambda retention: _STRICTNESS[retention], default=None)


def bad_words_token_ids(version: ModelVersion, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
    """Each bad word as the tokenizer spells it alone and after a space (vLLM's two forms), within the vocabulary."""
    vocab_size = version.config.vocab_size
    words: dict[tuple[int, ...], None] = {}
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(version.tokenizer.encode(text, add_special_tokens=False))
            if ids and max(ids) < vocab_size:
                words[ids] = None
    return tuple(words)


def request_grammar(version: ModelVersion, token_ids: list[int], params: SamplingParams) -> Optional[Grammar]:
    """The matcher of the request's structured output, past the output a continued stream already produced."""
    if params.structured_outputs is None:
        return None
    compiler = compiler_for(version.tokenizer, version.config.vocab_size, version.eos_token_ids)
    prior = token_ids[len(token_ids) - params.continued_output_tokens :] if params.continued_output_tokens else ()
    return compiler.grammar(params.structured_outputs, prior)


class LogitBiasError(ValueError):
    """logit_bias names a token the vocabulary does not have (the API names the field, not the prompt)."""


class InputProcessor:
    def __init__(
        self, current: CurrentVersion, prefix_ttl: Optional[float], adapters: Optional[AdapterRegistry] = None
    ) -> None:
        self.current = current
        self.prefix_ttl = prefix_ttl
        self.adapters = adapters  # the LoRA adapters (None: enable_lora is off)

    @staticmethod
    def tokenize(version: ModelVersion, prompt: PromptType) -> tuple[Optional[str], list[int], Optional[str]]:
        """(text or None, token ids, cache salt or None) of a string, token list or vLLM-style dict."""
        cache_salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - PROMPT_DICT_FIELDS
            if unknown:
                raise ValueError(
                    f"unknown prompt field(s) {sorted(unknown)}; use 'prompt' or 'prompt_token_ids' "
                    "and optional 'cache_salt' and 'cache_retention'"
                )
            cache_salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (list of ints)")
        if isinstance(prompt, str):
            return prompt, version.tokenizer.encode(prompt) if prompt else [], cache_salt
        if is_token_ids(prompt) or (isinstance(prompt, (list, tuple)) and not prompt):
            return None, list(prompt), cache_salt
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    @staticmethod
    def validate(version: ModelVersion, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raise ValueError naming the fix (PromptTooLongError, ContextLengthError: limits.py, as over HTTP);
        returns `params` with max_tokens settled (None: the room the prompt leaves)."""
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one character or token id")
        vocab_size = version.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}); check the tokenizer")
        outside = [t for t in params.logit_bias or () if not 0 <= t < vocab_size]
        if outside:
            raise LogitBiasError(f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {vocab_size})")
        max_tokens = fit_max_tokens(len(token_ids), params.max_tokens, version.max_model_len)
        return params if max_tokens == params.max_tokens else replace(params, max_tokens=max_tokens)

    @staticmethod
    def check_salt(salt: object) -> None:
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_NAME_CHARS):
            raise ValueError(
                f"cache_salt must be a string of 1 to {MAX_NAME_CHARS} characters (or None), got {salt!r:.80}"
            )

    def adapter_of(self, lora_request: Optional[LoRARequest]) -> Optional[LoRAAdapter]:
        """The adapter a request runs with (None: the base); ValueError (AdapterError) naming the cause."""
        if lora_request is None:
            return None
        if self.adapters is None:
            raise ValueError("a lora_request needs an engine started with enable_lora=True (serve --enable-lora)")
        return self.adapters.resolve(lora_request)

    def make_request(
        self,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None,
        prefix_ttl: Optional[float] = None,
        tenant: Optional[str] = None,
        cache_retention: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> Request:
        """Tokenize and validate (raises ValueError / TypeError with the fix).

        `prefix_ttl` overrides the engine's default lifetime of this request's cached blocks
        (seconds after their last use); `tenant` only labels the request's statistics;
        `cache_retention` "device" keeps its KV out of every tier, "none" keeps nothing of it
        (the stricter of it and the prompt dict's wins)."""
        retention = stricter_retention(
            cache_retention, prompt.get("cache_retention") if isinstance(prompt, dict) else None
        )
        version = self.current.version  # one read: the whole request is of one version
        text, token_ids, prompt_salt = self.tokenize(version, prompt)
        params = self.validate(version, token_ids, params or SamplingParams())
        if params.continued_output_tokens >= len(token_ids):
            raise ValueError(
                f"continued_output_tokens ({params.continued_output_tokens}) must be fewer than the "
                f"prompt's {len(token_ids)} tokens"
            )
        salt = cache_salt if cache_salt is not None else prompt_salt
        self.check_salt(salt)
        if prefix_ttl is not None and not RANGES["ttl"].admits(prefix_ttl):
            raise ValueError(RANGES["ttl"].problem("prefix_ttl (a request's cache_ttl)", prefix_ttl))
        adapter = self.adapter_of(lora_request)
        scope_digest, private_from = version.scoper.scope_for(token_ids, salt, adapter.fingerprint if adapter else "")
        request = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=token_ids,
            sampling_params=params,
            prompt=text,
            scope_digest=scope_digest,
            private_from=private_from,
            eos_token_ids=version.eos_token_ids,
            max_model_len=version.max_model_len,
            prefix_ttl=self.prefix_ttl if prefix_ttl is None else prefix_ttl,
            tenant=tenant,
            owner=tenant if salt else None,
            lora=adapter,
            lora_id=lora_request.lora_int_id if adapter is not None else None,
            cache_retention=retention,
            bad_words_token_ids=bad_words_token_ids(version, params),
            grammar=request_grammar(version, token_ids, params),
        )
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        long_after = version.config.long_rope_after
        if long_after is not None and len(token_ids) > long_after:  # LongRoPE: a long prompt rotates long throughout
            request.rotate_long()
        return request
