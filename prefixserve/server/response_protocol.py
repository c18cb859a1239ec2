"""OpenAI's Responses API request (POST /v1/responses), as pydantic bodies, and its fields we do not implement.

    input        a string, or items: messages (content a string or input_text / output_text parts), function_call
                 and function_call_output items (a tool round trip)
    instructions a system message for this turn only (not carried by previous_response_id, as OpenAI's)
    tools        function tools, flat: {"type": "function", "name", "description", "parameters", "strict"}
    text.format  {"type": "text" | "json_object"} or {"type": "json_schema", "name", "schema", "strict"}

The conversation it becomes is a chat's (response_render.py); the sampling, cache and tool fields mean what
they mean on /v1/chat/completions.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..engine.limits import MAX_NAME_CHARS, RANGES
from .tool_protocol import MAX_TOOLS, FunctionName

# Fields of OpenAI's Responses API this server does not implement, with their no-op values: any other value is
# a 400 naming the field, never accepted and ignored.
UNSUPPORTED_RESPONSE_FIELDS: dict[str, tuple] = {
    "background": (False,),
    "conversation": (),
    "include": ([],),
    "max_tool_calls": (),
    "prompt": (),
    "service_tier": ("auto", "default"),
    "top_logprobs": (0,),
    "truncation": ("disabled",),
    "stream_options": (),
}


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(ResponsesBody):
    """A text part of a message; other kinds (input_image, input_file, input_audio) are refused by name."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: Optional[str] = None


class MessageItem(ResponsesBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallItem(ResponsesBody):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = FunctionName
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(ResponsesBody):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionTool(ResponsesBody):
    type: Literal["function"]
    name: str = FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class NamedFunctionChoice(ResponsesBody):
    type: Literal["function"]
    name: str = FunctionName


class TextFormat(ResponsesBody):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ReasoningOptions(ResponsesBody):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None  # the thinking switch (reasoning.py)
    summary: None = None  # reasoning comes back whole, as a reasoning item's text: no summary is written


class TextOptions(ResponsesBody):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["medium"]] = None  # the one a model without the switch has


class ResponsesCreate(ResponsesBody):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]  # items are read one by one (response_render.py), each error named
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, **RANGES["max_tokens"].field())
    temperature: Optional[float] = Field(default=None, **RANGES["temperature"].field())
    top_p: Optional[float] = Field(default=None, **RANGES["top_p"].field())
    tools: Optional[list[dict[str, Any]]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["auto", "required", "none"], NamedFunctionChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextOptions] = None
    reasoning: Optional[ReasoningOptions] = None
    store: bool = True
    previous_response_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    metadata: Optional[dict[str, str]] = Field(default=None, max_length=16)
    stream: bool = False
    prompt_cache_key: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    cache_ttl: Optional[float] = Field(default=None, **RANGES["ttl"].field())
