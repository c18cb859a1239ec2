"""Progress beats: how a replica shows a router that it is still stepping on a request.

A hung replica (SIGSTOP, a wedged engine thread) keeps its connections open and
sends nothing, which looks just like a long prefill or a long queue. So a router
that sends `x-prefixserve-progress: beats` gets a beat each second in which the
engine is making progress: it finished a step (any request's: a queued request's
replica is alive too), or is inside one that began less than STUCK_STEP_SECONDS
ago (a long prefill chunk, a first call that probes a kernel). A stopped process
sends no beats at all, a wedged engine none after STUCK_STEP_SECONDS; either way
the router fails the request over after a few silent seconds:

    stream      an SSE comment, ": beat", between the chunks (clients ignore comments)
    not stream  200 with the same header; a space per beat, then one JSON envelope
                {"status": ..., "headers": {...}, "body": <the response or error body>}
                (leading spaces are valid JSON whitespace)

A request without the header is answered as usual. Leaving a beating response
(the router went away) cancels the work under it, so its engine requests abort.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import suppress
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..http import BEATS, PROGRESS_HEADER, APIError

T = TypeVar("T")
BEAT_SECONDS = 1.0
STUCK_STEP_SECONDS = 60.0  # a step running longer than this is stuck, not long
SSE_BEAT = ": beat\n\n"
BODY_BEAT = b" "


def wants_beats(request: Request) -> bool:
    return request.headers.get(PROGRESS_HEADER) == BEATS


def in_progress(engine, steps_before: int) -> bool:
    """Whether the engine finished a step since it had finished `steps_before`, or is in one not yet stuck."""
    started = engine.step_started
    return engine.num_steps != steps_before or (started is not None and time.monotonic() - started < STUCK_STEP_SECONDS)


async def beating(source: AsyncIterator[T], engine, beat: T) -> AsyncIterator[T]:
    """`source`'s items as they come; between them, `beat` after each BEAT_SECONDS of engine progress."""
    iterator = source.__aiter__()
    steps = engine.num_steps
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=BEAT_SECONDS)
            if not done:
                if in_progress(engine, steps):
                    steps = engine.num_steps
                    yield beat
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with suppress(BaseException):
                await pending
        closing = getattr(iterator, "aclose", None)
        if closing is not None:
            await closing()


def beating_response(
    work: Callable[[], Awaitable[dict]], engine, error_body: Callable[[APIError], dict] = APIError.body
) -> StreamingResponse:
    """A non-streamed answer with beats: `work()` gives the response body, or raises APIError, answered with
    `error_body(error)` (OpenAI's body unless the API has its own)."""

    async def envelope() -> AsyncIterator[dict]:
        try:
            yield {"status": 200, "headers": {}, "body": await work()}
        except APIError as error:
            yield {"status": error.status, "headers": error.headers, "body": error_body(error)}

    async def body() -> AsyncIterator[bytes]:
        async for item in beating(envelope(), engine, BODY_BEAT):
            yield item if isinstance(item, bytes) else json.dumps(item, separators=(",", ":")).encode()

    return StreamingResponse(body(), media_type="application/json", headers={PROGRESS_HEADER: BEATS})
