"""Evictable leaves by last access, one heap per owner (a tenant, or None for nobody's), lazily deleted.

The device pool's eviction order (eviction.py) and every tier's (tiers/lru.py) keep their leaves here, so
both can pass over the leaves of a tenant still under its minimum (tenant_shares.py) and can evict a tenant's
own coldest leaf when it is at its maximum. An entry is (last access, id); whether it is still a live leaf of that
owner is the store's to say (`is_live`), and a stale entry is dropped when it reaches the top of its heap.

A second heap holds each owner's top, so the coldest leaf of all is found in O(log owners), not by asking
every owner (a keys file may name thousands of tenants); the owners a pop may not evict from are set aside
for that pop only. A top entry is stale once its owner's heap has another top, and is dropped when seen.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Generic, Hashable, Optional, TypeVar

Ident = TypeVar("Ident", bound=Hashable)
STALE_SLACK = 64  # stale entries tolerated beyond twice the live leaves before a rebuild


class LeafHeaps(Generic[Ident]):
    def __init__(self, is_live: Callable[[Optional[str], int, Ident], bool]) -> None:
        self.is_live = is_live
        self._heaps: dict[Optional[str], list[tuple[int, Ident]]] = {}
        # (last access, id, sequence, owner) of each owner's heap top: the sequence keeps tuples from ever
        # comparing owners (None against a tenant id)
        self._tops: list[tuple[int, Ident, int, Optional[str]]] = []
        self._sequence = itertools.count()
        self._num_entries = 0

    def __len__(self) -> int:
        """Entries, stale ones included."""
        return self._num_entries

    def push(self, owner: Optional[str], last_access: int, ident: Ident, num_live: int) -> None:
        heap = self._heaps.setdefault(owner, [])
        heapq.heappush(heap, (last_access, ident))
        self._num_entries += 1
        if heap[0] == (last_access, ident):
            self._expose(owner, heap)
        if self._num_entries + len(self._tops) > 2 * (2 * num_live + STALE_SLACK):
            self.compact()

    def pop(self, may_evict: Callable[[Optional[str], Ident], bool] = lambda owner, ident: True) -> Optional[Ident]:
        """The id of the coldest live leaf whose eviction `may_evict(owner, id)` allows (asked of each owner's
        coldest), removed; None when there is none."""
        tops, set_aside, found = self._tops, [], None
        while tops:
            last_access, ident, _, owner = tops[0]
            heap = self._heaps.get(owner)
            if not heap or heap[0] != (last_access, ident):  # its owner's top moved on
                heapq.heappop(tops)
            elif not self.is_live(owner, last_access, ident):
                heapq.heappop(tops)
                self._drop_top(owner, heap)
            elif not may_evict(owner, ident):
                set_aside.append(heapq.heappop(tops))
            else:
                heapq.heappop(tops)
                self._drop_top(owner, heap)
                found = ident
                break
        for entry in set_aside:
            heapq.heappush(tops, entry)
        return found

    def pop_of(self, owner: Optional[str]) -> Optional[Ident]:
        """The id of `owner`'s coldest live leaf, removed; None when it has none."""
        heap = self._heaps.get(owner)
        while heap:
            last_access, ident = heap[0]
            live = self.is_live(owner, last_access, ident)
            self._drop_top(owner, heap)
            if live:
                return ident
        return None

    def live(self) -> set[tuple[int, Ident]]:
        """Every live entry (for integrity checks)."""
        return {entry for owner, heap in self._heaps.items() for entry in heap if self.is_live(owner, *entry)}

    def compact(self) -> None:
        """Drop stale and duplicate entries (and owners left with none)."""
        heaps = {}
        for owner, heap in self._heaps.items():
            kept = [entry for entry in set(heap) if self.is_live(owner, *entry)]
            if kept:
                heapq.heapify(kept)
                heaps[owner] = kept
        self._heaps = heaps
        self._num_entries = sum(len(heap) for heap in heaps.values())
        self._tops = []
        for owner, heap in heaps.items():
            self._expose(owner, heap)

    def _drop_top(self, owner: Optional[str], heap: list[tuple[int, Ident]]) -> None:
        """Remove `owner`'s top entry, and show the next one among the tops."""
        heapq.heappop(heap)
        self._num_entries -= 1
        if heap:
            self._expose(owner, heap)

    def _expose(self, owner: Optional[str], heap: list[tuple[int, Ident]]) -> None:
        last_access, ident = heap[0]
        heapq.heappush(self._tops, (last_access, ident, next(self._sequence), owner))
