"""The HTTP/1.1 connection server and router both run: uvicorn's h11 protocol with a deadline for headers.

uvicorn closes an idle keep-alive connection, but not one that is still sending a
request's headers: a client that opens connections and trickles a header byte now
and then (slowloris) holds each one, with its buffer and file descriptor, forever.
Here a connection must finish a request's headers within `header_timeout` seconds
of opening, or of that request's first byte on a kept-alive connection; else it is
answered 408 (an OpenAI-style body) and closed. The body has its own deadline
(http.BodySizeLimit), and a response is never cut by this one.
"""

from __future__ import annotations

import asyncio
import json
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http import error_body

HEADER_TIMEOUT_SECONDS = 10.0


class HeaderDeadlineProtocol(H11Protocol):
    header_timeout = HEADER_TIMEOUT_SECONDS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
        elif self.conn.their_state is h11.IDLE:  # a request has begun and its headers are not all here
            self._arm()
        else:  # headers read: the request is the app's now
            self._disarm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
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
        body = json.dumps(
            error_body(f"the request's headers did not arrive within {self.header_timeout:g} s", code="request_timeout")
        ).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        self.transport.close()


def header_deadline_protocol(header_timeout: float = HEADER_TIMEOUT_SECONDS) -> type:
    """The protocol class for uvicorn's `http=` option, with this deadline for headers."""
    if not header_timeout > 0:
        raise ValueError(f"header_timeout must be a positive number of seconds, not {header_timeout!r}")
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": float(header_timeout)})


def uvicorn_config(app, host: str, port: int, log_level: str = "info", header_timeout: float = HEADER_TIMEOUT_SECONDS):
    """uvicorn's Config for one of our apps: h11 with the header deadline."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=header_deadline_protocol(header_timeout))
