"""The last requests the engine served, as the capacity planner replays them: keys, lengths, tenants.

One entry per request, in the order the engine first answered them (arrival times order the replay):

    first output  (its prompt is prefilled)  ->  prompt keys, prompt length, tenant, arrival time
    finish                                   ->  + the keys of the output's full blocks it inserted

Only block keys, token counts and tenant labels are kept, never token ids or text. A key lets
whoever holds it confirm a guess of a prompt, so the log is for the operator (the dashboard's
admin-only endpoints), like /v1/cache/keys. Bounded (the oldest entries go first) and
thread-safe: the engine thread records, a server thread reads a snapshot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Optional

from .request import Request

DEFAULT_MAX_ENTRIES = 10_000


@dataclass(frozen=True, slots=True)
class RequestLogEntry:
    """One request; plan/capacity.py replays these (the fields of its LoggedRequest)."""

    arrival_time: float  # time.monotonic() at arrival, as RequestMetrics keeps it
    tenant: Optional[str]
    prompt_keys: tuple[bytes, ...]  # chained keys of the prompt's full blocks
    num_prompt_tokens: int
    output_keys: tuple[bytes, ...] = ()  # keys of the output's full blocks, known at finish
    finished: bool = False


class RequestLog:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"a request log must keep at least 1 entry, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, RequestLogEntry] = OrderedDict()  # request id -> entry, oldest first
        self._lock = threading.Lock()

    def observe(self, request: Request) -> None:
        """Record what an output of `request` tells: its prompt keys (first output), its output keys (finish).

        The scheduler keeps `request.block_keys` = the keys of the full blocks it has computed, so at the
        first output they are exactly the prompt's, and at finish the rest are the output's.
        """
        if not request.was_admitted:  # ended before it ran: it never touched the cache
            return
        with self._lock:
            entry = self._entries.get(request.request_id)
            if entry is None or entry.finished:  # first output; a finished id seen again is a new request
                if entry is not None:
                    del self._entries[request.request_id]
                entry = RequestLogEntry(
                    request.metrics.arrival_time, request.tenant, tuple(request.block_keys), request.num_prompt_tokens
                )
                self._entries[request.request_id] = entry
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            if request.is_finished:
                self._entries[request.request_id] = replace(
                    entry, output_keys=tuple(request.block_keys[len(entry.prompt_keys) :]), finished=True
                )

    def snapshot(self) -> list[RequestLogEntry]:
        """The entries, oldest first (a copy: safe to replay while the engine records)."""
        with self._lock:
            return list(self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
