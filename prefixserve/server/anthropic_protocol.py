"""Anthropic's Messages API bodies (POST /v1/messages, /v1/messages/count_tokens), strict as the OpenAI ones.

Content blocks: text (with cache_control), tool_use (an assistant's call), tool_result (the user's answer to
one); images and documents are refused by name. cache_control {"type": "ephemeral", "ttl": "5m" | "1h"} may mark
up to 4 blocks (tools, system, message content) or the request itself (the last block), as Anthropic allows.
output_config.format is structured output (a JSON schema); thinking, containers and MCP servers are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..engine.limits import MAX_NAME_CHARS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, RANGES
from .tool_protocol import MAX_TOOLS

MAX_BREAKPOINTS = 4
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class AnthropicBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class CacheControl(AnthropicBody):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(AnthropicBody):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None


class ToolUseBlock(AnthropicBody):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(AnthropicBody):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False
    cache_control: Optional[CacheControl] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(AnthropicBody):
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[Block], Field(min_length=1)]]  # [] is a 400, as Anthropic answers


class AnthropicTool(AnthropicBody):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    input_schema: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolChoice(AnthropicBody):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: bool = False


class JsonOutputFormat(AnthropicBody):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicBody):
    format: Optional[JsonOutputFormat] = None
    effort: None = None  # reasoning effort: nothing here reasons, so any value is refused, not ignored


class ThinkingDisabled(AnthropicBody):
    type: Literal["disabled"]  # extended thinking is not served: "enabled" is refused


class MessagesRequest(AnthropicBody):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[AnthropicTool]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Optional[ToolChoice] = None
    cache_control: Optional[CacheControl] = None  # automatic caching: a breakpoint on the last block
    thinking: Optional[ThinkingDisabled] = None
    container: None = None  # code execution containers and MCP servers are not served
    mcp_servers: None = None


class MessagesCreate(MessagesRequest):
    max_tokens: int = Field(**RANGES["max_tokens"].field())
    output_config: Optional[OutputConfig] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: Optional[float] = Field(default=None, **RANGES["top_p"].field())
    top_k: Optional[int] = Field(default=None, ge=0)  # Anthropic's: 0 or more (0: no limit, as no top_k)
    stop_sequences: Optional[
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
            Field(max_length=MAX_STOP_STRINGS),
        ]
    ] = None
    stream: bool = False
    metadata: Optional[dict[str, Any]] = None
    # prefixserve's own, as on the OpenAI endpoints: the cache scope's salt, lifetime and privacy mode
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    cache_ttl: Optional[float] = Field(default=None, **RANGES["ttl"].field())
    cache_retention: Optional[Literal["device", "none"]] = None
    prompt_cache_retention: None = None  # OpenAI's; Anthropic's lifetimes are cache_control's
