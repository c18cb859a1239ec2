"""What the server and the router share on the wire: OpenAI error bodies and APIError, the progress-beats
header, and model-version pins ('name@version').

Both front doors face hostile clients, so both answer every fault with the same
OpenAI-shaped body. API keys live in http_keys.py, body limits in http_body.py.
"""

from __future__ import annotations

from typing import Optional

from starlette.responses import JSONResponse

# A router asks a replica for progress beats with this header (value "beats"); the replica says it sends them
# with the same header on its response (server/beats.py; router/progress.py reads them).
PROGRESS_HEADER = "x-prefixserve-progress"
BEATS = "beats"


MIN_VERSION_DIGITS = 6
_HEX = set("0123456789abcdef")


def split_model(model: str) -> tuple[str, Optional[str]]:
    """A request's `model`: 'name' (any version) or 'name@version', the version a prefix of the model
    fingerprint as a response's `system_fingerprint` gives it ('fp_' and at least 6 hex digits, or the digits
    alone). Returns (name, lower-case hex digits or None); ValueError naming the form when malformed."""
    name, separator, version = model.partition("@")
    if not separator:
        return model, None
    digits = _version_digits(version)
    if digits is None:
        raise ValueError(
            f"model {model!r}: after '@' give the model version as a response's system_fingerprint "
            f"names it, e.g. '{name}@fp_0123456789abcdef' (at least {MIN_VERSION_DIGITS} hex digits)"
        )
    return name, digits


def fingerprint_version(system_fingerprint: object) -> Optional[str]:
    """The version a response's `system_fingerprint` names ('fp_' + hex digits), as the lower-case digits a
    pin takes; None when it names none (absent, or not of that form)."""
    if not isinstance(system_fingerprint, str) or not system_fingerprint.startswith("fp_"):
        return None
    return _version_digits(system_fingerprint)


def _version_digits(version: str) -> Optional[str]:
    digits = version.lower().removeprefix("fp_")
    return digits if len(digits) >= MIN_VERSION_DIGITS and set(digits) <= _HEX else None


def error_body(
    message: str, type_: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: Optional[str] = None,
    code: Optional[str] = None,
    headers: Optional[dict] = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


class APIError(Exception):
    """A fault the client caused, raised anywhere under a route of the server or the router and answered
    as its OpenAI body (install_base_error_handlers)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self):
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def install_base_error_handlers(app, logger, what: str, code: Optional[str] = None) -> None:
    """APIError as its OpenAI body, Starlette's HTTP errors (404 route, 405 method) as OpenAI bodies, and any
    unexpected exception as an OpenAI 500 that names no internals (the traceback goes to `logger`)."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def on_api_error(_, error: APIError):
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "invalid_request")
        return error_response(error.status_code, str(error.detail), kind, code=code)

    @app.exception_handler(Exception)
    async def on_unexpected(_, error: Exception):
        logger.exception("unhandled error in the %s", what)
        return error_response(
            500, f"internal {what} error; the {what}'s log has the details", "server_error", code=code
        )
