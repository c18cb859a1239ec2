"""Evictable leaves by last access, one heap per owner (a tenant, or None for nobody's), lazily deleted.

The device pool's eviction order (eviction.py) and every tier's (tiers/lru.py) keep their leaves here, so
both can pass over the leaves of a tenant still under its minimum (tenant_shares.py) and can evict a tenant's
own coldest leaf when it is at its maximum. An entry is (last access, id); whether it is still a live leaf of that
owner is the store's to say (`is_live`), and a stale entry is dropped when it reaches the top of its heap. Choosing
the coldest leaf among the owners' heap tops costs O(owners) a pop: a handful of tenants, not thousands.
"""

from __future__ import annotations

import heapq
from typing import Callable, Generic, Hashable, Optional, TypeVar

Ident = TypeVar("Ident", bound=Hashable)
STALE_SLACK = 64  # stale entries tolerated beyond twice the live leaves before a rebuild


class LeafHeaps(Generic[Ident]):
    def __init__(self, is_live: Callable[[Optional[str], int, Ident], bool]) -> None:
        self.is_live = is_live
        self._heaps: dict[Optional[str], list[tuple[int, Ident]]] = {}
        self._num_entries = 0

    def __len__(self) -> int:
        """Entries, stale ones included."""
        return self._num_entries

    def push(self, owner: Optional[str], last_access: int, ident: Ident, num_live: int) -> None:
        heapq.heappush(self._heaps.setdefault(owner, []), (last_access, ident))
        self._num_entries += 1
        if self._num_entries > 2 * num_live + STALE_SLACK:
            self.compact()

    def pop(self, may_evict: Callable[[Optional[str], Ident], bool] = lambda owner, ident: True) -> Optional[Ident]:
        """The id of the coldest live leaf whose eviction `may_evict(owner, id)` allows (asked of each owner's
        coldest), removed; None when there is none."""
        coldest: Optional[list[tuple[int, Ident]]] = None
        for owner, heap in self._heaps.items():
            if (
                self._live_top(owner, heap)
                and may_evict(owner, heap[0][1])
                and (coldest is None or heap[0] < coldest[0])
            ):
                coldest = heap
        if coldest is None:
            return None
        self._num_entries -= 1
        return heapq.heappop(coldest)[1]

    def pop_of(self, owner: Optional[str]) -> Optional[Ident]:
        """The id of `owner`'s coldest live leaf, removed; None when it has none."""
        heap = self._heaps.get(owner)
        if heap is None or not self._live_top(owner, heap):
            return None
        self._num_entries -= 1
        return heapq.heappop(heap)[1]

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

    def _live_top(self, owner: Optional[str], heap: list[tuple[int, Ident]]) -> bool:
        """Pop stale entries off `owner`'s heap; whether a live one is left on top."""
        while heap and not self.is_live(owner, *heap[0]):
            heapq.heappop(heap)
            self._num_entries -= 1
        return bool(heap)
