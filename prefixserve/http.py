"""HTTP pieces the server and the router share: OpenAI error bodies, API-key checks, body limits.

Both front doors face hostile clients, so both answer every fault with the same
OpenAI-shaped body, compare keys in constant time, and refuse an oversized body
before reading it whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from typing import Mapping, NamedTuple, Optional

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from .config import CACHE_RETENTIONS

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # 8 MiB: a 128k-token prompt as JSON ids is under 1 MiB
DEFAULT_BODY_TIMEOUT_SECONDS = 30.0  # the longest a client may pause between two chunks of its body


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
    digits = version.lower().removeprefix("fp_")
    if len(digits) < MIN_VERSION_DIGITS or not set(digits) <= _HEX:
        raise ValueError(f"model {model!r}: after '@' give the model version as a response's system_fingerprint "
                         f"names it, e.g. '{name}@fp_0123456789abcdef' (at least {MIN_VERSION_DIGITS} hex digits)")
    return name, digits


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


class APIError(Exception):
    """A fault the client caused, raised anywhere under a route of the server or the router and answered
    as its OpenAI body (install_base_error_handlers)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None) -> None:
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
        return error_response(500, f"internal {what} error; the {what}'s log has the details", "server_error",
                              code=code)


class AmbiguousAuthorization(ValueError):
    """More than one Authorization header: which one counts would differ between a router and a replica."""


def authorization_of(headers) -> Optional[str]:
    """The request's one Authorization header (Starlette's Headers), None when absent; more than one is
    AmbiguousAuthorization (a 400): a replica reading the first and a router forwarding the last would
    disagree about who is asking."""
    values = headers.getlist("authorization")
    if len(values) > 1:
        raise AmbiguousAuthorization(f"the request has {len(values)} Authorization headers; send exactly one")
    return values[0] if values else None


def raw_header(value: str) -> bytes:
    """A header value as the client sent its bytes (Starlette decodes them as latin-1), to forward as is."""
    return value.encode("latin-1")


def bearer_token(authorization: Optional[str]) -> str:
    """The key of an `Authorization: Bearer <key>` header ('' when absent or malformed)."""
    if not authorization or not authorization[:7].lower() == "bearer ":
        return ""
    return authorization[7:].strip()


class KeyTable:
    """API key -> tenant, looked up in constant time: every stored key is compared, none short-circuits.

    Keys are compared as SHA-256 digests, so the comparison time depends neither on
    where a guess first differs nor on its length.
    """

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._entries = [(hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in keys.items()]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str) -> Optional[str]:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found = None
        for stored, tenant in self._entries:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found


class AdminRefusal(NamedTuple):
    status: int
    message: str
    type: str
    code: str


class AdminKey:
    """The operator's key (server or router), compared in constant time as a SHA-256 digest.

    Endpoints that reveal cache or fleet state answer it only: without one configured they are
    off (404), a missing key is 401, any other key (a tenant's) 403.
    """

    def __init__(self, key: Optional[str], owner: str) -> None:
        self._digest = hashlib.sha256(key.encode()).digest() if key else None
        self.owner = owner  # "server" or "router": where --admin-api-key is given

    def require(self, headers, tenants: Optional[KeyTable] = None) -> None:
        """Raise APIError unless the request's one Authorization header (Starlette's Headers) carries the
        admin key: 400 for two headers, else `refusal`'s answer. The server's and the router's guard."""
        try:
            authorization = authorization_of(headers)
        except AmbiguousAuthorization as error:
            raise APIError(400, str(error), code="ambiguous_authorization") from None
        refusal = self.refusal(authorization, tenants)
        if refusal is not None:
            raise APIError(refusal.status, refusal.message, refusal.type, code=refusal.code)

    def refusal(self, authorization: Optional[str], tenants: Optional[KeyTable] = None) -> Optional[AdminRefusal]:
        """None when `authorization` carries the admin key; else why not, as an error to answer: 401 for
        a missing or unknown key, 403 for a tenant's key (one of `tenants`)."""
        if self._digest is None:
            return AdminRefusal(404, f"this endpoint is off; start the {self.owner} with --admin-api-key to enable it",
                                "not_found_error", "admin_disabled")
        key = bearer_token(authorization)
        if not key:
            return AdminRefusal(401, "this endpoint needs the admin API key; send 'Authorization: Bearer <admin key>'",
                                "authentication_error", "invalid_api_key")
        if not hmac.compare_digest(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest(), self._digest):
            if tenants is not None and tenants.lookup(key) is not None:
                return AdminRefusal(403, "this endpoint needs the operator's admin API key, not a tenant key",
                                    "permission_error", "admin_only")
            return AdminRefusal(401, "this endpoint needs the admin API key; the key sent is not it",
                                "authentication_error", "invalid_api_key")
        return None


def is_valid_tenant_id(tenant: str) -> bool:
    """Printable, non-empty, at most 256 characters: no control characters (NUL, newlines) in tenant ids."""
    return 0 < len(tenant) <= 256 and tenant.isprintable()


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before it is read whole, one whose
    next chunk takes longer than `body_timeout` seconds 408, and a client gone mid-upload ends the
    request quietly (a line at debug level, not two tracebacks).

    A declared Content-Length over the limit is refused without reading a byte; a
    chunked body is counted as it streams and refused the moment it passes the limit.
    Add it with `app.add_middleware(BodySizeLimit, max_bytes=...)`: it then sits inside
    Starlette's error middleware, so the overflow raised from `receive` reaches it.
    """

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT_SECONDS) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._refuse(send, "the Content-Length header is not a number", 400, "invalid_request")
                    return
                if declared > self.max_bytes:
                    await self._refuse(send, self._too_large(), 413, "request_too_large")
                    return
        received = 0
        response_started = False
        body_done = False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # after the body, receive waits for a disconnect as long as a response streams
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                raise _BodyTimeout() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def tracking_send(message):
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not response_started:
                await self._refuse(send, self._too_large(), 413, "request_too_large")
        except _BodyTimeout:
            if not response_started:
                await self._refuse(send, f"the request body stalled: no bytes for {self.body_timeout:g} s", 408,
                                   "request_timeout")
        except ClientDisconnect:
            logging.getLogger("prefixserve").debug("client disconnected before sending its whole body (%s %s)",
                                                   scope.get("method"), scope.get("path"))

    def _too_large(self) -> str:
        return (f"the request body exceeds {self.max_bytes} bytes; send a smaller request "
                "(the operator sets the limit with --max-request-bytes)")

    @staticmethod
    async def _refuse(send, message: str, status: int, code: str) -> None:
        body = json.dumps(error_body(message, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


class _BodyTimeout(Exception):
    pass


def parse_json_body(raw: bytes):
    """json.loads that turns every way a hostile body can fail into ValueError with a plain message,
    a string holding a lone UTF-16 surrogate (`"\\ud800"`: valid JSON, not text) included."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ValueError("the request body nests JSON too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"the request body is not valid JSON: {error}") from None
    except ValueError as error:  # e.g. an integer literal of thousands of digits
        raise ValueError(f"the request body has a value that cannot be read: {error}") from None
    if b"\\ud" in raw.lower():  # only a \uD800-\uDFFF escape can make a lone surrogate
        _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(value) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), "
                                 "which is not a character; send the text as UTF-8") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


class KeyEntry(NamedTuple):
    tenant: str
    cache_ttl: Optional[float]  # the tenant's default cache TTL (seconds); None: the server's
    cache_retention: Optional[str]  # "device" | "none": the tenant's KV never leaves the device / is never kept




def _read_keys_file(api_keys_file: str) -> dict[str, KeyEntry]:
    """key -> KeyEntry from a JSON object whose values are a tenant id or {"tenant": id, "cache_ttl":
    seconds, "cache_retention": "device" | "none"} (both optional)."""
    import math
    from pathlib import Path

    path = Path(api_keys_file)
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"--api-keys-file {path}: cannot read a JSON object of key -> tenant ({error})")
    if not isinstance(loaded, dict):
        raise SystemExit(f"--api-keys-file {path}: expected a JSON object mapping API key strings to tenant names")
    entries: dict[str, KeyEntry] = {}
    for key, value in loaded.items():
        if not key:
            raise SystemExit(f"--api-keys-file {path}: an API key is empty; give every tenant a non-empty key")
        ttl = retention = None
        if isinstance(value, dict):
            unknown = set(value) - set(KeyEntry._fields)
            if unknown or "tenant" not in value:
                raise SystemExit(f"--api-keys-file {path}: a key's entry is a tenant name or an object with "
                                 f"'tenant' and optional 'cache_ttl' (seconds) and 'cache_retention' "
                                 f"({' or '.join(CACHE_RETENTIONS)}); got fields {sorted(value)}")
            tenant, ttl, retention = value["tenant"], value.get("cache_ttl"), value.get("cache_retention")
            if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                                    or not math.isfinite(ttl) or ttl <= 0):
                raise SystemExit(f"--api-keys-file {path}: cache_ttl of tenant {tenant!r} must be a positive number "
                                 f"of seconds, got {ttl!r}")
            if retention is not None and retention not in CACHE_RETENTIONS:
                raise SystemExit(f"--api-keys-file {path}: cache_retention of tenant {tenant!r} must be one of "
                                 f"{list(CACHE_RETENTIONS)}, got {retention!r}")
        else:
            tenant = value
        if not isinstance(tenant, str):
            raise SystemExit(f"--api-keys-file {path}: expected a JSON object mapping API key strings to tenant names")
        if not is_valid_tenant_id(tenant):
            raise SystemExit(f"--api-keys-file {path}: tenant id {tenant!r} must be 1 to 256 printable characters "
                             "(no control characters such as NUL or newlines)")
        entries[key] = KeyEntry(tenant, None if ttl is None else float(ttl), retention)
    return entries


def load_api_keys(api_keys_file: Optional[str], api_key: Optional[str] = None) -> dict[str, str]:
    """key -> tenant from a JSON keys file, plus a single --api-key as tenant 'default'.

    Tenant ids must be printable (no NUL or other control characters), so that what a
    log or a metric shows is what the operator wrote.
    """
    keys = {key: entry.tenant for key, entry in _read_keys_file(api_keys_file).items()} if api_keys_file else {}
    if api_key:
        keys[api_key] = "default"
    return keys


def _tenant_settings(api_keys_file: Optional[str], field: str) -> dict:
    """tenant -> the keys-file entry's `field` (a KeyEntry field) for the tenants that give one; one value
    per tenant, whichever of its keys it is given under."""
    if not api_keys_file:
        return {}
    settings: dict = {}
    for entry in _read_keys_file(api_keys_file).values():
        value = getattr(entry, field)
        if value is not None and settings.setdefault(entry.tenant, value) != value:
            raise SystemExit(f"--api-keys-file {api_keys_file}: tenant {entry.tenant!r} has two different {field} "
                             "values; give each tenant one")
    return settings


def load_tenant_cache_ttls(api_keys_file: Optional[str]) -> dict[str, float]:
    """tenant -> default cache TTL (seconds) for the tenants whose keys-file entry gives one."""
    return _tenant_settings(api_keys_file, "cache_ttl")


def load_tenant_cache_retentions(api_keys_file: Optional[str]) -> dict[str, str]:
    """tenant -> cache_retention for the tenants whose keys-file entry gives one (privacy mode)."""
    return _tenant_settings(api_keys_file, "cache_retention")
