"""The order in which cached blocks leave: expired leaves first, then least recently used leaves.

Only unreferenced, unpinned leaves are candidates, so a shared prefix outlives its
one-off tails. Candidates sit in two orders (by last access, one heap per owning
tenant: leaf_heaps.py; and by expiry time when they have one) with lazy deletion: an
entry whose block changed since it was pushed is skipped when popped, and the heaps
are rebuilt once stale entries dominate.
"""

from __future__ import annotations

import heapq
from typing import Callable, Optional, Sequence

from .block_pool import Block
from .leaf_heaps import STALE_SLACK, LeafHeaps


def is_evictable(block: Block) -> bool:
    return block.key is not None and block.ref_count == 0 and block.num_children == 0 and block.pin_count == 0


class EvictionOrder:
    def __init__(self, blocks: Sequence[Block], clock: Callable[[], float]) -> None:
        self._blocks = blocks
        self.clock = clock
        self.lru = LeafHeaps(self._lru_entry_live)  # (last_access, block_id) by owning tenant
        self.expiry_heap: list[tuple[float, int, int]] = []  # (expire_at, last_access, block_id)
        self._tick = 0

    def touch(self, block: Block) -> None:
        """Mark a block just used (a logical clock: ties cannot happen)."""
        self._tick += 1
        block.last_access = self._tick

    def push_if_evictable(self, block: Block, num_live: int) -> None:
        """Offer a block that may have become an evictable leaf; `num_live` sizes the stale-entry bound."""
        if not is_evictable(block):
            return
        if block.expire_at is not None:
            heapq.heappush(self.expiry_heap, (block.expire_at, block.last_access, block.block_id))
        self.lru.push(block.owner, block.last_access, block.block_id, num_live)
        if len(self.expiry_heap) > 2 * num_live + STALE_SLACK:
            self.compact()

    def compact(self) -> None:
        """Drop stale entries (and duplicates) from both orders."""
        blocks = self._blocks
        self.lru.compact()
        self.expiry_heap = [e for e in set(self.expiry_heap) if self.expiry_entry_valid(blocks[e[2]], e[0], e[1])]
        heapq.heapify(self.expiry_heap)

    def _lru_entry_live(self, owner: Optional[str], last_access: int, block_id: int) -> bool:
        block = self._blocks[block_id]
        return block.owner == owner and self.lru_entry_valid(block, last_access)

    @staticmethod
    def lru_entry_valid(block: Block, last_access: int) -> bool:
        return block.last_access == last_access and is_evictable(block)

    @classmethod
    def expiry_entry_valid(cls, block: Block, expire_at: float, last_access: int) -> bool:
        return block.expire_at == expire_at and cls.lru_entry_valid(block, last_access)

    def pop_expired(self) -> Optional[Block]:
        """The next evictable leaf whose TTL has run out, or None (a tenant's minimum does not keep it)."""
        now = self.clock()
        heap = self.expiry_heap
        while heap and heap[0][0] <= now:
            expire_at, last_access, block_id = heapq.heappop(heap)
            block = self._blocks[block_id]
            if self.expiry_entry_valid(block, expire_at, last_access):
                return block
        return None

    def pop_lru(self, may_evict: Callable[[Optional[str]], bool] = lambda owner: True) -> Optional[Block]:
        """The least recently used evictable leaf of an owner `may_evict` allows, or None."""
        block_id = self.lru.pop(lambda owner, block_id: may_evict(owner))
        return None if block_id is None else self._blocks[block_id]

    def pop_lru_of(self, owner: Optional[str]) -> Optional[Block]:
        """`owner`'s least recently used evictable leaf, or None."""
        block_id = self.lru.pop_of(owner)
        return None if block_id is None else self._blocks[block_id]
