"""The radix index over cached blocks, one concept: every change of a cached block's state passes here.

Longest match, insert, references, leaf-first LRU eviction, TTL, pins, and each tenant's share of them.

Blocks are the nodes. Each cached block links to its parent (the block before
it in the prompt, or the scope digest for block 0), so the cached blocks of all
prompts form a forest whose paths are shared prefixes:

    scope ─ b0 ─ b1 ─ b2 ─ b3      (prompt A)
                  └── b4 ─ b5      (prompt B shares b0, b1)

Lookup is by chained key (one dict probe per block, no tree walk), and the
parent link plus the stored token ids are verified on every hit, so a key
collision is a miss. Only unreferenced, unpinned *leaves* are evictable
(b3, b5 above); b1 becomes a candidate once b2..b5 are gone, so shared
prefixes outlive one-off tails. Evictable leaves sit in a heap ordered by last
access (lazy deletion: a stale entry is skipped when popped), O(log n) a step.

A block leaves only as an unreferenced, unpinned leaf (or all at once in a
clear, where a block a request still holds turns private and is freed on
release); its parent may then become a leaf. The eviction order (eviction.py)
and the pins (pin_counts.py) are objects of the index, each owning its state.

Invariant that keeps `num_reclaimable_blocks` exact: whoever holds a cached
block holds its ancestors too (a request acquires a matched prefix path; a
block computed twice is merged into the cached copy), and pins cover paths.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional, Sequence, Union

from .block_pool import Block, BlockPool
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventQueue
from .eviction import EvictionOrder
from .integrity import check_integrity
from .keys import max_hit_blocks, pack_tokens
from .pin_counts import PinCounts
from .stats import CacheStats, CacheUsage
from .tenant_blocks import TenantBlocks
from .tenant_shares import NO_SHARES, TenantShares

Parent = Union[Block, bytes]


class OutOfBlocksError(RuntimeError):
    """Raised when referenced and pinned blocks leave too few to allocate."""


class MatchResult(NamedTuple):
    blocks: list[Block]
    num_tokens: int


class RadixCache:
    """The index: lookup, references, allocation, insert, removal; pins through `pins`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        max_pinned_blocks: Optional[int] = None,
        clock: Callable[[], float] = time.monotonic,
        events: Optional[EventQueue] = None,
        shares: TenantShares = NO_SHARES,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.pins = PinCounts(num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks)
        self.clock = clock
        self.events = events
        self.stats = CacheStats()
        self._index: dict[bytes, Block] = {}
        self._order = EvictionOrder(self.pool.blocks, clock)
        self._num_cached_unreferenced = 0
        self.tenants = TenantBlocks(shares, num_blocks)  # whose the cached blocks are, against their shares
        # Hooks for the tiers below the pool (engine/kv_tiers.py): a block just cached, and a cold
        # block about to leave by LRU eviction while its KV is still intact in its slot.
        self.on_insert: Optional[Callable[[Block], None]] = None
        self.on_evict: Optional[Callable[[Block], None]] = None
        # A caller's block replaced by the cached copy of the same tokens (duplicate, kept), before the
        # duplicate is released: the window layers' slots (window_slots.py) move with it.
        self.on_merge: Optional[Callable[[Block, Block], None]] = None

    # ----------------------------------------------------------------- lookup
    def match(
        self,
        scope_digest: bytes,
        keys: Sequence[bytes],
        token_ids: Sequence[int],
        *,
        record_stats: bool = True,
    ) -> MatchResult:
        """Longest cached prefix of `token_ids`; never covers the last token (its logits are needed)."""
        size = self.block_size
        max_blocks = max_hit_blocks(len(token_ids), size, len(keys))
        now = self.clock()
        blocks: list[Block] = []
        previous: Parent = scope_digest
        index = self._index
        for i in range(max_blocks):
            block = index.get(keys[i])
            if block is None:
                break
            parent_ok = block.parent is previous if i else block.parent == previous
            if not parent_ok or block.token_bytes != pack_tokens(token_ids[i * size : (i + 1) * size]):
                self.stats.num_collisions += 1
                break
            if block.expire_at is not None and block.expire_at <= now:
                break
            blocks.append(block)
            previous = block
        if record_stats:
            self.stats.record_query(len(token_ids), len(blocks) * size)
        return MatchResult(blocks, len(blocks) * size)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def get(self, key: bytes) -> Optional[Block]:
        return self._index.get(key)

    def keys(self) -> list[bytes]:
        """Every cached block key (a snapshot for a router that resyncs)."""
        return list(self._index)

    # ------------------------------------------------------ references and LRU
    def acquire(self, blocks: Sequence[Block], ttl: Optional[float] = None) -> None:
        """Reference a matched prefix path (root first); refreshes LRU position and TTL.

        A block inserted without TTL never expires; `ttl` can lengthen, never
        shorten, the lifetime of a prefix that has one.
        """
        now = self.clock()
        for block in blocks:
            assert block.key is not None, f"acquire expects cached blocks, got {block}"
            if block.ref_count == 0:
                self._count_unreferenced(block, -1)
                self.pins.referenced(block)
            block.ref_count += 1
            self._order.touch(block)
            if block.ttl is not None and ttl is not None:
                block.ttl = max(block.ttl, ttl)  # the longest lifetime asked for wins
            block.expire_at = None if block.ttl is None else now + block.ttl

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block; tail first so tails age before their prefixes."""
        now = self.clock()
        for block in reversed(blocks):
            assert block.ref_count > 0, f"release of unreferenced {block}"
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.key is None:
                self.pool.free(block)
                continue
            self._count_unreferenced(block, 1)
            self.pins.unreferenced(block)
            self._order.touch(block)
            if block.ttl is not None:
                block.expire_at = now + block.ttl  # the TTL counts from the last use
            self._order.push_if_evictable(block, self.num_reclaimable_blocks)

    def _count_unreferenced(self, block: Block, delta: int) -> None:
        self._num_cached_unreferenced += delta
        self.tenants.count_unreferenced(block.owner, delta)

    # ------------------------------------------------------------- allocation
    @property
    def num_reclaimable_blocks(self) -> int:
        """Cached blocks eviction could free right now (unreferenced, unpinned)."""
        return self._num_cached_unreferenced - self.pins.num_unreferenced

    def num_reclaimable_for(self, requester: Optional[str]) -> int:
        """The reclaimable blocks `requester`'s need may evict: all but another tenant's below its minimum."""
        return self.num_reclaimable_blocks - self.tenants.guarded_for(requester, self.pins)

    def can_allocate(self, num_blocks: int, requester: Optional[str] = None, guard_minimums: bool = True) -> bool:
        reclaimable = self.num_reclaimable_for(requester) if guard_minimums else self.num_reclaimable_blocks
        return num_blocks <= self.pool.num_free_blocks + reclaimable

    def allocate(self, num_blocks: int, requester: Optional[str] = None) -> list[Block]:
        """`num_blocks` private blocks (ref 1) for `requester` (a tenant, or None), evicting cold leaves if the
        free list is short: never another tenant's below its minimum, unless nothing else is left to keep a
        request that `can_allocate` let in running (a public prefix above a guarded tenant's chain is counted
        reclaimable but cannot leave first; such a breach is counted, `num_min_share_overrides`)."""
        shortfall = num_blocks - self.pool.num_free_blocks
        if shortfall > 0:
            shortfall -= self.evict(shortfall, requester)
            if shortfall > 0:
                overridden = self.evict(shortfall, requester, guard_minimums=False)
                self.stats.num_min_share_overrides += overridden
                shortfall -= overridden
        if shortfall > 0:
            raise OutOfBlocksError(
                f"need {num_blocks} KV blocks but only {self.pool.num_free_blocks} can be freed; "
                "running requests and pins hold the rest (raise the KV memory budget or lower max_num_seqs)"
            )
        return [self.pool.allocate() for _ in range(num_blocks)]

    def can_admit(
        self, hit: Sequence[Block], num_new_blocks: int, requester: Optional[str] = None, guard_minimums: bool = True
    ) -> bool:
        """Whether `admit(hit, num_new_blocks)` would succeed now (it changes nothing)."""
        num_cold_hits = sum(1 for block in hit if block.ref_count == 0 and block.pin_count == 0)
        return self.can_allocate(num_new_blocks + num_cold_hits, requester, guard_minimums)

    def admit(
        self,
        hit: Sequence[Block],
        num_new_blocks: int,
        ttl: Optional[float] = None,
        requester: Optional[str] = None,
        guard_minimums: bool = True,
    ) -> Optional[list[Block]]:
        """The one admission step: acquire a matched prefix and allocate `num_new_blocks` after it, for
        `requester` (whose share decides what it may evict).

        Returns hit + new blocks, or None (nothing changed) when they cannot all be had. Acquiring
        a cold hit takes it out of the reclaimable pool, so it is counted against the free room:
        checking `can_allocate(num_new_blocks)` alone would over-promise.
        """
        if not self.can_admit(hit, num_new_blocks, requester, guard_minimums):
            return None
        self.acquire(hit, ttl)
        return list(hit) + self.allocate(num_new_blocks, requester)

    # ---------------------------------------------------------------- insert
    def insert(
        self,
        block: Block,
        key: bytes,
        token_ids: Sequence[int],
        parent: Parent,
        ttl: Optional[float] = None,
        scope: Optional[bytes] = None,
        device_only: bool = False,
        owner: Optional[str] = None,
        lora: Optional[tuple[int, str]] = None,
    ) -> Block:
        """Register a full block whose KV is written; returns the block the caller should hold.

        `parent` is the caller's previous block (or the scope digest for block 0); `scope` the tenant
        scope the block belongs to (Request.block_scope), by default its parent's; `device_only` keeps
        its KV in the pool (a child of such a block is device-only too); `owner` the tenant whose share it counts
        against: at its maximum, its own coldest leaf leaves to make room, else the block stays private (served,
        not cached); `lora` the (id, name) of the LoRA adapter that computed it, for its KV event.
        If the same block was cached meanwhile by another request, the caller's
        copy is released and the cached one returned (referenced for the caller),
        so duplicates never linger and reference counts stay exact. A private
        (uncacheable) parent or a key collision leaves the block private.
        """
        assert block.ref_count > 0, f"insert expects a block the caller holds, got {block}"
        if block.key is not None:
            return block
        if isinstance(parent, Block) and parent.key is None:
            return block
        token_bytes = pack_tokens(token_ids)
        existing = self._index.get(key)
        if existing is not None:
            same_parent = existing.parent is parent if isinstance(parent, Block) else existing.parent == parent
            if not same_parent or existing.token_bytes != token_bytes:
                self.stats.num_collisions += 1
                return block
            self.acquire([existing], ttl)
            if self.on_merge is not None:
                self.on_merge(block, existing)
            self.release([block])
            self.stats.num_merged_blocks += 1
            return existing
        if owner is not None and self.tenants.holdings.over_maximum(owner, 1) and not self._make_room_within(owner):
            self.stats.count_over_share(owner)
            return block
        block.key = key
        block.token_bytes = token_bytes
        block.parent = parent
        block.scope = scope if scope is not None else (parent.scope if isinstance(parent, Block) else parent)
        block.device_only = device_only or (isinstance(parent, Block) and parent.device_only)
        block.owner = owner
        self.tenants.holdings.add(owner, 1)
        block.ttl = ttl
        block.expire_at = None if ttl is None else self.clock() + ttl
        if isinstance(parent, Block):
            parent.num_children += 1
        self._index[key] = block
        self.stats.num_inserted_blocks += 1
        if self.on_insert is not None:
            self.on_insert(block)
        if self.events is not None:
            parent_key = parent.key if isinstance(parent, Block) else None
            lora_id, lora_name = lora if lora is not None else (None, None)
            self.events.publish(
                BlockStored(
                    [key],
                    parent_key,
                    list(token_ids),
                    self.block_size,
                    scope=block.scope,
                    lora_id=lora_id,
                    lora_name=lora_name,
                )
            )
        return block

    # ---------------------------------------------------------------- removal
    def evict(self, num_blocks: int, requester: Optional[str] = None, guard_minimums: bool = True) -> int:
        """Free up to `num_blocks` for `requester`: expired leaves first, then least recently used leaves, passing
        over another tenant's while it holds no more than its minimum (unless `guard_minimums` is off)."""
        holdings = self.tenants.holdings
        guarded = guard_minimums and holdings.shares.guards_minimums
        num_evicted = 0
        while num_evicted < num_blocks:
            block = self._pop_expired()
            if block is None:
                block = (
                    self._pop_lru(lambda owner: holdings.evictable_by(owner, requester)) if guarded else self._pop_lru()
                )
                if block is None:
                    break
                self._spill_and_uncache(block)
            else:
                self._uncache(block)
            num_evicted += 1
        return num_evicted

    def _make_room_within(self, owner: str) -> bool:
        """Evict `owner`'s own coldest leaf (it is at its maximum); whether there was one."""
        block = self._counted_eviction(self._order.pop_lru_of(owner))
        if block is None:
            return False
        self._spill_and_uncache(block)
        return True

    def _spill_and_uncache(self, block: Block) -> None:
        if self.on_evict is not None:  # an expired block is dropped; a cold one may spill below
            self.on_evict(block)
        self._uncache(block)

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

    def _pop_lru(self, may_evict=lambda owner: True) -> Optional[Block]:
        return self._counted_eviction(self._order.pop_lru(may_evict))

    def _counted_eviction(self, block: Optional[Block]) -> Optional[Block]:
        """`block` (None: nothing was popped), counted as an LRU eviction."""
        if block is not None:
            self.stats.num_evicted_blocks += 1
            self.stats.num_evicted_tokens += self.block_size
        return block

    def _uncache(self, block: Block, publish: bool = True) -> None:
        """Drop a block from the index; it is freed now if unreferenced, else on release."""
        del self._index[block.key]
        if publish and self.events is not None:
            self.events.publish(BlockRemoved([block.key]))
        self.pins.forget(block)
        self.tenants.holdings.remove(block.owner, 1)
        if block.ref_count == 0:
            self._count_unreferenced(block, -1)
        block.key = None
        block.token_bytes = None
        parent = block.parent
        block.parent = block.scope = block.owner = None
        block.device_only = False
        block.num_children = 0
        if block.ref_count == 0:
            self.pool.free(block)
        if isinstance(parent, Block) and parent.key is not None:
            parent.num_children -= 1
            self._order.push_if_evictable(parent, self.num_reclaimable_blocks)

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

    # ------------------------------------------------------------------- pins
    def pin(self, keys: Sequence[bytes]) -> int:
        """Protect the cached prefix along `keys` from eviction and expiry; returns blocks pinned (ValueError
        past the pin cap, `max_pinned_blocks`)."""
        return self.pins.pin(self._cached_path(keys))

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Undo one `pin` of the cached prefix along `keys`; returns blocks unpinned."""
        unpinned = self.pins.unpin(self._cached_path(keys))
        for block in unpinned:
            self._order.push_if_evictable(block, self.num_reclaimable_blocks)
        return len(unpinned)

    def _cached_path(self, keys: Sequence[bytes]) -> list[Block]:
        path: list[Block] = []
        for key in keys:
            block = self._index.get(key)
            if block is None or (path and block.parent is not path[-1]):
                break
            path.append(block)
        return path

    # ------------------------------------------------------------ inspection
    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def usage(self) -> CacheUsage:
        num_blocks = self.pool.num_blocks
        num_free = self.pool.num_free_blocks
        return CacheUsage(
            num_blocks=num_blocks,
            num_free_blocks=num_free,
            num_cached_unreferenced_blocks=self._num_cached_unreferenced,
            num_referenced_blocks=num_blocks - num_free - self._num_cached_unreferenced,
            num_pinned_blocks=self.pins.num_pinned,
            num_cached_blocks=len(self._index),
        )

    def check_integrity(self) -> None:
        """Assert every invariant of pool, index, heaps and counters (for tests)."""
        check_integrity(self)
