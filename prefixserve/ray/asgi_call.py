"""One HTTP request through an ASGI app in this process, its response streamed back as it is sent.

An engine replica under Ray Serve runs the same FastAPI app `prefixserve serve` runs (every route,
its validation and its 4xx), without a socket: the ingress ships the client's request here as a
`ForwardedRequest`, and the replica answers with a `ResponseStart` and then the body's chunks, each
yielded the moment the app sends it, so a stream stays a stream through Serve's handle.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Union


@dataclass
class ForwardedRequest:
    """A client's request as the ingress read it, plus what the request router needs to place it."""

    method: str
    path: str
    query: bytes
    headers: list  # [(name, value)] as bytes, as ASGI carries them
    body: bytes
    route: Optional[object] = None  # the RouteEstimate the router prices (None: routed by load)
    avoid: set = field(default_factory=set)  # replica ids that failed this request: tried last
    routed_to: Optional[str] = None  # set by the request router: the replica it chose (the ingress reads it)


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list  # [(name, value)] as bytes


Piece = Union[ResponseStart, bytes]


async def call_asgi(app, request: ForwardedRequest) -> AsyncIterator[Piece]:
    """The app's response to `request`: a ResponseStart, then body chunks (empty ones skipped).

    Leaving the iterator early (the client went away) tells the app the client disconnected and
    waits for it to finish, so the engine aborts the request as it would for a dropped socket.
    """
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query,
        "root_path": "",
        "headers": list(request.headers),
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task  # raises what the app raised (it answered nothing the client could read)
    finally:
        if not task.done():
            disconnected.set()
            try:
                await asyncio.wait_for(task, timeout=30)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the client is gone; nothing to tell it
                task.cancel()
