"""A Responses API request as the chat it is: input items to chat messages, flat function tools to chat tools,
text.format to response_format; and a turn's output items back to the assistant message a later turn replays.

    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        -> {"role": "user", "content": "hi"}
    {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}      (consecutive ones merge)
        -> {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "function": {...}}]}
    {"type": "function_call_output", "call_id": "call_1", "output": "42"}
        -> {"role": "tool", "tool_call_id": "call_1", "content": "42"}

Every refusal names the field as the client wrote it (input.2.content.0.type, tools.1.type, ...).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from ..http import APIError
from .errors import most_specific
from .response_objects import item_id
from .response_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    NamedFunctionChoice,
    ResponsesCreate,
)

TEXT_PARTS = ("input_text", "output_text", "text")


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _parse(model: type[BaseModel], value: Any, param: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as error:
        first = most_specific(error.errors())
        where = ".".join(str(part) for part in (param, *first["loc"]))
        raise _invalid(where, first["msg"]) from None


def _text_of(content, param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise APIError(
                400,
                f"{param}.{index}.type: {part.type!r} parts are not supported: this model takes text only "
                "(send input_text parts)",
                param=f"{param}.{index}.type",
                code="unsupported_content",
            )
        if part.text is None:
            raise _invalid(f"{param}.{index}.text", "a text part needs its text")
        texts.append(part.text)
    return "".join(texts)


def input_messages(input_value) -> list[dict]:
    """The chat messages of `input` (a string, or items), in order."""
    if isinstance(input_value, str):
        return [{"role": "user", "content": input_value}]
    if not input_value:
        raise _invalid("input", "give at least one item (or a string)")
    messages: list[dict] = []
    for index, raw in enumerate(input_value):
        param = f"input.{index}"
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind == "message":
            item = _parse(MessageItem, raw, param)
            messages.append({"role": item.role, "content": _text_of(item.content, f"{param}.content")})
        elif kind == "function_call":
            item = _parse(FunctionCallItem, raw, param)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]  # the same turn's text, then its calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            item = _parse(FunctionCallOutputItem, raw, param)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            raise APIError(
                400,
                f"{param}.type: {kind!r} items are not supported; send message, function_call or "
                "function_call_output items",
                param=f"{param}.type",
                code="unsupported_item",
            )
    return messages


def input_items(input_value) -> list[dict]:
    """`input` as the items GET /v1/responses/{id}/input_items lists, each with an id (a string: one user
    message; text parts as input_text)."""
    raw_items = (
        [{"type": "message", "role": "user", "content": input_value}] if isinstance(input_value, str) else input_value
    )
    items = []
    for raw in raw_items:
        item = dict(raw)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", item_id("msg" if kind == "message" else "fc" if kind == "function_call" else "fco"))
        items.append(item)
    return items


def chat_tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    if not tools:
        return None
    converted = []
    for index, raw in enumerate(tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise APIError(
                400,
                f"tools.{index}.type: {kind!r} tools are not supported by this server; send function tools",
                param=f"tools.{index}.type",
                code="unsupported_tool",
            )
        tool = _parse(FunctionTool, raw, f"tools.{index}")
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        if tool.strict is not None:
            function["strict"] = tool.strict
        converted.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return converted


def chat_tool_choice(choice) -> Any:
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def response_format(body: ResponsesCreate) -> Optional[dict]:
    text_format = body.text.format if body.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.json_schema is None:
        raise _invalid("text.format.schema", "a json_schema format needs its schema (a JSON schema object)")
    schema = {"name": text_format.name or "response", "schema": text_format.json_schema}
    if text_format.strict is not None:
        schema["strict"] = text_format.strict
    return {"type": "json_schema", "json_schema": schema}


def chat_body(body: ResponsesCreate, history: list[dict]) -> dict:
    """The /v1/chat/completions body this request is: instructions, then the stored turns, then `input`."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += history + input_messages(body.input)
    chat = {
        "model": body.model,
        "messages": messages,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "response_format": response_format(body),
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "stream": body.stream,
        "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
        "cache_salt": body.cache_salt,
        "cache_ttl": body.cache_ttl,
    }
    return {key: value for key, value in chat.items() if value is not None}


def assistant_message(content: str, calls: list[dict]) -> Optional[dict]:
    """The assistant turn a later request replays for this output (text, and its calls as chat tool calls)."""
    if not content and not calls:
        return None
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": call["call_id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for call in calls
        ]
    return message
