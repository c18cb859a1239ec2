"""How long the router waits for a replica that has stopped making progress.

A hung replica (SIGSTOP, a wedged host) keeps its connections open, so no transport
error ever comes. Two things end the wait instead:

- the replica is marked down (its /health timed out `--health-failure-threshold`
  times in a row): every request waiting on it is moved at once, a plain one retried
  whole, a stream continued from the tokens sent so far;
- the replica sends nothing for the progress deadline. The router asks every replica
  for progress beats (server/beats.py: a beat each second while its engine makes
  progress, on plain requests and streams alike), so silence means the process is
  stopped or its engine stuck, however long the request's queue or prefill.
  `--progress-timeout` (default: the slowest gap between two pieces seen so far
  + 3 s, at least 5 s). From a replica that sends no beats (an older server) only a
  stream's chunks after its first token count: each is one decode step away.

So a request on a replica that hangs waits at most the deadline, then moves once:
a plain one is retried whole (nothing reached the client), a stream is continued.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Awaitable, Mapping, Optional, TypeVar

import httpx

from ..http import BEATS, PROGRESS_HEADER

T = TypeVar("T")
MIN_PROGRESS_SECONDS = 5.0
PROGRESS_MARGIN_SECONDS = 3.0


class Stalled(Exception):
    """The replica made no progress: it was marked down, or a stream's deadline passed."""


class ProgressClock:
    """The slowest gap between two chunks of a stream the router has seen, and the deadline it implies."""

    def __init__(self, fixed_seconds: Optional[float] = None) -> None:
        self.fixed_seconds = fixed_seconds  # --progress-timeout; None: learned
        self.slowest_gap = 0.0

    def observe(self, gap: float) -> None:
        """A gap between two pieces of a response."""
        self.slowest_gap = max(self.slowest_gap, gap)

    @property
    def deadline(self) -> float:
        if self.fixed_seconds is not None:
            return self.fixed_seconds
        return max(MIN_PROGRESS_SECONDS, self.slowest_gap + PROGRESS_MARGIN_SECONDS)


async def unless_down(awaitable: Awaitable[T], down: asyncio.Event, timeout: Optional[float] = None) -> T:
    """`awaitable`'s result, or Stalled when `down` is set first or `timeout` seconds pass."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(down.wait())
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise Stalled("the replica was marked down" if watcher in done else f"no progress for {timeout:.1f} s")


async def post_to(client: httpx.AsyncClient, replica, path: str, content: bytes, headers: dict) -> httpx.Response:
    """POST to a replica, its answer's headers read and its body left to stream; Stalled should the replica be
    marked down first (a hung replica never answers)."""
    request = client.build_request("POST", replica.url + path, content=content, headers=headers)
    return await unless_down(client.send(request, stream=True), replica.went_down)


def has_beats(headers: Mapping[str, str]) -> bool:
    """Whether a replica's response carries progress beats (so silence in it means a hang)."""
    return headers.get(PROGRESS_HEADER) == BEATS


async def read_answer(response: httpx.Response, down: asyncio.Event, clock: ProgressClock) -> bytes:
    """A whole non-streamed answer; with beats, Stalled once the deadline passes without a byte."""
    beating = has_beats(response.headers)
    chunks = response.aiter_raw().__aiter__()
    pieces, last = [], time.monotonic()
    while True:
        try:
            pieces.append(await unless_down(chunks.__anext__(), down, clock.deadline if beating else None))
        except StopAsyncIteration:
            return b"".join(pieces)
        arrived = time.monotonic()
        if beating:
            clock.observe(arrived - last)
        last = arrived


def unwrap_beats(content: bytes) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a beating answer: spaces, then {"status", "headers", "body"}."""
    envelope = json.loads(content)  # the beats are leading whitespace
    status, headers, body = envelope["status"], envelope.get("headers") or {}, envelope["body"]
    if not isinstance(status, int) or not 100 <= status <= 599 or not isinstance(headers, dict):
        raise ValueError("the envelope's status or headers are malformed")
    kept = {str(k): str(v) for k, v in headers.items()}
    kept["content-type"] = "application/json"
    return status, kept, json.dumps(body, separators=(",", ":")).encode()
