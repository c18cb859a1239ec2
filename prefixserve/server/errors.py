"""Every fault a client can cause becomes an OpenAI-style error body with a 4xx status.

Handlers are installed on the app once; routes raise APIError with the status,
the message that names the cause and the fix, and the offending parameter.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from ..http import error_response, install_base_error_handlers

logger = logging.getLogger("prefixserve.server")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def param_of(location) -> str:
    """The field path a client sent ('messages.0.content'), without pydantic's union-member tags
    ('str', 'list[int]', 'constrained-str')."""
    parts = [
        str(part)
        for part in location
        if not (isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS))
    ]
    return ".".join(parts)


def most_specific(errors: list[dict]) -> dict:
    """The error a client can act on: the deepest field (a union reports one error per member, and the member
    the client meant is the one it got furthest into: `cache_control` inside a system block, not "system:
    Input should be a valid string"), and at one depth a broken limit before a wrong type (ten thousand stop
    strings are too many, not "not a string"); the first of equals."""
    return max(
        errors,
        key=lambda error: (len(param_of(error["loc"]).split(".")), not error["type"].endswith("_type")),
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_query_error(_, error: RequestValidationError):  # query parameters, e.g. ?since=abc
        first = error.errors()[0]
        param = param_of(part for part in first["loc"] if part != "query")
        return error_response(422, f"{param}: {first['msg']}", param=param, code="invalid_value")

    install_base_error_handlers(app, logger, "server")
