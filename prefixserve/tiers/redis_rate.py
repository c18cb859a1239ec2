"""A cap on the bytes one replica writes to the shared tier per second (a token bucket).

Write-through sends every block a replica computes; a fleet of replicas prefilling
at once could fill the link to Redis and slow the reads that make the tier worth
having. What exceeds the cap is dropped, not delayed: a late write is worth little
and a queue would only hold memory.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class TokenBucket:
    """At most `bytes_per_second` on average, and bursts up to `burst_bytes` (default: one second's worth)."""

    def __init__(
        self, bytes_per_second: int, burst_bytes: Optional[int] = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if bytes_per_second <= 0:
            raise ValueError(f"a write cap needs bytes_per_second > 0, got {bytes_per_second}")
        self.bytes_per_second = bytes_per_second
        self.burst_bytes = burst_bytes if burst_bytes is not None else bytes_per_second
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = float(self.burst_bytes)
        self._refilled_at = clock()

    def try_take(self, num_bytes: int) -> bool:
        """Take `num_bytes` if the bucket holds them; False (nothing taken) otherwise."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._refilled_at) * self.bytes_per_second)
            self._refilled_at = now
            if num_bytes > self._tokens:
                return False
            self._tokens -= num_bytes
            return True
