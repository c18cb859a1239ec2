"""OpenAI-compatible request and response bodies (pydantic).

Validation is strict: `true` is not a number, `"yes"` is not a boolean, `[true]` is
not a list of token ids. Unknown fields are ignored, as OpenAI clients expect. The
limits come from the engine's table (engine/limits.py), which SamplingParams reads too.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from ..engine.limits import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_NAME_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RANGES,
)
from .structured_fields import MAX_CHOICES, ResponseFormat, StructuredOutputsBody
from .tool_protocol import MAX_TOOLS, NamedToolChoice, Tool, ToolCall

StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_STRING_CHARS)]


# Fields of OpenAI's and vLLM's APIs this server does not implement yet, with their no-op values: any other
# value is refused with a 400 naming the field (server/inputs.py), never accepted and ignored.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "suffix": ("",),
    "best_of": (1,),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "logits_processors": (),
    "allowed_token_ids": (),
    "truncate_prompt_tokens": (),
    "top_a": (),
    "typical_p": (1.0,),
    "length_penalty": (1.0,),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "prompt_logprobs": (),
    "store": (False,),
}


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(OpenAIBody):
    include_usage: bool = False


class SamplingFields(OpenAIBody):
    """Fields both endpoints share; bounds here give 422s that name the field. What the structured-output
    fields (response_format, structured_outputs, guided_*) ask for, structured_fields.py reads."""

    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = Field(default=None, max_length=MAX_CHOICES)
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[Literal["auto", "guidance", "llguidance"]] = None  # the one we have

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, **RANGES["max_tokens"].field())
    temperature: Optional[float] = Field(default=None, **RANGES["temperature"].field())
    top_p: Optional[float] = Field(default=None, **RANGES["top_p"].field())
    top_k: Optional[int] = Field(default=None, **RANGES["top_k"].field())
    seed: Optional[int] = Field(default=None, **RANGES["seed"].field())
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None] = None
    stop_token_ids: Optional[list[int]] = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    n: int = Field(default=1, **RANGES["n"].field())
    ignore_eos: bool = False
    # What the logits go through before sampling (engine/logits_processors.py): OpenAI's penalties and
    # logit_bias (token ids as strings, as OpenAI sends them), vLLM's min_p, repetition_penalty,
    # min_tokens and bad_words.
    min_p: Optional[float] = Field(default=None, **RANGES["min_p"].field())
    presence_penalty: Optional[float] = Field(default=None, **RANGES["presence_penalty"].field())
    frequency_penalty: Optional[float] = Field(default=None, **RANGES["frequency_penalty"].field())
    repetition_penalty: Optional[float] = Field(default=None, **RANGES["repetition_penalty"].field())
    logit_bias: Optional[dict[str, float]] = Field(default=None, max_length=MAX_LOGIT_BIAS)
    min_tokens: Optional[int] = Field(default=None, **RANGES["min_tokens"].field())
    bad_words: Optional[Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)]] = None
    # Ours, for a router continuing a stream: the prompt's last N tokens are this generation's output so far.
    continued_output_tokens: Optional[int] = Field(default=None, **RANGES["continued_output_tokens"].field())
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    # Seconds this request's cached prefix lives after its last use (capped by the server's
    # --max-cache-ttl); absent: the tenant's default from the keys file, else --prefix-ttl.
    cache_ttl: Optional[float] = Field(default=None, **RANGES["ttl"].field())
    # Privacy mode (our field): "device" keeps this request's KV in device memory only (no host, disk or
    # shared tier), "none" keeps nothing of it after it finishes. A tenant's keys-file setting, if
    # stricter, wins.
    cache_retention: Optional[Literal["device", "none"]] = None
    # OpenAI's: the key a router keeps on one replica (router/fleet.py; it scopes nothing: the tenant and
    # cache_salt do), and how long the prefix is kept: in_memory the default TTL, 24h for a day
    # (within --max-cache-ttl).
    prompt_cache_key: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    user: Optional[str] = None
    return_token_ids: bool = False  # vLLM's extension: prompt and output token ids in the response


class TextPart(OpenAIBody):
    """A content part; only text ones are served (template_input refuses the others by name, with a 400)."""

    type: str
    text: Optional[str] = None

    @model_validator(mode="after")
    def _text_has_text(self) -> "TextPart":
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs its text (a string)")
        return self


class ChatMessage(OpenAIBody):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant turn's calls (tool_protocol.py)
    tool_call_id: Optional[str] = Field(default=None, max_length=256)  # a tool result: the call it answers

    def text(self) -> str:
        """Text content; OpenAI's list-of-parts form is joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[Tool]] = Field(default=None, max_length=MAX_TOOLS)  # tool_protocol.py
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None  # None: true, as OpenAI's default
    max_completion_tokens: Optional[int] = Field(default=None, **RANGES["max_tokens"].field())
    # a reasoning model's thinking switch (server/reasoning.py); a model without one refuses it
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, **RANGES["logprobs"].field())

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, **RANGES["logprobs"].field())

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    @property
    def num_logprobs(self) -> Optional[int]:
        return self.logprobs


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = Field(default_factory=dict)  # device, host, disk, remote


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
