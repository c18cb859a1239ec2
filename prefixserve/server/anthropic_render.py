"""An Anthropic Messages body as the chat the template renders (chat_tools.py's OpenAI form), its tools and
tool_choice in OpenAI's terms, and where its cache_control breakpoints fall in the prompt's tokens.

    system (text or blocks)        -> a system message
    user text / tool_result blocks -> user messages / role "tool" messages, in order
    assistant text / tool_use      -> an assistant message with content and tool_calls (input as JSON text)

A breakpoint's place is the number of leading prompt tokens the conversation up to and including the marked
block renders to (the common prefix of that rendering and the whole prompt's): the prefix it keeps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from ..http import APIError
from .anthropic_protocol import MAX_BREAKPOINTS, TTL_SECONDS, MessagesRequest, TextBlock, ToolResultBlock, ToolUseBlock
from .tool_protocol import FunctionDefinition, NamedFunction, NamedToolChoice, Tool


@dataclass
class Conversation:
    messages: list[dict]  # OpenAI form
    tools: Optional[list[Tool]]
    cuts: list[tuple[list[dict], float]] = field(default_factory=list)  # (messages up to a breakpoint, ttl s)

    def tool_dicts(self) -> Optional[list[dict]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None


def _tools(body: MessagesRequest) -> Optional[list[Tool]]:
    if not body.tools:
        return None
    return [Tool(type="function", function=FunctionDefinition(name=tool.name, description=tool.description,
                                                              parameters=tool.input_schema)) for tool in body.tools]


def tool_choice_of(body: MessagesRequest):
    """(OpenAI tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    choice = body.tool_choice
    if choice is None:
        return ("auto" if body.tools else None), None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type tool needs the tool's name", param="tool_choice",
                           code="invalid_value")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name)), parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def _message_dicts(role: str, blocks: list) -> list[tuple[dict, object]]:
    """One Anthropic message as OpenAI-form messages, each with the block that ended it."""
    if role == "assistant":
        text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
        calls = [{"id": block.id, "type": "function", "function": {"name": block.name,
                                                                    "arguments": json.dumps(block.input)}}
                 for block in blocks if isinstance(block, ToolUseBlock)]
        message = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        return [(message, blocks[-1] if blocks else None)]
    out: list[tuple[dict, object]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            text = ("Error: " if block.is_error else "") + block.text()
            out.append(({"role": "tool", "tool_call_id": block.tool_use_id, "content": text}, block))
        elif isinstance(block, TextBlock):
            if out and out[-1][0]["role"] == "user":
                out[-1] = ({"role": "user", "content": out[-1][0]["content"] + block.text}, block)
            else:
                out.append(({"role": "user", "content": block.text}, block))
        else:
            raise APIError(400, "a user message holds text and tool_result blocks, not tool_use", param="messages",
                           code="invalid_request_error")
    return out


def conversation_of(body: MessagesRequest) -> Conversation:
    """The chat to render and the conversations up to each cache_control breakpoint (400 past four)."""
    messages: list[dict] = []
    cuts: list[tuple[list[dict], float]] = []
    tools = _tools(body)
    if body.tools and any(tool.cache_control for tool in body.tools):
        ttl = max(TTL_SECONDS[tool.cache_control.ttl] for tool in body.tools if tool.cache_control)
        cuts.append(([], ttl))
    if body.system is not None:
        blocks = [TextBlock(type="text", text=body.system)] if isinstance(body.system, str) else body.system
        text = ""
        for block in blocks:
            text += block.text if not text else "\n" + block.text
            if block.cache_control is not None:
                cuts.append(([{"role": "system", "content": text}], TTL_SECONDS[block.cache_control.ttl]))
        messages.append({"role": "system", "content": text})
    for message in body.messages:
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        for rendered, last in _message_dicts(message.role, blocks):
            messages.append(rendered)
            if getattr(last, "cache_control", None) is not None:
                cuts.append((list(messages), TTL_SECONDS[last.cache_control.ttl]))
        if message.role == "user" and any(getattr(block, "cache_control", None) for block in blocks[:-1]):
            for index, block in enumerate(blocks[:-1]):  # a breakpoint inside the message: the text up to it
                if isinstance(block, TextBlock) and block.cache_control is not None:
                    partial = "".join(b.text for b in blocks[:index + 1] if isinstance(b, TextBlock))
                    cuts.append((messages[:-1] + [{"role": "user", "content": partial}],
                                 TTL_SECONDS[block.cache_control.ttl]))
    if body.cache_control is not None:  # automatic caching: the whole conversation, as its last block
        cuts.append((list(messages), TTL_SECONDS[body.cache_control.ttl]))
    if len(cuts) > MAX_BREAKPOINTS:
        raise APIError(400, f"at most {MAX_BREAKPOINTS} blocks may have cache_control, got {len(cuts)}",
                       param="cache_control", code="invalid_request_error")
    return Conversation(messages, tools, cuts)


def common_prefix(first: list[int], second: list[int]) -> int:
    size = 0
    for a, b in zip(first, second):
        if a != b:
            break
        size += 1
    return size
