"""Relaying an Anthropic Messages stream (POST /v1/messages with "stream": true).

Its events carry no token ids, so such a stream cannot be continued on another
replica as an OpenAI one is (stream_relay.py). What the router can do, it does:

    replica fails before the stream's first event   -> the request is replayed on another replica
      (the first event, message_start, comes with the first token: the wait for a
       queue and a prefill, most of a request's exposure, is covered)
    replica fails after it                          -> Anthropic's error event ends the stream
    the replica's own error event                   -> relayed as it is; the request's own failure

Progress beats (SSE comments) are dropped; every other event passes as the replica wrote it.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator, Optional

import anyio
import httpx

from ..anthropic_chat import anthropic_error_body
from .fleet import Router
from .inbound import ClientRequest
from .policies import RouteRequest
from .progress import Stalled, has_beats, post_to, unless_down
from .stream_relay import Upstream

logger = logging.getLogger("prefixserve.router")
STOP_EVENTS = (b"message_stop", b"error")  # after either, the stream is complete


def error_event(status: int, message: str) -> bytes:
    return f"event: error\ndata: {json.dumps(anthropic_error_body(status, message))}\n\n".encode()


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """(the complete events in `buffer`, each ending in a blank line; the bytes after the last one)."""
    buffer = buffer.replace(b"\r\n", b"\n")
    events = []
    while (end := buffer.find(b"\n\n")) >= 0:
        events.append(buffer[: end + 2])
        buffer = buffer[end + 2 :]
    return events, buffer


def event_name(event: bytes) -> Optional[bytes]:
    """The event's `event:` name; None for a comment-only event (a beat)."""
    lines = [line for line in event.split(b"\n") if line and not line.startswith(b":")]
    if not lines:
        return None
    for line in lines:
        if line.startswith(b"event:"):
            return line[6:].strip()
    return b"message"


class MessageStreamRelay:
    def __init__(
        self,
        router: Router,
        request: ClientRequest,
        route: Optional[RouteRequest],
        raw: bytes,
        headers: dict,
        tried: set[str],
        first: Upstream,
    ) -> None:
        self.router, self.request, self.route, self.raw = router, request, route, raw
        self.headers, self.tried, self.upstream = headers, tried, first
        self.num_events_sent = 0
        self.complete = False  # message_stop or the replica's own error event passed

    async def events(self) -> AsyncIterator[bytes]:
        try:
            while True:
                async with aclosing(self._relay(self.upstream)) as pieces:
                    async for piece in pieces:
                        yield piece
                if self.complete:
                    return
                if self.num_events_sent:
                    yield error_event(
                        503,
                        f"replica {self.upstream.replica.name} failed while streaming this "
                        "message, and a Messages stream cannot be continued elsewhere; retry the "
                        "request",
                    )
                    return
                replayed = await self._replay()
                if replayed is None:
                    yield error_event(
                        503,
                        f"the replica serving this message failed before its first event and no "
                        f"other healthy replica could take it (tried {len(self.tried)}); retry "
                        "the request",
                    )
                    return
                self.upstream = replayed
        except Exception:  # whatever went wrong, the client gets an error event, not a cut connection
            logger.exception("message stream relay failed")
            yield error_event(500, "the router failed while relaying this stream; retry the request")

    async def _relay(self, upstream: Upstream) -> AsyncIterator[bytes]:
        clock = self.router.progress
        chunks = upstream.response.aiter_bytes().__aiter__()
        stepping, last, buffer = has_beats(upstream.response.headers), time.monotonic(), b""
        try:
            while not self.complete:
                try:
                    data = await unless_down(
                        chunks.__anext__(), upstream.replica.went_down, clock.deadline if stepping else None
                    )
                except StopAsyncIteration:
                    self.router.check_soon(upstream.replica)  # it ended without message_stop
                    return
                arrived = time.monotonic()
                if stepping:
                    clock.observe(arrived - last)
                last = arrived
                events, buffer = split_events(buffer + data)
                for event in events:
                    name = event_name(event)
                    if name is None:
                        continue
                    stepping = stepping or name == b"content_block_delta"  # each next one is a step away
                    self.num_events_sent += 1
                    yield event
                    if name in STOP_EVENTS:
                        self.complete = True
                        return
        except (httpx.TransportError, Stalled) as failure:
            self.router.fail_over(upstream.replica, failure, "during a Messages stream")
        finally:
            with anyio.CancelScope(shield=True):  # close the upstream even when the client went away
                await upstream.response.aclose()
            self.router.release(upstream.replica, upstream.ticket)

    async def _replay(self) -> Optional[Upstream]:
        """The whole request on another replica that answers it with a stream; None when none does."""
        while len(self.tried) < self.router.settings.max_attempts:
            replica = self.router.choose(self.route, self.tried, version=self.request.model_version)
            if replica is None:
                return None
            self.tried.add(replica.name)
            ticket = self.router.record_route(replica, self.route, self.request.max_tokens)
            try:
                response = await post_to(self.router.client, replica, self.request.path, self.raw, self.headers)
            except (httpx.TransportError, Stalled) as failure:
                self.router.release(replica, ticket)
                self.router.fail_over(replica, failure, "replaying a Messages stream")
                continue
            if response.status_code != 200:
                await response.aclose()
                self.router.release(replica, ticket)
                if response.status_code >= 500:
                    self.router.check_soon(replica)
                continue
            logger.info("message stream replayed on replica %s", replica.name)
            return Upstream(replica, response, ticket)
        return None
