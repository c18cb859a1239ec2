"""Every invariant of a RadixCache, asserted in one pass (tests call it after each operation)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_pool import Block
from .eviction import is_evictable

if TYPE_CHECKING:
    from .radix import RadixCache


def check_integrity(cache: "RadixCache") -> None:
    """Block accounting, ref counts, parents cached, child counts, referenced/pinned paths,
    heaps == evictable leaves, expiry entries, counters."""
    order = cache._order
    blocks = cache.pool.blocks
    free_ids = {block.block_id for block in cache.pool.free_list}
    assert len(free_ids) == cache.pool.num_free_blocks, "free list length is off"
    children = [0] * len(blocks)
    num_free = num_cached_unreferenced = num_referenced = num_reclaimable = num_pinned = 0
    held: dict = {}
    unreferenced_by_owner: dict = {}
    pinned_unreferenced_by_owner: dict = {}
    evictable: set[int] = set()
    for block in blocks:
        assert block.ref_count >= 0, f"negative ref count: {block}"
        if block.key is None:
            assert block.pin_count == 0 and block.num_children == 0, f"uncached block has state: {block}"
            assert block.parent is None and block.token_bytes is None, f"uncached block keeps links: {block}"
            if block.ref_count == 0:
                assert block.block_id in free_ids, f"{block} is lost: unreferenced, uncached, not free"
                num_free += 1
            else:
                assert block.block_id not in free_ids, f"{block} is referenced but on the free list"
                num_referenced += 1
            continue
        assert block.block_id not in free_ids, f"cached {block} is on the free list"
        assert cache._index.get(block.key) is block, f"{block} is not indexed under its key"
        parent = block.parent
        if isinstance(parent, Block):
            assert parent.key is not None, f"{block}'s parent {parent} is not cached"
            children[parent.block_id] += 1
            if block.ref_count:
                assert parent.ref_count, f"{block} is referenced but its parent {parent} is not"
            if block.pin_count:
                assert parent.pin_count, f"{block} is pinned but its parent {parent} is not"
        else:
            assert isinstance(parent, bytes), f"{block} has no parent or scope"
        if block.pin_count:
            num_pinned += 1
        if block.owner is not None:
            held[block.owner] = held.get(block.owner, 0) + 1
        if block.ref_count:
            num_referenced += 1
        else:
            num_cached_unreferenced += 1
            num_reclaimable += block.pin_count == 0
            owner = block.owner
            unreferenced_by_owner[owner] = unreferenced_by_owner.get(owner, 0) + 1
            if block.pin_count:
                pinned_unreferenced_by_owner[owner] = pinned_unreferenced_by_owner.get(owner, 0) + 1
    for block in blocks:
        assert block.num_children == children[block.block_id], f"{block} child count is off"
        if is_evictable(block):
            evictable.add(block.block_id)
    assert num_free + num_cached_unreferenced + num_referenced == len(blocks), "blocks unaccounted for"
    assert len(cache._index) == sum(1 for b in blocks if b.key is not None), "index holds stale keys"
    assert num_cached_unreferenced == cache._num_cached_unreferenced, "cached-unreferenced count is off"
    assert num_reclaimable == cache.num_reclaimable_blocks, "reclaimable count is off"
    assert num_pinned == cache.pins.num_pinned <= cache.pins.max_blocks, "pinned count is off"
    assert held == cache.tenants.holdings.held, f"tenants hold {held}, counted {cache.tenants.holdings.held}"
    counted = {owner: n for owner, n in cache.tenants.unreferenced.items() if n}
    assert unreferenced_by_owner == counted, f"unreferenced by tenant {unreferenced_by_owner}, counted {counted}"
    counted = {owner: n for owner, n in cache.pins.unreferenced_by_owner.items() if n}
    assert pinned_unreferenced_by_owner == counted, "pinned-unreferenced by tenant is off"
    in_heap = {block_id for last, block_id in order.lru.live()}
    assert in_heap == evictable, f"LRU heap holds {sorted(in_heap)}, evictable leaves are {sorted(evictable)}"
    for expire_at, last, block_id in order.expiry_heap:
        if order.expiry_entry_valid(blocks[block_id], expire_at, last):
            assert block_id in evictable
    for block_id in evictable:
        if blocks[block_id].expire_at is not None:
            block = blocks[block_id]
            assert (block.expire_at, block.last_access, block_id) in order.expiry_heap, f"{block} lost its expiry"
