"""How blocks leave the radix index: eviction (expired leaves first, then the least recently used
leaf), TTL expiry, and clearing a scope or everything. A part of RadixCache (radix.py), which
holds the index, the pool, the eviction order and the counters these methods keep exact.

A block leaves only as an unreferenced, unpinned leaf (or all at once in a clear, where a block a
request still holds turns private and is freed on release); its parent may then become a leaf.
"""

from __future__ import annotations

from typing import Optional, Union

from .block_pool import Block
from .events import AllBlocksCleared, BlockRemoved

Parent = Union[Block, bytes]


class RadixRemoval:
    """RadixCache's removals (a mixin: RadixCache.__init__ sets _index, _order, pool, events, stats,
    block_size, on_evict and the _num_* counters these keep)."""

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks`: expired leaves first, then least recently used leaves."""
        num_evicted = 0
        while num_evicted < num_blocks:
            block = self._pop_expired()
            if block is None:
                block = self._pop_lru()
                if block is None:
                    break
                if self.on_evict is not None:  # an expired block is dropped; a cold one may spill below
                    self.on_evict(block)
            self._uncache(block)
            num_evicted += 1
        return num_evicted

    def expire(self) -> int:
        """Reclaim every expired, unreferenced prefix now (leaves first, up the chain)."""
        num_expired = 0
        while (block := self._pop_expired()) is not None:
            self._uncache(block)
            num_expired += 1
        return num_expired

    def _pop_expired(self) -> Optional[Block]:
        block = self._order.pop_expired()
        if block is not None:
            self.stats.num_expired_blocks += 1
        return block

    def _pop_lru(self) -> Optional[Block]:
        block = self._order.pop_lru()
        if block is not None:
            self.stats.num_evicted_blocks += 1
            self.stats.num_evicted_tokens += self.block_size
        return block

    def _uncache(self, block: Block, publish: bool = True) -> None:
        """Drop a block from the index; it is freed now if unreferenced, else on release."""
        del self._index[block.key]
        if publish and self.events is not None:
            self.events.publish(BlockRemoved([block.key]))
        block.key = None
        block.token_bytes = None
        if block.pin_count:
            self._num_pinned -= 1
            block.pin_count = 0
            pinned = True
        else:
            pinned = False
        parent = block.parent
        block.parent = block.scope = None
        block.device_only = False
        block.num_children = 0
        if block.ref_count == 0:
            self._num_cached_unreferenced -= 1
            if not pinned:
                self._num_reclaimable -= 1
            self.pool.free(block)
        if isinstance(parent, Block) and parent.key is not None:
            parent.num_children -= 1
            self._order.push_if_evictable(parent, self._num_reclaimable)

    def clear(self, scope_digest: Optional[bytes] = None) -> int:
        """Forget every cached block (of one scope, or all); referenced blocks turn private."""
        if scope_digest is None:
            victims = list(self._index.values())
        else:
            roots: dict[int, bytes] = {}
            victims = [b for b in self._index.values() if self._scope_of(b, roots) == scope_digest]
        for block in victims:
            self._uncache(block, publish=scope_digest is not None)
        if scope_digest is None and self.events is not None:
            self.events.publish(AllBlocksCleared())
        self._order.compact()
        return len(victims)

    def _scope_of(self, block: Block, memo: dict[int, bytes]) -> bytes:
        chain: list[Block] = []
        node: Parent = block
        while isinstance(node, Block) and node.block_id not in memo:
            chain.append(node)
            node = node.parent
        scope = memo[node.block_id] if isinstance(node, Block) else node
        for visited in chain:
            memo[visited.block_id] = scope
        return scope
