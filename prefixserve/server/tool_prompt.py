"""The chat template's input for a request with tools (chat_tools.py renders it), and the grammar that makes
tool_choice binding.

tool_choice "required" or a named function is enforced by a grammar (engine/structured_output.py): the output is
one (or, with parallel_tool_calls, several) call of an offered function whose arguments follow its schema,
written exactly as the parser reads it and as the next turn's rendering writes it back (json.dumps' spacing), so
the next prompt hits the cache.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Optional

from ..chat_tools import HERMES_CLOSE, HERMES_OPEN, render_chat, template_reads_tools
from ..engine.structured_output import StructuredOutputs
from ..http import APIError
from .tool_protocol import NamedToolChoice, Tool

CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parser_for(template: Optional[str], choice: str) -> str:
    """The --tool-call-parser in effect: `choice`, or for auto the template's own format (hermes when taught)."""
    if choice != "auto":
        return choice
    if (
        template_reads_tools(template)
        and HERMES_OPEN not in template
        and ("<|python_tag|>" in template or "ipython" in template)
    ):
        return "llama3_json"
    return "hermes"


def refuse_non_text(messages) -> None:
    """A 400 naming the first content part that is not text (an image, audio, a file): the models served read
    text only, and a part dropped silently would change what the model was asked."""
    for index, message in enumerate(messages):
        if isinstance(message.content, str) or message.content is None:
            continue
        for number, part in enumerate(message.content):
            if part.type != "text":
                where = f"messages.{index}.content.{number}"
                raise APIError(
                    400,
                    f"{where}: {part.type!r} parts are not supported: this model takes text only "
                    '(send {"type": "text", "text": ...} parts)',
                    param=where + ".type",
                    code="unsupported_content",
                )


def template_input(body, template: Optional[str]) -> tuple[list[dict[str, Any]], Optional[list[dict]]]:
    """(messages, tools) of a body with messages (a chat's, a pin's) for this template; a 400 for calls that are
    not JSON."""
    refuse_non_text(body.messages)
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    offered = getattr(body, "tools", None)  # a pin's body has none
    tools = [tool.model_dump(exclude_none=True) for tool in offered] if offered else None
    try:
        return render_chat(messages, tools, template_reads_tools(template))
    except ValueError as error:
        raise APIError(400, str(error), param="messages", code="invalid_messages") from None


def _call_schema(tool: Tool, parser: str) -> dict:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    key = "parameters" if parser == "llama3_json" else "arguments"
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", key],
        "properties": {"name": {"const": tool.function.name}, key: parameters},
    }


@functools.lru_cache(maxsize=1024)
def _parameters_problem(parameters_json: str) -> Optional[str]:
    """Why a function's parameters are not a schema a call can follow (None: they are); by their JSON text, so
    an agent's tools, sent with every turn, compile once."""
    parameters = json.loads(parameters_json)
    if parameters is None:
        return None  # no arguments: {}
    if not isinstance(parameters, dict):
        return "must be a JSON schema object"
    try:
        StructuredOutputs(json=parameters)
    except ValueError as error:
        return str(error)
    return None


def tool_grammar(
    tools: Optional[list[Tool]],
    choice,
    parallel: Optional[bool],
    parser: str,
    schema_field: str = "function.parameters",
) -> Optional[StructuredOutputs]:
    """The grammar of tool_choice "required" or a named function; None for auto / none. Every tool's parameters
    must be a schema a call can follow, whatever the choice: under auto the model may call any of them (a 400
    names `tools.N.<schema_field>`, the schema's place in the API the client used)."""
    for index, tool in enumerate(tools or ()):
        problem = _parameters_problem(json.dumps(tool.function.parameters, sort_keys=True))
        if problem is not None:
            raise APIError(
                400,
                f"tools.{index}.{schema_field} ({tool.function.name}): {problem}",
                param=f"tools.{index}.{schema_field}",
                code="invalid_value",
            )
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise APIError(
            400, "tool_choice asks for a tool call but no tools are given", param="tool_choice", code="invalid_value"
        )
    chosen = tools
    if isinstance(choice, NamedToolChoice):
        chosen = [tool for tool in tools if tool.function.name == choice.function.name]
        if not chosen:
            raise APIError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
                code="invalid_value",
            )
    schema = {"x-guidance": CALL_JSON_OPTIONS, "anyOf": [_call_schema(tool, parser) for tool in chosen]}
    several = parallel is not False and not isinstance(choice, NamedToolChoice)
    if parser == "hermes":
        lines = [
            'start: call ("\\n" call)*' if several else "start: call",
            f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"',
        ]
    else:
        lines = ['start: body ("; " body)*' if several else "start: body"]
    lines.append("body: %json " + json.dumps(schema))
    try:
        return StructuredOutputs(grammar="\n".join(lines) + "\n")
    except ValueError as error:
        raise APIError(
            400, f"tools: a function's parameters cannot be followed: {error}", param="tools", code="invalid_value"
        ) from None
