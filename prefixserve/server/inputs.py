"""From an HTTP body to engine requests: parse strictly, tokenize off the event loop, check limits.

Everything here either returns something the engine can run or raises APIError
with a 4xx: the engine never sees a request that cannot fit or finish.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import NamedTuple, Optional

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ..cache.scoping import compose_salt
from ..engine.async_engine import AsyncLLMEngine
from ..engine.input_processor import LogitBiasError, stricter_retention
from ..engine.limits import ContextLengthError, PromptTooLongError, fit_max_tokens
from ..engine.request import Request as EngineRequest
from ..engine.sampling_params import SamplingParams
from ..http import APIError, split_model
from ..http_body import parse_json_body
from ..lora.adapter_error import AdapterError
from ..lora.lora_request import LoRARequest
from ..prompts import split_prompts
from .errors import most_specific, param_of
from .protocol import UNSUPPORTED_FIELDS, ChatCompletionRequest, SamplingFields, new_id
from .structured_fields import structured_outputs_of
from .tool_prompt import template_input

JSON_MEDIA_TYPES = ("application/json",)


RETENTION_24H = 24 * 3600.0  # seconds: OpenAI's extended prompt cache retention


class CacheOptions(NamedTuple):
    """How a request's prefix is cached: its scope salt, its lifetime, and whose it is (statistics)."""

    salt: Optional[str]
    ttl: Optional[float]  # None: the engine's default (--prefix-ttl)
    tenant: Optional[str]
    retention: Optional[str] = None  # "device" | "none" | None (Request.cache_retention)
    lora: Optional[LoRARequest] = None  # the adapter its model name names (None: the base model)


def cache_options(settings, tenant: Optional[str], body: SamplingFields) -> CacheOptions:
    """The request's cache_ttl (or OpenAI's prompt_cache_retention "24h"), else its tenant's default, capped
    by the server's maximum; the stricter of the request's and the tenant's cache_retention."""
    ttl = body.cache_ttl
    if body.prompt_cache_retention == "24h":
        if ttl is not None:
            raise APIError(
                400,
                "give cache_ttl or prompt_cache_retention, not both",
                param="prompt_cache_retention",
                code="invalid_value",
            )
        if settings.max_cache_ttl < RETENTION_24H:
            raise APIError(
                400,
                f"prompt_cache_retention 24h keeps a prefix for {RETENTION_24H:.0f} s, more than this "
                f"server's --max-cache-ttl ({settings.max_cache_ttl:g} s); use in_memory, or ask the "
                "operator to raise --max-cache-ttl",
                param="prompt_cache_retention",
                code="invalid_value",
            )
        ttl = RETENTION_24H
    if ttl is None:
        ttl = settings.tenant_cache_ttls.get(tenant)
    if ttl is not None:
        ttl = min(ttl, settings.max_cache_ttl)
    retention = stricter_retention(body.cache_retention, settings.tenant_cache_retentions.get(tenant))
    lora = lora_of(settings, getattr(body, "model", None))
    return CacheOptions(compose_salt(tenant, body.cache_salt), ttl, tenant, retention, lora)


def lora_of(settings, model) -> Optional[LoRARequest]:
    """The LoRA adapter a request's model name names (None: the base model, or a name check_model refuses)."""
    if not isinstance(model, str) or not settings.lora_modules:
        return None
    try:
        return settings.lora_modules.request_for(split_model(model)[0])
    except ValueError:
        return None


async def read_body(request: Request, model: type[BaseModel], unsupported: Optional[dict] = None):
    """The body as `model`: 415 for a non-JSON content type, 400 for unreadable JSON, 400 for a field the API has
    and this server does not implement (`unsupported`: refuse_unsupported's table), 422 naming a bad field."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type and media_type not in JSON_MEDIA_TYPES and not media_type.endswith("+json"):
        raise APIError(
            415,
            f"the request body must be JSON (Content-Type: application/json), got {media_type!r}",
            code="unsupported_media_type",
        )
    try:
        payload = parse_json_body(await request.body())
    except ValueError as error:
        raise APIError(400, str(error), code="invalid_json") from None
    if not isinstance(payload, dict):
        raise APIError(
            400, f"the request body must be a JSON object, not {type(payload).__name__}", code="invalid_json"
        )
    refuse_unsupported(payload, model, unsupported)
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        first = most_specific(error.errors())
        param = param_of(first["loc"])
        raise APIError(422, f"{param}: {first['msg']}", param=param, code="invalid_value") from None


def refuse_unsupported(payload: dict, model: type[BaseModel], unsupported: Optional[dict] = None) -> None:
    """A field of OpenAI's or vLLM's API that this server does not implement is refused by name (400),
    never ignored: a client must be able to tell its tools or schema did nothing. A no-op value
    (null, response_format text, best_of 1, no tools) passes. `unsupported`: the API's table of such fields
    and their no-op values (chat and completions': protocol.UNSUPPORTED_FIELDS)."""
    if unsupported is None:
        if not issubclass(model, SamplingFields):
            return
        unsupported = UNSUPPORTED_FIELDS
    for name, value in payload.items():
        no_ops = None if name in model.model_fields else unsupported.get(name)  # chat has tools
        if no_ops is None or value is None or any(type(value) is type(no_op) and value == no_op for no_op in no_ops):
            continue
        hint = f" (or send {no_ops[0]!r}, which does nothing)" if no_ops else ""
        raise APIError(
            400,
            f"{name} is not supported by this server yet; leave it out{hint}",
            param=name,
            code="unsupported_parameter",
        )


def logit_bias_of(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not bias:
        return None
    try:
        by_id = {int(token): value for token, value in bias.items()}
    except ValueError:
        raise APIError(
            400,
            'logit_bias keys must be token ids (integers as strings, e.g. "50256")',
            param="logit_bias",
            code="invalid_value",
        ) from None
    if len(by_id) < len(bias):  # "01" and "1": one token given two biases
        seen: dict[int, str] = {}
        for token in bias:
            if int(token) in seen:
                raise APIError(
                    400,
                    f"logit_bias gives token {int(token)} twice ({seen[int(token)]!r} and {token!r}); give each once",
                    param="logit_bias",
                    code="invalid_value",
                )
            seen[int(token)] = token
    return by_id


def sampling_params(body: SamplingFields, num_logprobs: Optional[int]) -> SamplingParams:
    """Params from the body; max_tokens is settled per prompt, once its length is known."""
    try:
        return SamplingParams(
            max_tokens=None,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k in (None, 0) else body.top_k,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=num_logprobs,
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=logit_bias_of(body.logit_bias),
            min_tokens=body.min_tokens or 0,
            bad_words=body.bad_words or [],
            continued_output_tokens=body.continued_output_tokens or 0,
            structured_outputs=structured_outputs_of(body),
        )
    except ValueError as error:
        raise APIError(400, str(error), code="invalid_value") from None


def completion_prompts(prompt) -> list:
    """A string, a list of strings, a list of token ids, or a list of token-id lists, as a list of prompts."""
    try:
        return split_prompts(prompt)
    except (ValueError, TypeError) as error:
        raise APIError(400, str(error), param="prompt", code="invalid_prompt") from None


def chat_messages(body) -> list[dict]:
    """A chat's messages as text, for a body without tools (/tokenize's)."""
    return [{"role": message.role, "content": message.text()} for message in body.messages]


class RequestBuilder:
    """Tokenizes prompts (in a worker thread) and turns them into engine requests that fit the model."""

    def __init__(self, engine: AsyncLLMEngine, default_max_tokens: int) -> None:
        self.engine = engine
        self.default_max_tokens = default_max_tokens

    # Read from the served version each time: a hot reload swaps it (never while a request is being built).
    @property
    def tokenizer(self):
        return self.engine.queries.version.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.queries.version.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """Any text longer than this has at least max_model_len tokens: refused before tokenizing."""
        return self.max_model_len * self.tokenizer.max_chars_per_token

    def check_text_size(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(
                413,
                f"the {param} has {num_chars} characters, which is more than {self.max_model_len} "
                f"tokens (max_model_len); shorten it",
                param=param,
                code="context_length_exceeded",
            )

    async def chat_prompt(self, body: ChatCompletionRequest, template_kwargs: Optional[dict] = None) -> list[int]:
        """The chat's token ids; `template_kwargs` are the template's other variables (a thinking switch)."""
        text = await self.chat_text(body, template_kwargs or {})
        return await asyncio.to_thread(self.tokenizer.encode, text, False)

    async def chat_text(
        self, body: ChatCompletionRequest, template_kwargs: dict, param: str = "messages", what: str = "these messages"
    ) -> str:
        """The chat as its template renders it (with its tools and tool calls); a refusal names `param`."""
        tokenizer = self.tokenizer
        messages, tools = template_input(body, tokenizer.chat_template)
        self.check_text_size(sum(len(message["content"]) for message in messages) + len(str(tools or "")), param)
        extra = {**template_kwargs, **({"tools": tools} if tools else {})}
        try:
            return await asyncio.to_thread(tokenizer.apply_chat_template, messages, True, **extra)
        except Exception as error:  # a template may reject a conversation (e.g. role order)
            raise APIError(
                400, f"the chat template rejected {what}: {error}", param=param, code="invalid_messages"
            ) from None

    async def build(
        self, prompts: list, params: SamplingParams, max_tokens: Optional[int], n: int, options: CacheOptions
    ) -> list[EngineRequest]:
        """n requests per prompt, in order, each with max_tokens fitted to the room its prompt leaves."""
        requests = []
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_text_size(len(prompt), "prompt")
            first = await self._make(prompt, params, options)
            fitted = self._fitted(params, self._fit_max_tokens(first.num_prompt_tokens, max_tokens))
            first.sampling_params = fitted
            requests.append(first)
            for sample in range(1, n):
                other = await self._make(first.prompt_token_ids, fitted.for_sample(sample), options)
                other.prompt = first.prompt
                requests.append(other)
        return requests

    async def _make(self, prompt, params: SamplingParams, options: CacheOptions) -> EngineRequest:
        def make():
            return self.engine.make_request(
                prompt,
                params,
                new_id("req"),
                options.salt,
                prefix_ttl=options.ttl,
                tenant=options.tenant,
                cache_retention=options.retention,
                lora_request=options.lora,
            )

        try:  # tokenizing text and compiling a grammar take time: off the event loop
            if isinstance(prompt, str) or params.structured_outputs is not None:
                return await asyncio.to_thread(make)
            return make()
        except PromptTooLongError as error:
            raise APIError(413, str(error), param="prompt", code="context_length_exceeded") from None
        except LogitBiasError as error:
            raise APIError(400, str(error), param="logit_bias", code="invalid_value") from None
        except AdapterError as error:  # its files changed under its name into something that cannot be served
            raise APIError(400, str(error), param="model", code="invalid_lora_adapter") from None
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param="prompt", code="invalid_prompt") from None

    @staticmethod
    def _fitted(params: SamplingParams, max_tokens: int) -> SamplingParams:
        try:
            return replace(params, max_tokens=max_tokens)
        except ValueError as error:  # min_tokens above the room left
            raise APIError(400, str(error), param="min_tokens", code="invalid_value") from None

    def _fit_max_tokens(self, num_prompt_tokens: int, requested: Optional[int]) -> int:
        try:  # the offline path's own rule (limits.py), so both refuse the same request the same way
            return fit_max_tokens(num_prompt_tokens, requested, self.max_model_len, self.default_max_tokens)
        except ContextLengthError as error:
            raise APIError(400, str(error), param="max_tokens", code="context_length_exceeded") from None
