"""The lint's input: OpenAI request bodies checked for shape and turned into prompts it can compare.

A prompt is a list of parts (the tool block, then each message; or a completion's one text), rendered
the way the built-in model's chat template renders a conversation, so its token counts are the ones
the server caches:

    <|begin_of_text|><|im_start|>tools\n{tool 1 as JSON}\n{tool 2}<|im_end|>\n
    <|im_start|>system\n{content}<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n

The built-in template has no tool block; the lint puts the tools first, where tool-aware templates
(Llama 3, Qwen 2.5, Hermes) put them, because that is where their order costs cache hits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional

BEGIN_OF_TEXT = "<|begin_of_text|>"
GENERATION_PROMPT = "<|im_start|>assistant\n"
TEMPLATE_ROLES = ("system", "developer")  # leading messages of these roles (and the tools) are the template


class LintInputError(ValueError):
    """A request log the lint cannot read; the message names the line, the cause and the fix."""


@dataclass(frozen=True)
class Part:
    label: str  # "tools", "messages[0] (system)", "prompt": how the report names where a span is
    role: str  # the role rendered in the markup; "" for a completion's prompt (no markup)
    text: str
    message_index: Optional[int] = None


@dataclass(frozen=True)
class Prompt:
    """One request as the lint sees it. Parts from `tail_index` on are the request's own variable tail
    (the conversation after the template; a completion's last line), where variable text belongs."""

    line_number: int  # of the JSONL line it came from (1-based); 0 when given as bodies
    model: str
    kind: str  # "chat" or "completion"
    tools: tuple[dict, ...]
    parts: tuple[Part, ...]
    tail_index: int

    def render(self) -> "Rendered":
        if self.kind == "completion":  # the text as sent, its parts back to back
            starts = tuple(sum(len(part.text) for part in self.parts[:index]) for index in range(len(self.parts)))
            return Rendered("".join(part.text for part in self.parts), starts)
        pieces, starts, offset = [BEGIN_OF_TEXT], [], len(BEGIN_OF_TEXT)
        for part in self.parts:
            head = f"<|im_start|>{part.role}\n"
            starts.append(offset + len(head))
            pieces.append(f"{head}{part.text}<|im_end|>\n")
            offset += len(pieces[-1])
        pieces.append(GENERATION_PROMPT)
        return Rendered("".join(pieces), tuple(starts))

    def tail_start(self) -> int:
        """Offset in the rendered text where the variable tail begins (its text, after any markup)."""
        return self.render().part_starts[self.tail_index]


@dataclass(frozen=True)
class Rendered:
    text: str
    part_starts: tuple[int, ...]  # offset of each part's text in `text`


def tools_text(tools: Iterable[dict]) -> str:
    """The tool block as sent: one tool per line, keys in the order the client serialized them."""
    return "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


def tool_name(tool: dict) -> str:
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) else ""


def bodies_from_jsonl(lines: Iterable[str]) -> list[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line; a line that is not JSON is an error."""
    bodies = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            bodies.append((line_number, json.loads(line)))
        except json.JSONDecodeError as error:
            raise LintInputError(
                f"line {line_number} is not JSON ({error.msg} at column {error.colno}); the file "
                f"must be JSONL: one OpenAI request body per line"
            ) from None
    if not bodies:
        raise LintInputError("no requests: the input is empty; give a JSONL file with one OpenAI request body per line")
    return bodies


def prompts_from_bodies(bodies: Iterable[Any]) -> list[Prompt]:
    """The prompts of OpenAI request bodies (or (line number, body) pairs from bodies_from_jsonl). A
    completions body with a list of prompts gives one prompt each. Raises LintInputError on a wrong shape."""
    prompts = []
    for position, item in enumerate(bodies, start=1):
        line_number, body = item if isinstance(item, tuple) else (0, item)
        where = f"line {line_number}" if line_number else f"request {position}"
        prompts.extend(_prompts_from_body(body, where, line_number))
    if not prompts:
        raise LintInputError("no requests to lint; give at least one OpenAI request body")
    return prompts


def _prompts_from_body(body: Any, where: str, line_number: int) -> list[Prompt]:
    if not isinstance(body, dict):
        raise LintInputError(
            f"{where} is a JSON {_json_type(body)}, not an object; each line must be one OpenAI "
            f'request body, like {{"model": ..., "messages": [...]}}'
        )
    if "messages" not in body and "prompt" not in body and isinstance(body.get("body"), dict):
        body = body["body"]  # a line of the OpenAI Batch API's input file: {"custom_id", "url", "body"}
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    if "messages" in body:
        return [_chat_prompt(body, model, where, line_number)]
    if "prompt" in body:
        texts = body["prompt"]
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
            raise LintInputError(
                f"{where}: 'prompt' is {_describe(body['prompt'])}; the lint reads text prompts: "
                f"a string or a list of strings (token ids cannot be read as text)"
            )
        return [Prompt(line_number, model, "completion", (), _split_last_line(text), 1) for text in texts]
    raise LintInputError(
        f"{where} has neither 'messages' (chat completions) nor 'prompt' (completions); give the "
        f"request body as sent to /v1/chat/completions or /v1/completions"
    )


def _split_last_line(text: str) -> tuple[Part, Part]:
    """A completion's prompt as its template and its last line (the request's own text); a one-line prompt is all
    template, so a value in it is still found."""
    body = text.rstrip("\n")
    split = body.rfind("\n") + 1 if "\n" in body else len(text)
    return Part("prompt", "", text[:split]), Part("prompt (last line)", "", text[split:])


def _chat_prompt(body: dict, model: str, where: str, line_number: int) -> Prompt:
    messages, tools = body["messages"], body.get("tools") or []
    if not isinstance(messages, list) or not messages:
        raise LintInputError(
            f"{where}: 'messages' is {_describe(messages)}; it must be a non-empty list of "
            f'{{"role", "content"}} objects'
        )
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise LintInputError(
            f"{where}: 'tools' is {_describe(tools)}; it must be a list of tool objects, like "
            f'{{"type": "function", "function": {{"name": ...}}}}'
        )
    parts = [Part("tools", "tools", tools_text(tools))] if tools else []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise LintInputError(
                f"{where}: messages[{index}] is {_describe(message)}; each message must be an "
                f"object with a string 'role'"
            )
        role = message["role"]
        parts.append(
            Part(f"messages[{index}] ({role})", role, _content_text(message.get("content"), where, index), index)
        )
    num_template = len(parts) - len(messages) + _count_leading(messages)
    # With no template at all, only the last message is taken as the request's own text.
    tail_index = num_template if num_template else len(parts) - 1
    return Prompt(line_number, model, "chat", tuple(tools), tuple(parts), min(tail_index, len(parts) - 1))


def _count_leading(messages: list[dict]) -> int:
    count = 0
    while count < len(messages) - 1 and messages[count]["role"] in TEMPLATE_ROLES:
        count += 1
    return count


def _content_text(content: Any, where: str, index: int) -> str:
    """A message's text, as the server joins it: a string, or the text of each content part."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if not isinstance(part, dict):
                raise LintInputError(
                    f"{where}: messages[{index}].content[{part_index}] is {_describe(part)}; a "
                    f'content part must be an object like {{"type": "text", "text": ...}}'
                )
            if part.get("type", "text") == "text":
                if not isinstance(part.get("text"), str):
                    raise LintInputError(
                        f"{where}: messages[{index}].content[{part_index}] has no string 'text'; "
                        f'a text part is {{"type": "text", "text": "..."}}'
                    )
                texts.append(part["text"])
        return "".join(texts)
    raise LintInputError(
        f"{where}: messages[{index}].content is {_describe(content)}; it must be a string or a list of content parts"
    )


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _describe(value: Any) -> str:
    shown = json.dumps(value, ensure_ascii=False)
    return f"a JSON {_json_type(value)} ({shown if len(shown) <= 40 else shown[:37] + '...'})"
