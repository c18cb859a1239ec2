"""The request fields that ask for structured output, as one StructuredOutputs (engine/structured_output.py).

    response_format      OpenAI's: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    structured_outputs   vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older spellings of the same

At most one of them may ask for something; a grammar that does not compile is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..engine.structured_output import MAX_CHOICES, StructuredOutputs
from ..http import APIError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: Optional[str] = Field(default=None, max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # enforced either way: the grammar admits only what the schema does


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsBody(BaseModel):
    """vLLM's structured_outputs object; a field it has that is not here is refused, not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(default=None, max_length=MAX_CHOICES)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


def _asked(body: Any) -> list[tuple[str, dict]]:
    """(field name, StructuredOutputs arguments) of every field of the body that asks for structure."""
    asked = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        schema = response_format.json_schema.json_schema if response_format.json_schema else None
        if schema is None:
            raise APIError(
                400,
                "response_format of type json_schema needs json_schema.schema (a JSON schema object)",
                param="response_format",
                code="invalid_value",
            )
        asked.append(("response_format", {"json": schema}))
    if body.structured_outputs is not None:
        given = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        asked.append(("structured_outputs", {name: value for name, value in given.items() if value is not False}))
    for name, kind in GUIDED_FIELDS.items():
        if getattr(body, name) is not None:
            asked.append((name, {kind: getattr(body, name)}))
    return asked


def structured_outputs_of(body: Any) -> Optional[StructuredOutputs]:
    """The one constraint the body asks for, or None; an APIError (400) naming the field otherwise."""
    asked = _asked(body)
    if not asked:
        return None
    if len(asked) > 1:
        names = sorted({name for name, _ in asked})
        raise APIError(
            400,
            f"ask for structured output once: {', '.join(names)} each ask for one",
            param=names[0],
            code="invalid_value",
        )
    name, arguments = asked[0]
    try:
        return StructuredOutputs(**arguments)
    except ValueError as error:
        raise APIError(400, f"{name}: {error}", param=name, code="invalid_value") from None
