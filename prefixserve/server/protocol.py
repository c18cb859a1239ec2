"""OpenAI-compatible request and response bodies (pydantic). Unknown fields are ignored, as OpenAI clients expect."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBody):
    include_usage: bool = False


class SamplingFields(OpenAIBody):
    """Fields both endpoints share; bounds here give 422s that name the field."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=256)
    user: Optional[str] = None


class ChatMessage(OpenAIBody):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        """Text content; OpenAI's list-of-parts form is flattened to its text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
