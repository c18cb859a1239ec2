"""Running engine requests for one HTTP response: streamed as SSE, or collected whole.

A request that fails ends its response with an error (an SSE error event, or a 5xx
body), never a bare disconnect: `engine_dead` when the engine stopped (a router may
continue elsewhere), `request_failed` when only this request failed.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.async_engine import EngineDeadError
from ..engine.outputs import RequestOutput
from ..http import BEATS, PROGRESS_HEADER, APIError, error_body
from .beats import SSE_BEAT, beating
from .metrics import ServerMetrics
from .streams import merge_streams, sse

DISCONNECT_POLL_SECONDS = 0.25
DONE = "data: [DONE]\n\n"


def engine_dead(error: Exception) -> APIError:
    return APIError(503, f"{error}", "server_error", code="engine_dead")


def request_failed(out: RequestOutput) -> APIError:
    message = out.error or "the request failed"
    return APIError(500, f"{message}; the server log has the details", "server_error", code="request_failed")


def stream_response(
    streams: list[AsyncIterator[RequestOutput]],
    shape,
    metrics: ServerMetrics,
    finish: Callable[[list[RequestOutput]], Optional[dict]],
    first_chunks=(),
    beats_of=None,
) -> StreamingResponse:
    """SSE of every stream's chunks; `finish(finals)` gives the closing usage chunk or None. With `beats_of`
    (the engine), progress beats go between the chunks (beats.py)."""

    async def events() -> AsyncIterator[str]:
        finals: list[Optional[RequestOutput]] = [None] * len(streams)
        try:
            for body in first_chunks:
                yield sse(body)
            async for index, out in merge_streams(streams):
                if out.finished and out.finish_reason == "error":
                    failure = request_failed(out)
                    yield sse(error_body(failure.message, failure.type, code=failure.code))
                    yield DONE
                    return
                if shape.has_news(out):
                    yield sse(shape.chunk(index, out))
                if out.finished:
                    metrics.observe_finished(out)
                    finals[index] = out
        except EngineDeadError as error:
            failure = engine_dead(error)
            yield sse(error_body(failure.message, failure.type, code=failure.code))
            yield DONE
            return
        closing = finish(finals)
        if closing is not None:
            yield sse(closing)
        yield DONE

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if beats_of is None:
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
    return StreamingResponse(
        beating(events(), beats_of, SSE_BEAT),
        media_type="text/event-stream",
        headers={**headers, PROGRESS_HEADER: BEATS},
    )


async def collect(
    request: Optional[Request], streams: list[AsyncIterator[RequestOutput]], metrics: ServerMetrics
) -> list[RequestOutput]:
    """Run non-streamed requests to the end; a client that disconnects (polled on `request`, when given) or
    a cancelled caller aborts them."""

    async def final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        last = None
        try:
            async for output in stream:
                last = output
        finally:
            await stream.aclose()  # an abandoned stream aborts its request
        return last

    task = asyncio.gather(*(final(stream) for stream in streams))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                break
            if request is not None and await request.is_disconnected():
                raise APIError(499, "client disconnected", code="client_disconnected")
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # retrieve it: no "never retrieved" noise
        raise
    try:
        finals = task.result()
    except EngineDeadError as error:
        raise engine_dead(error) from None
    for out in finals:
        if out.finish_reason == "error":
            raise request_failed(out)
        metrics.observe_finished(out)
    return finals
