"""An Anthropic Messages body as the chat the template renders (chat_tools.py's OpenAI form), its tools and
tool_choice in OpenAI's terms, and where its cache_control breakpoints fall in the prompt's tokens.

The turns themselves are anthropic_chat.py's (the router places a Messages request by the same rendering).
A breakpoint's place is the number of leading prompt tokens the conversation up to and including the marked
block renders to (the common prefix of that rendering and the whole prompt's): the prefix it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..anthropic_chat import system_text, tools_of, turns_of
from ..http import APIError
from .anthropic_protocol import MAX_BREAKPOINTS, TTL_SECONDS, MessagesRequest
from .tool_protocol import NamedFunction, NamedToolChoice, Tool


@dataclass
class Conversation:
    messages: list[dict]  # OpenAI form
    tools: Optional[list[Tool]]
    cuts: list[tuple[list[dict], float]] = field(default_factory=list)  # (messages up to a breakpoint, ttl s)

    def tool_dicts(self) -> Optional[list[dict]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None


def tool_choice_of(body: MessagesRequest):
    """(OpenAI tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    choice = body.tool_choice
    if choice is None:
        return ("auto" if body.tools else None), None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(
                400, "tool_choice of type tool needs the tool's name", param="tool_choice", code="invalid_value"
            )
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name)), parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def _ttl(block: Optional[dict]) -> Optional[float]:
    """The lifetime a block's cache_control asks for; None when the block marks no breakpoint."""
    control = block.get("cache_control") if block is not None else None
    return TTL_SECONDS[control["ttl"]] if control is not None else None


def _check_tool_results(number: int, message: dict, answerable: set[str]) -> None:
    """Each tool_result must answer a tool_use of the message just before it (as Anthropic's API requires);
    `answerable` becomes this message's tool_use ids."""
    blocks = message["content"] if isinstance(message["content"], list) else []
    for index, block in enumerate(blocks):
        if block["type"] == "tool_result" and block["tool_use_id"] not in answerable:
            raise APIError(
                400,
                f"messages.{number}.content.{index}: tool_result answers tool_use_id {block['tool_use_id']!r}, "
                "which no tool_use block of the previous message has; each tool_result must answer a tool_use "
                "of the message before it",
                param=f"messages.{number}.content.{index}.tool_use_id",
                code="invalid_request_error",
            )
    answerable.clear()
    answerable.update(block["id"] for block in blocks if block["type"] == "tool_use")


def conversation_of(body: MessagesRequest) -> Conversation:
    """The chat to render and the conversations up to each cache_control breakpoint (400 past four)."""
    messages: list[dict] = []
    cuts: list[tuple[list[dict], float]] = []
    dumped = body.model_dump(by_alias=True)
    tools = tools_of(dumped["tools"])
    if body.tools and any(tool.cache_control for tool in body.tools):
        cuts.append(([], max(TTL_SECONDS[tool.cache_control.ttl] for tool in body.tools if tool.cache_control)))
    if body.system is not None:
        blocks = dumped["system"] if isinstance(dumped["system"], list) else []
        for index, block in enumerate(blocks):
            if _ttl(block) is not None:
                cuts.append(([{"role": "system", "content": system_text(blocks[: index + 1])}], _ttl(block)))
        messages.append({"role": "system", "content": system_text(dumped["system"])})
    answerable: set[str] = set()  # tool_use ids of the message before: what a tool_result may answer
    for number, message in enumerate(dumped["messages"]):
        _check_tool_results(number, message, answerable)
        try:
            turns = turns_of(message["role"], message["content"])
        except ValueError as error:
            raise APIError(400, str(error), param="messages", code="invalid_request_error") from None
        for rendered, last in turns:
            messages.append(rendered)
            if _ttl(last) is not None:
                cuts.append((list(messages), _ttl(last)))
        blocks = message["content"] if isinstance(message["content"], list) else []
        if message["role"] == "user":
            for index, block in enumerate(blocks[:-1]):  # a breakpoint inside the message: the text up to it
                if block["type"] == "text" and _ttl(block) is not None:
                    partial = "".join(b["text"] for b in blocks[: index + 1] if b["type"] == "text")
                    cuts.append((messages[:-1] + [{"role": "user", "content": partial}], _ttl(block)))
    if body.cache_control is not None:  # automatic caching: the whole conversation, as its last block
        cuts.append((list(messages), TTL_SECONDS[body.cache_control.ttl]))
    if len(cuts) > MAX_BREAKPOINTS:
        raise APIError(
            400,
            f"at most {MAX_BREAKPOINTS} blocks may have cache_control, got {len(cuts)}",
            param="cache_control",
            code="invalid_request_error",
        )
    return Conversation(messages, [Tool.model_validate(tool) for tool in tools] if tools else None, cuts)


def common_prefix(first: list[int], second: list[int]) -> int:
    size = 0
    for a, b in zip(first, second):
        if a != b:
            break
        size += 1
    return size
