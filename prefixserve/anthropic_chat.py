"""An Anthropic Messages body as the OpenAI-form chat that chat_tools.py renders, and Anthropic's error body:
what the server (after validating the body) and the router (reading it raw, to place it by its tokens) share.

    system (text or blocks)        -> a system message, block texts joined by newlines
    user text / tool_result blocks -> user messages / role "tool" messages, in order
    assistant text / tool_use      -> an assistant message with content and tool_calls (input as JSON text)
    tools (input_schema)           -> OpenAI function tools (parameters)

Plain JSON in and out: a malformed body raises ValueError, KeyError or TypeError (the server has refused it
before; the router then routes by load and lets the replica say why).
"""

from __future__ import annotations

import json
from typing import Any, Optional

# 422 (a malformed field) is Anthropic's invalid_request_error, which it answers as a 400
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error body for an HTTP status (api_error for any status it has no name for)."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def system_text(system: Any) -> str:
    """The system prompt: a string, or text blocks joined by newlines (an empty first block adds none)."""
    if isinstance(system, str):
        return system
    text = ""
    for block in system:
        text += block["text"] if not text else "\n" + block["text"]
    return text


def tool_result_text(block: dict) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part["text"] for part in content)


def turns_of(role: str, content: Any) -> list[tuple[dict, Optional[dict]]]:
    """One Anthropic message (its content a string or blocks) as OpenAI-form messages, each with the block
    that ended it (whose cache_control marks a breakpoint there)."""
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if role == "assistant":
        text = "".join(block["text"] for block in blocks if block["type"] == "text")
        calls = [
            {
                "id": block["id"],
                "type": "function",
                "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
            }
            for block in blocks
            if block["type"] == "tool_use"
        ]
        message = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        return [(message, blocks[-1] if blocks else None)]
    if role != "user":
        raise ValueError(f"a message's role is user or assistant, not {role!r}")
    turns: list[tuple[dict, Optional[dict]]] = []
    for block in blocks:
        if block["type"] == "tool_result":
            text = ("Error: " if block.get("is_error") else "") + tool_result_text(block)
            turns.append(({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}, block))
        elif block["type"] == "text":
            if turns and turns[-1][0]["role"] == "user":
                turns[-1] = ({"role": "user", "content": turns[-1][0]["content"] + block["text"]}, block)
            else:
                turns.append(({"role": "user", "content": block["text"]}, block))
        else:
            raise ValueError("a user message holds text and tool_result blocks, not tool_use")
    return turns


def tools_of(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    """Anthropic's tools as OpenAI's function tools, as the chat endpoint receives them (None for none)."""
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                **({"description": tool["description"]} if tool.get("description") is not None else {}),
                "parameters": tool["input_schema"],
            },
        }
        for tool in tools
    ]


def chat_of(body: dict) -> tuple[list[dict], Optional[list[dict]]]:
    """(OpenAI-form messages, OpenAI tools) of a raw Messages body."""
    messages = [] if body.get("system") is None else [{"role": "system", "content": system_text(body["system"])}]
    for message in body["messages"]:
        messages.extend(turn for turn, _ in turns_of(message["role"], message["content"]))
    return messages, tools_of(body.get("tools"))
