"""OpenAI's tool fields: the tools a chat request offers, its tool_choice, and the tool calls in messages."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128
FunctionName = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")


class ToolBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(ToolBody):
    name: str = FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; none: no arguments ({})
    strict: Optional[bool] = None  # tool_choice required / named enforce the schema either way


class Tool(ToolBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(ToolBody):
    name: str = FunctionName


class NamedToolChoice(ToolBody):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(ToolBody):
    name: str = FunctionName
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(ToolBody):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction
