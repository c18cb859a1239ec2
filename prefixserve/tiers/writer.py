"""One background thread draining a bounded queue of record batches.

`submit` never blocks: what does not fit under `max_pending_bytes` is refused and
the caller counts it. `flush` waits until every batch submitted before it is done,
so tests and shutdown synchronise on it, never on time.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Sequence

from .record import BlockRecord

logger = logging.getLogger("prefixserve.tiers")


class BackgroundWriter:
    def __init__(self, write: Callable[[list[BlockRecord]], None], max_pending_bytes: int, name: str) -> None:
        self._write = write  # must not raise; a raise is logged and the batch lost
        self.max_pending_bytes = max_pending_bytes
        self._condition = threading.Condition()
        self._queue: deque[list[BlockRecord]] = deque()
        self._pending_bytes = 0
        self._num_submitted = 0
        self._num_done = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, records: Sequence[BlockRecord]) -> int:
        """Queue the leading records that fit; returns how many were accepted."""
        with self._condition:
            if self._closed:
                return 0
            batch = []
            for record in records:
                size = len(record.payload)
                if self._pending_bytes + size > self.max_pending_bytes:
                    break
                self._pending_bytes += size
                batch.append(record)
            if batch:
                self._queue.append(batch)
                self._num_submitted += 1
                self._condition.notify_all()
            return len(batch)

    def flush(self) -> None:
        with self._condition:
            target = self._num_submitted
            self._condition.wait_for(lambda: self._num_done >= target or not self._thread.is_alive())

    def close(self) -> None:
        """Write what is queued, then stop the thread; idempotent."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch = self._queue.popleft()
            try:
                self._write(batch)
            except Exception:
                logger.exception("background KV write failed; %d records lost", len(batch))
            finally:
                with self._condition:
                    self._pending_bytes -= sum(len(record.payload) for record in batch)
                    self._num_done += 1
                    self._condition.notify_all()
