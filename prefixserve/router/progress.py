"""How long the router waits for a replica that has stopped making progress.

A hung replica (SIGSTOP, a wedged host) keeps its connections open, so no transport
error ever comes. Two things end the wait instead:

- the replica is marked down (its /health timed out `--health-failure-threshold`
  times in a row): every request waiting on it is moved at once, a plain one retried
  whole, a stream continued from the tokens sent so far;
- a stream that has begun sends nothing for the progress deadline: after its first
  token each chunk is one decode step, so `--progress-timeout` (default: the slowest
  gap between two chunks seen so far + 3 s, at least 5 s) past the last one means
  the replica is not stepping. Before the first token no deadline applies here: a
  queued or long prefill is not a hang, and the health checks cover a dead host.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Optional, TypeVar

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
