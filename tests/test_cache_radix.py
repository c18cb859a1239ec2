"""Exact expectations for the radix cache: block ids, ref counts, eviction order."""

import pytest
from cache_helpers import FakeRequest, admit, finish, insert_full_blocks

from prefixserve.cache import BlockKeyer, CacheScope, EventQueue, OutOfBlocksError, RadixCache
from prefixserve.cache.events import AllBlocksCleared, BlockRemoved, BlockStored

SCOPE = CacheScope("model", "tokenizer")
BS = 4


def make(num_blocks=10, **kwargs):
    cache = RadixCache(num_blocks, BS, **kwargs)
    return cache, BlockKeyer(BS)


def ids(blocks):
    return [block.block_id for block in blocks]


def run(cache, keyer, tokens, scope=SCOPE, output_slots=0, ttl=None):
    request = admit(cache, keyer, FakeRequest(list(tokens), scope.digest), output_slots, ttl)
    insert_full_blocks(cache, request, ttl)
    cache.check_integrity()
    return request


def test_first_request_allocates_in_order_and_caches_full_blocks():
    cache, keyer = make()
    request = run(cache, keyer, range(10))  # 2 full blocks + a tail of 2
    assert ids(request.blocks) == [0, 1, 2]
    assert request.num_cached_tokens == 0
    assert cache.num_cached_blocks == 2
    assert [b.ref_count for b in request.blocks] == [1, 1, 1]
    finish(cache, request)
    cache.check_integrity()
    usage = cache.usage()
    assert (usage.num_free_blocks, usage.num_cached_unreferenced_blocks, usage.num_referenced_blocks) == (8, 2, 0)


def test_shared_prefix_is_reused_and_ref_counted():
    cache, keyer = make()
    first = run(cache, keyer, list(range(12)) + [100])  # 3 full blocks + 1
    second = run(cache, keyer, list(range(12)) + [200, 201])
    assert second.num_cached_tokens == 12
    assert ids(second.blocks[:3]) == [0, 1, 2]
    assert ids(second.blocks[3:]) == [4]
    assert [b.ref_count for b in cache.pool.blocks[:5]] == [2, 2, 2, 1, 1]
    finish(cache, first)
    assert [b.ref_count for b in cache.pool.blocks[:5]] == [1, 1, 1, 0, 1]
    assert cache.pool.blocks[3].key is None  # first's private tail went back to the free list
    finish(cache, second)
    cache.check_integrity()
    assert cache.usage().num_referenced_blocks == 0


def test_match_never_covers_the_last_token():
    cache, keyer = make()
    finish(cache, run(cache, keyer, range(12)))
    again = admit(cache, keyer, FakeRequest(list(range(12)), SCOPE.digest))
    assert again.num_cached_tokens == 8  # block 2 holds the last token, so it is recomputed
    assert ids(again.blocks) == [0, 1, 3]


def test_eviction_takes_lru_leaves_tails_before_shared_prefixes():
    cache, keyer = make(num_blocks=6)
    a = run(cache, keyer, [1] * 8 + [2] * 4 + [9])  # blocks 0,1 shared later; 2 tail; 3 partial
    finish(cache, a)
    b = run(cache, keyer, [1] * 8 + [3] * 4 + [9])  # reuses 0,1; new full block 3, partial 2? (free order)
    assert ids(b.blocks[:2]) == [0, 1]
    finish(cache, b)
    cache.check_integrity()
    # Cached: 0 -> 1 -> {a's block, b's block}. Leaves: a's tail (older), b's tail (newer).
    a_tail, b_tail = cache.get(a.keys[2]), cache.get(b.keys[2])
    assert cache.evict(1) == 1
    assert a_tail.key is None and b_tail.key is not None
    assert cache.evict(1) == 1
    assert b_tail.key is None
    # Only now is the shared block 1 a leaf, then block 0.
    assert cache.evict(5) == 2
    assert cache.num_cached_blocks == 0
    assert cache.stats.num_evicted_blocks == 4 and cache.stats.num_evicted_tokens == 16
    cache.check_integrity()


def test_referenced_blocks_are_never_evicted():
    cache, keyer = make(num_blocks=4)
    running = run(cache, keyer, range(13))  # holds all 4 blocks
    assert cache.evict(4) == 0
    assert not cache.can_allocate(1)
    with pytest.raises(OutOfBlocksError, match="raise the KV memory budget"):
        cache.allocate(1)
    finish(cache, running)
    assert cache.can_allocate(4)
    assert ids(cache.allocate(4)) == [3, 2, 1, 0]  # the private tail was freed first, then LRU leaves
    cache.check_integrity()


def test_allocate_evicts_only_what_it_needs():
    cache, keyer = make(num_blocks=5)
    finish(cache, run(cache, keyer, range(8)))  # blocks 0,1 cached, 2..4 free
    new = cache.allocate(4)
    assert ids(new) == [2, 3, 4, 1]  # the free list first, then the evicted leaf (block 1)
    assert cache.num_cached_blocks == 1 and cache.get(keyer.keys(SCOPE.digest, range(8))[0]).block_id == 0
    cache.release(new)
    cache.check_integrity()


def test_duplicate_computation_merges_into_cached_block():
    cache, keyer = make()
    tokens = list(range(9))
    a = admit(cache, keyer, FakeRequest(tokens, SCOPE.digest))
    b = admit(cache, keyer, FakeRequest(tokens, SCOPE.digest))  # both missed: computing the same blocks
    assert ids(a.blocks) == [0, 1, 2] and ids(b.blocks) == [3, 4, 5]
    insert_full_blocks(cache, a)
    insert_full_blocks(cache, b)
    assert ids(b.blocks) == [0, 1, 5]  # b now holds the cached copies; its duplicates were freed
    assert [blk.ref_count for blk in cache.pool.blocks[:6]] == [2, 2, 1, 0, 0, 1]
    assert cache.stats.num_merged_blocks == 2
    cache.check_integrity()
    finish(cache, a)
    finish(cache, b)
    cache.check_integrity()


def test_forced_hash_collision_never_matches_other_tokens():
    cache = RadixCache(16, BS)
    keyer = BlockKeyer(BS, hash_function=lambda data: b"same")  # every key collides
    a = run(cache, keyer, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert cache.num_cached_blocks == 1  # block 1 collided with block 0 and stayed private
    finish(cache, a)
    b = run(cache, keyer, [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert b.num_cached_tokens == 0
    finish(cache, b)
    c = run(cache, keyer, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert c.num_cached_tokens == 4
    # a: insert of block 1; b: match and insert of block 0; c: match and insert of block 1
    assert cache.stats.num_collisions == 5
    finish(cache, c)
    cache.check_integrity()


def test_parent_link_is_verified_when_keys_ignore_the_chain():
    import hashlib

    cache = RadixCache(16, BS)
    # A broken hash that ignores the parent key: equal blocks at other positions collide.
    keyer = BlockKeyer(BS, hash_function=lambda data: hashlib.sha256(data[32:]).digest())
    finish(cache, run(cache, keyer, [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Block 0 = a's block 1 by tokens, but that block sits after [1,2,3,4], not at the start.
    assert run(cache, keyer, [5, 6, 7, 8, 0]).num_cached_tokens == 0
    # Block 1 = a's block 0 by tokens, but at another position.
    assert run(cache, keyer, [1, 2, 3, 4, 1, 2, 3, 4, 0]).num_cached_tokens == 4


def test_scopes_never_share_blocks_even_when_keys_collide():
    cache = RadixCache(16, BS)
    keyer = BlockKeyer(BS, hash_function=lambda data: b"same")
    tokens = list(range(9))
    finish(cache, run(cache, keyer, tokens, CacheScope("model", "tokenizer", cache_salt="tenant-1")))
    other = run(cache, keyer, tokens, CacheScope("model", "tokenizer", cache_salt="tenant-2"))
    assert other.num_cached_tokens == 0


def test_isolation_across_scopes():
    cache, keyer = make(num_blocks=40)  # room for all five scopes: no eviction
    tokens = list(range(17))
    finish(cache, run(cache, keyer, tokens))
    for scope in (
        CacheScope("model-2", "tokenizer"),
        CacheScope("model", "tokenizer-2"),
        CacheScope("model", "tokenizer", adapter_id="a"),
        CacheScope("model", "tokenizer", cache_salt="t"),
    ):
        request = run(cache, keyer, tokens, scope)
        assert request.num_cached_tokens == 0
        finish(cache, request)
    assert run(cache, keyer, tokens).num_cached_tokens == 16


def test_ttl_is_refreshed_on_hit_and_counts_from_last_use():
    now = [0.0]
    cache, keyer = make(num_blocks=8, clock=lambda: now[0])
    finish(cache, run(cache, keyer, [7] * 8 + [1], ttl=10.0))
    now[0] = 9.0
    hit = run(cache, keyer, [7] * 8 + [2])
    assert hit.num_cached_tokens == 8
    now[0] = 12.0
    finish(cache, hit)  # released at 12: expires at 22
    probe = [7] * 8 + [3]
    now[0] = 21.9
    assert cache.match(SCOPE.digest, keyer.keys(SCOPE.digest, probe), probe).num_tokens == 8
    now[0] = 22.0
    assert cache.match(SCOPE.digest, keyer.keys(SCOPE.digest, probe), probe).num_tokens == 0
    cache.check_integrity()


def test_expired_prefix_is_never_matched_and_reclaimed_first():
    now = [0.0]
    cache, keyer = make(num_blocks=8, clock=lambda: now[0])
    finish(cache, run(cache, keyer, [8] * 8 + [1]))  # older, no TTL
    finish(cache, run(cache, keyer, [7] * 8 + [1], ttl=10.0))  # newer, TTL 10 s
    now[0] = 9.99
    assert cache.match(SCOPE.digest, keyer.keys(SCOPE.digest, [7] * 8 + [2]), [7] * 8 + [2]).num_tokens == 8
    now[0] = 10.0
    assert cache.match(SCOPE.digest, keyer.keys(SCOPE.digest, [7] * 8 + [2]), [7] * 8 + [2]).num_tokens == 0
    assert cache.evict(1) == 1  # the expired leaf goes first although the other prefix is older
    assert cache.get(keyer.keys(SCOPE.digest, [7] * 8)[1]) is None
    assert cache.get(keyer.keys(SCOPE.digest, [8] * 8)[1]) is not None
    assert cache.expire() == 1  # its parent, now a leaf, follows
    assert cache.stats.num_expired_blocks == 2 and cache.stats.num_evicted_blocks == 0
    assert cache.num_cached_blocks == 2
    cache.check_integrity()


def test_pins_protect_prefixes_and_are_capped():
    cache, keyer = make(num_blocks=6, max_pinned_blocks=2)
    system = run(cache, keyer, [5] * 8 + [1])
    finish(cache, system)
    keys = keyer.keys(SCOPE.digest, [5] * 8)
    assert cache.pin(keys) == 2
    assert cache.evict(6) == 0
    assert cache.usage().num_pinned_blocks == 2
    assert not cache.can_allocate(5)
    other = run(cache, keyer, [6] * 8 + [1])
    finish(cache, other)
    with pytest.raises(ValueError, match="max_pinned_blocks=2"):
        cache.pin(keyer.keys(SCOPE.digest, [6] * 8))
    assert cache.unpin(keys) == 2
    cache.check_integrity()
    assert cache.evict(6) == 4


def test_clear_one_scope_or_all_with_events():
    events = EventQueue()
    cache, keyer = make(num_blocks=12, events=events)
    tenant = CacheScope("model", "tokenizer", cache_salt="t")
    finish(cache, run(cache, keyer, range(9)))
    running = run(cache, keyer, range(9), tenant)
    stored = events.drain()
    assert [type(e) for e in stored] == [BlockStored] * 4
    assert stored[0].parent_key is None and stored[1].parent_key == stored[0].keys[0]
    assert stored[1].token_ids == [4, 5, 6, 7] and stored[1].block_size == BS
    assert cache.clear(tenant.digest) == 2
    assert [type(e) for e in events.drain()] == [BlockRemoved, BlockRemoved]
    cache.check_integrity()
    assert run(cache, keyer, range(9)).num_cached_tokens == 8  # the other scope survives
    assert cache.clear() == 2
    assert isinstance(events.drain()[-1], AllBlocksCleared)
    finish(cache, running)
    cache.check_integrity()
    assert cache.usage().num_cached_blocks == 0


def test_event_log_cursor_and_resync_signal():
    events = EventQueue(max_events=3)
    cache, keyer = make(num_blocks=12, events=events)
    finish(cache, run(cache, keyer, range(9)))  # 2 BlockStored: seq 0, 1
    got, cursor, complete = events.since(0)
    assert [type(e) for e in got] == [BlockStored, BlockStored] and cursor == 2 and complete
    assert events.since(cursor) == ([], 2, True)
    cache.evict(2)  # 2 BlockRemoved: seq 2, 3; seq 0 falls off the bounded log
    got, cursor2, complete = events.since(cursor)
    assert [type(e) for e in got] == [BlockRemoved, BlockRemoved] and cursor2 == 4 and complete
    assert events.since(0)[2] is False  # a reader at 0 missed a dropped event: resync
    assert events.num_dropped == 1


def test_admit_counts_a_cold_hit_against_the_room_it_takes():
    cache, keyer = make(num_blocks=4)
    finish(cache, run(cache, keyer, range(8)))  # 2 cached, unreferenced blocks; 2 free
    request = FakeRequest(list(range(8)) + [99], SCOPE.digest)
    keyer.extend(request.keys, request.scope_digest, request.token_ids)
    hit = cache.match(request.scope_digest, request.keys, request.token_ids)
    assert ids(hit.blocks) == [0, 1] and cache.can_allocate(3)  # 2 free + 2 reclaimable...
    assert cache.admit(hit.blocks, 3) is None  # ...but acquiring the hit makes those 2 unreclaimable
    assert [b.ref_count for b in hit.blocks] == [0, 0]  # a refused admission changes nothing
    cache.check_integrity()
    admitted = cache.admit(hit.blocks, 2)
    assert ids(admitted) == [0, 1, 2, 3] and [b.ref_count for b in admitted] == [1, 1, 1, 1]
    cache.check_integrity()
