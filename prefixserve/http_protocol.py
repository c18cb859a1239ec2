"""The HTTP/1.1 connection server and router both run: uvicorn's h11 with a deadline and a size limit for a head.

uvicorn closes an idle keep-alive connection, but not one that is still sending a
request's headers: a client that opens connections and trickles a header byte now
and then (slowloris) holds each one, with its buffer and file descriptor, forever.
Here a connection must finish a request's headers within `header_timeout` seconds
of opening, or of that request's first byte on a kept-alive connection; else it is
answered 408 (an OpenAI-style body) and closed. The body has its own deadline
(http.BodySizeLimit), and a response is never cut by this one.

A request's head (request line and headers) may be MAX_HEAD_BYTES long. h11 notices a longer one only
while it is unfinished, and uvicorn alone would answer a plain 400 and close the socket with the rest
of the request unread, which a client sees as a connection reset. Here a request line over the limit is
answered 414 and headers over it 431, with an OpenAI-style body, whether the head came in pieces or
whole in one read (which h11 lets through: `HeadLimit`); a refused connection then drops what the
client still sends until it closes, or LINGER_SECONDS, so the client reads the answer.
"""

from __future__ import annotations

import asyncio
import json
import re
from http import HTTPStatus
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http import error_body

HEADER_TIMEOUT_SECONDS = 10.0
MAX_HEAD_BYTES = 16 * 1024  # h11's default, request line and headers together (nginx takes 8 KiB a line)
LINGER_SECONDS = 2.0  # how long a refused connection drops what the client still sends before it closes
_HEAD_END = re.compile(rb"\n\r?\n")  # the blank line that ends a head, as h11 finds it


def head_refusal(request_line_len: int, head_len: int, limit: int) -> Optional[tuple[int, dict]]:
    """(414 or 431, its OpenAI-style body) for a request head over `limit` bytes, None within it: the request
    line alone over the limit is the URL's fault (414), else the headers' (431)."""
    if request_line_len > limit:
        return 414, error_body(
            f"the request line (method, URL, version) is over {limit} bytes; send long parameters in a POST "
            "body, not in the URL",
            code="uri_too_long",
        )
    if head_len > limit:
        return 431, error_body(
            f"the request line and headers together are over {limit} bytes; send fewer or shorter headers",
            code="headers_too_large",
        )
    return None


def response_bytes(status: int, body: dict) -> bytes:
    """A whole HTTP/1.1 response with a JSON body that closes the connection, written outside h11."""
    content = json.dumps(body).encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
        % (status, HTTPStatus(status).phrase.encode(), len(content))
    ) + content


class HeadLimit:
    """ASGI: a request whose head h11 read whole in one read (it checks the limit only on an unfinished one),
    refused as HeaderDeadlineProtocol refuses an unfinished one."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            query = scope.get("query_string", b"")
            target_len = len(scope.get("raw_path") or scope["path"].encode()) + (len(query) + 1 if query else 0)
            line_len = len(scope["method"]) + 1 + target_len + len(" HTTP/1.1")
            head_len = line_len + sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            refusal = head_refusal(line_len, head_len, self.limit)
            if refusal is not None:
                status, body = refusal
                content = json.dumps(body).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(content)).encode()),
                    (b"connection", b"close"),
                ]
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": content})
                return
        await self.app(scope, receive, send)


class HeaderDeadlineProtocol(H11Protocol):
    header_timeout = HEADER_TIMEOUT_SECONDS

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        self.app = HeadLimit(self.app, self.max_head_bytes)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._linger_timer: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:  # refused: what the client still sends is dropped
            return
        super().data_received(data)
        if self.transport.is_closing() or self._linger_timer is not None:
            self._disarm()
        elif self.conn.their_state is h11.IDLE:  # a request has begun and its headers are not all here
            self._arm()
        else:  # headers read: the request is the app's now
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        """h11 refused what the client sent (uvicorn answers 400): a head grown past the limit unfinished is
        414 or 431 here, and the connection lingers."""
        buffered, _ = self.conn.trailing_data
        refusal = None
        if len(buffered) > self.max_head_bytes and _HEAD_END.search(buffered) is None:
            line_end = buffered.find(b"\n")
            line_len = len(buffered) if line_end < 0 else line_end
            refusal = head_refusal(line_len, len(buffered), self.max_head_bytes)
        if refusal is None:
            super().send_400_response(msg)
            return
        self.transport.write(response_bytes(*refusal))
        self._linger()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:  # never pushed back: trickled bytes do not buy time
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        message = f"the request's headers did not arrive within {self.header_timeout:g} s"
        self.transport.write(response_bytes(408, error_body(message, code="request_timeout")))
        self.transport.close()

    def _linger(self) -> None:
        """Close for writing, then drop what still comes until the client closes (asyncio closes the transport
        on its EOF) or LINGER_SECONDS pass: closing with unread bytes would reset the connection, and the
        client could lose the answer before it read it."""
        self._disarm()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)


def header_deadline_protocol(header_timeout: float = HEADER_TIMEOUT_SECONDS) -> type:
    """The protocol class for uvicorn's `http=` option, with this deadline for headers."""
    if not header_timeout > 0:
        raise ValueError(f"header_timeout must be a positive number of seconds, not {header_timeout!r}")
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": float(header_timeout)})


def uvicorn_config(app, host: str, port: int, log_level: str = "info", header_timeout: float = HEADER_TIMEOUT_SECONDS):
    """uvicorn's Config for one of our apps: h11 with the header deadline and the head's size limit."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=header_deadline_protocol(header_timeout),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )
