"""A chat with tools as the model's chat template sees it; what server and router both render (plain JSON).

A template that reads `tools` (Qwen 2.5/3, Hermes, Llama 3.1+) gets them, and the conversation as transformers
passes it: tool calls with their arguments as objects, tool results as role "tool". A template that does not
(SmolLM2-135M's, the built-in model's) is taught the hermes format in a system message, and the conversation's
calls and results are written into the turns' text in that format: tools are never dropped silently. Calls are
written as json.dumps writes them, which is how a forced call is generated (server/tool_prompt.py), so the
next turn's prompt begins with this turn's prompt and output, token for token: a cache hit.
"""

from __future__ import annotations

import json
from typing import Any, Optional

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. The functions are "
    "described in JSON within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer "
    "with a JSON object of its name and arguments within <tool_call></tool_call>, one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


def template_reads_tools(template: Optional[str]) -> bool:
    return bool(template) and "tools" in template


def message_text(content: Any) -> str:
    """A message's content as text: a string, OpenAI's list of text parts joined, or nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise ValueError("a message's content must be text or a list of text parts")


def _arguments(text: Any, index: int) -> dict:
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"messages[{index}]: a tool call's function.arguments must be a JSON object as text")
    return value


def hermes_text(calls: list[dict]) -> str:
    """Calls ({"function": {"name", "arguments": object}}) as the hermes format writes them."""
    blocks = []
    for call in calls:
        body = json.dumps(
            {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}, ensure_ascii=False
        )
        blocks.append(f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}")
    return "\n".join(blocks)


def _template_message(index: int, message: dict) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message["role"], "content": message_text(message.get("content"))}
    if message.get("name") is not None:
        entry["name"] = message["name"]
    if message.get("tool_calls"):
        entry["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _arguments(call["function"].get("arguments"), index),
                },
            }
            for call in message["tool_calls"]
        ]
    if message.get("tool_call_id") is not None:
        entry["tool_call_id"] = message["tool_call_id"]
    return entry


def _taught(entry: dict[str, Any]) -> dict[str, Any]:
    """A message in the hermes format's text, for a template that knows nothing of tools."""
    if "tool_calls" in entry:
        calls = hermes_text(entry["tool_calls"])
        return {"role": entry["role"], "content": (entry["content"] + "\n" if entry["content"] else "") + calls}
    if entry["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{entry['content']}\n</tool_response>"}
    return {"role": entry["role"], "content": entry["content"]}


def render_chat(
    messages: list[dict], tools: Optional[list[dict]], reads_tools: bool
) -> tuple[list[dict[str, Any]], Optional[list[dict]]]:
    """(messages, tools) for the template: `messages` and `tools` as OpenAI's JSON (already validated by the
    server; the router reads them raw: ValueError or KeyError when they are not what they should be)."""
    rendered = [_template_message(index, message) for index, message in enumerate(messages)]
    if reads_tools:
        return rendered, tools or None
    rendered = [_taught(entry) for entry in rendered]
    if tools:
        text = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + text}
        else:
            rendered.insert(0, {"role": "system", "content": text})
    return rendered, None
