"""Request bodies the server and the router share: size and time limits, and reading one as JSON.

Both front doors face hostile clients, so both refuse an oversized body before
reading it whole, and turn every way a hostile body can fail to parse into a plain
error.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.requests import ClientDisconnect

from .http import error_body

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # 8 MiB: a 128k-token prompt as JSON ids is under 1 MiB
DEFAULT_BODY_TIMEOUT_SECONDS = 30.0  # the longest a client may pause between two chunks of its body


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before it is read whole, one whose
    next chunk takes longer than `body_timeout` seconds 408, and a client gone mid-upload ends the
    request quietly (a line at debug level, not two tracebacks).

    A declared Content-Length over the limit is refused without reading a byte; a
    chunked body is counted as it streams and refused the moment it passes the limit.
    Add it with `app.add_middleware(BodySizeLimit, max_bytes=...)`: it then sits inside
    Starlette's error middleware, so the overflow raised from `receive` reaches it.
    """

    def __init__(
        self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT_SECONDS
    ) -> None:
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
                await self._refuse(
                    send, f"the request body stalled: no bytes for {self.body_timeout:g} s", 408, "request_timeout"
                )
        except ClientDisconnect:
            logging.getLogger("prefixserve").debug(
                "client disconnected before sending its whole body (%s %s)", scope.get("method"), scope.get("path")
            )

    def _too_large(self) -> str:
        return (
            f"the request body exceeds {self.max_bytes} bytes; send a smaller request "
            "(the operator sets the limit with --max-request-bytes)"
        )

    @staticmethod
    async def _refuse(send, message: str, status: int, code: str) -> None:
        body = json.dumps(error_body(message, code=code)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
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
                raise ValueError(
                    "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), "
                    "which is not a character; send the text as UTF-8"
                ) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
