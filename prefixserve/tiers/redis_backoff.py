"""Back-off after a remote fault: one failed call opens an episode in which calls skip Redis.

    healthy ──fault──> backing off: calls skip Redis (lookups miss, writes drop)
       ^                   │ `seconds` later
       │                   v
       └──success── one call (the probe) goes to Redis ──fault──> backing off again

Without it every engine step would wait out the connect or read timeout while Redis
is down or stalled; with it the engine waits at most one timeout per `seconds`.
Episodes, not faults, are what the tier logs: a dead Redis logs one line when it
goes and one when it comes back, however many calls failed in between.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, NamedTuple, Optional


class Episode(NamedTuple):
    """An outage that just ended."""

    seconds: float
    num_faults: int


class Backoff:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if seconds <= 0:
            raise ValueError(f"a back-off needs seconds > 0, got {seconds}")
        self.seconds = seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._retry_at: Optional[float] = None  # None: healthy
        self._is_probing = False
        self._episode_start = 0.0
        self._num_faults = 0  # in the current episode
        self.num_episodes = 0

    @property
    def is_backing_off(self) -> bool:
        """A call now would skip Redis (asks only; does not claim the probe)."""
        with self._lock:
            return self._retry_at is not None and (self._is_probing or self._clock() < self._retry_at)

    def try_begin(self) -> bool:
        """Whether a call may go to Redis now; once a back-off has passed, only one call (the probe) may."""
        with self._lock:
            if self._retry_at is None:
                return True
            if self._is_probing or self._clock() < self._retry_at:
                return False
            self._is_probing = True
            return True

    def succeeded(self) -> Optional[Episode]:
        """A call reached Redis; returns the episode this ends, if one was open."""
        with self._lock:
            if self._retry_at is None:
                return None
            episode = Episode(self._clock() - self._episode_start, self._num_faults)
            self._retry_at, self._is_probing, self._num_faults = None, False, 0
            return episode

    def failed(self) -> bool:
        """A call failed (the probe included); True when this fault opens a new episode."""
        with self._lock:
            now = self._clock()
            is_new = self._retry_at is None
            if is_new:
                self._episode_start = now
                self.num_episodes += 1
            self._num_faults += 1
            self._retry_at, self._is_probing = now + self.seconds, False
            return is_new
