"""The dashboard's picture of the radix index: merged chains, folded subtrees, a bounded node count."""

import random

import pytest
from cache_helpers import FakeRequest, admit, finish, insert_full_blocks

from prefixserve.cache import BlockKeyer, RadixCache
from prefixserve.cache.tree_view import TierCount, build_tree_view

SIZE = 4
SCOPE = b"s" * 32
OTHER_SCOPE = b"o" * 32


def serve(cache, keyer, token_ids, scope=SCOPE, ttl=None, keep=False):
    """One request's life: admit, cache its full blocks, finish (unless `keep`); returns it."""
    request = admit(cache, keyer, FakeRequest(list(token_ids), scope), ttl=ttl)
    insert_full_blocks(cache, request, ttl)
    if not keep:
        finish(cache, request)
    return request


def blocks_of(cache):
    return map(cache.get, cache.keys())


def by_id(view):
    return {node.id: node for node in view.nodes}


def test_a_chain_of_single_children_is_one_node_and_a_fork_has_one_child_per_branch():
    cache, keyer = RadixCache(16, SIZE), BlockKeyer(SIZE)
    serve(cache, keyer, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0])  # blocks 0, 1, 2 cached (3 was the tail)
    serve(cache, keyer, [1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97, 96, 0])  # hits 0, 1; caches block 4
    view = build_tree_view(blocks_of(cache), SIZE)
    assert [(n.id, n.parent, n.kind, n.num_blocks, n.num_tokens, n.subtree_blocks) for n in view.nodes] == [
        ("root", None, "root", 0, 0, 4),
        ("s0", "root", "scope", 0, 0, 4),
        ("b0", "s0", "prefix", 2, 8, 4),
        ("b2", "b0", "prefix", 1, 4, 1),
        ("b4", "b0", "prefix", 1, 4, 1),
    ]
    nodes = by_id(view)
    assert nodes["b0"].label == cache.pool.blocks[0].key.hex()[:12]
    # Release touches the tail first, so the shared prefix is the newest use and A's tail the oldest.
    assert nodes["b0"].recency == 1.0 and nodes["b0"].ticks_since_use == 0
    assert 0.0 < nodes["b4"].recency < 1.0
    assert nodes["b2"].recency == 0.0 and nodes["b2"].ticks_since_use > nodes["b4"].ticks_since_use
    assert (view.num_blocks, view.num_segments, view.num_folded_blocks) == (4, 3, 0)
    assert view.tiers == [TierCount("device", 4, 4)]


def test_children_that_do_not_fit_fold_into_one_more_node_and_the_largest_are_drawn():
    cache, keyer = RadixCache(128, SIZE), BlockKeyer(SIZE)
    shared = [7, 7, 7, 7]
    for i in range(10):  # child i: i + 1 blocks after the shared one
        serve(cache, keyer, shared + [100 + i] * (SIZE * (i + 1)) + [0])
    view = build_tree_view(blocks_of(cache), SIZE, max_nodes=6)
    assert len(view.nodes) == 6
    nodes = by_id(view)
    more = nodes["mb0"]
    assert (more.parent, more.kind, more.label, more.num_folded) == ("b0", "more", "8 more", 8)
    assert more.num_blocks == more.subtree_blocks == sum(range(1, 9))
    drawn = sorted(n.num_blocks for n in view.nodes if n.parent == "b0" and n.kind == "prefix")
    assert drawn == [9, 10]
    assert view.num_folded_blocks == 36
    assert sum(n.num_blocks for n in view.nodes) == view.num_blocks == 1 + sum(range(1, 11))


def test_flags_pinned_in_use_expiring_and_named_scopes():
    now = [100.0]
    cache, keyer = RadixCache(32, SIZE, clock=lambda: now[0]), BlockKeyer(SIZE)
    pinned = serve(cache, keyer, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    cache.pin(pinned.keys)
    running = serve(cache, keyer, [9, 9, 9, 9, 0], keep=True)  # still held by a running request
    serve(cache, keyer, [5, 5, 5, 5, 0], scope=OTHER_SCOPE, ttl=30.0)
    now[0] = 110.0
    view = build_tree_view(blocks_of(cache), SIZE, scope_names={SCOPE: "shared", OTHER_SCOPE: "tenant-a"}, now=now[0])
    scopes = {n.label: n for n in view.nodes if n.kind == "scope"}
    assert set(scopes) == {"shared", "tenant-a"}
    assert scopes["shared"].subtree_blocks == 3 and scopes["tenant-a"].subtree_blocks == 1
    assert view.blocks_by_scope == {"shared": 3, "tenant-a": 1}
    segments = {n.num_blocks: n for n in view.nodes if n.parent == scopes["shared"].id}
    assert segments[2].pinned and segments[2].ref_count == 0 and not segments[2].expiring
    assert segments[1].ref_count == 1 and not segments[1].pinned
    expiring = next(n for n in view.nodes if n.parent == scopes["tenant-a"].id)
    assert expiring.expiring and expiring.expires_in == pytest.approx(20.0)
    assert scopes["shared"].pinned and scopes["shared"].ref_count == 1  # a scope aggregates what is below it
    finish(cache, running)


def test_tier_counts_name_blocks_only_a_lower_tier_holds():
    cache, keyer = RadixCache(16, SIZE), BlockKeyer(SIZE)
    request = serve(cache, keyer, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    view = build_tree_view(
        blocks_of(cache), SIZE, tier_keys={"host": [request.keys[0], b"k" * 32], "disk": [b"k" * 32, b"j" * 32]}
    )
    assert view.tiers == [TierCount("device", 2, 1), TierCount("host", 2, 1), TierCount("disk", 2, 2)]
    assert {n.tier for n in view.nodes} == {"device"}
    segment = next(n for n in view.nodes if n.kind == "prefix")
    assert segment.num_blocks == 2 and segment.copies == ()  # host holds only the first of its blocks
    both = build_tree_view(blocks_of(cache), SIZE, tier_keys={"host": request.keys, "disk": []})
    assert [n.copies for n in both.nodes] == [(), (), ("host",)]


def test_an_empty_pool_is_a_root_alone_and_max_nodes_below_two_is_refused():
    view = build_tree_view([], SIZE)
    assert [(n.id, n.subtree_blocks) for n in view.nodes] == [("root", 0)]
    with pytest.raises(ValueError, match="max_nodes must be at least 2"):
        build_tree_view([], SIZE, max_nodes=1)


@pytest.mark.parametrize("max_nodes", [2, 3, 7, 40, 300])
def test_random_forests_stay_within_the_bound_and_account_for_every_block(max_nodes):
    rng = random.Random(max_nodes)
    cache, keyer = RadixCache(2048, SIZE), BlockKeyer(SIZE)
    for _ in range(150):
        stem = [rng.randrange(3) for _ in range(SIZE * rng.randrange(1, 4))]
        scope = rng.choice([SCOPE, OTHER_SCOPE])
        serve(cache, keyer, stem + [rng.randrange(50) for _ in range(SIZE * rng.randrange(0, 5))] + [0], scope)
    view = build_tree_view(blocks_of(cache), SIZE, max_nodes=max_nodes)
    assert len(view.nodes) <= max_nodes
    seen = set()
    for node in view.nodes:  # parents come before their children
        assert node.parent is None or node.parent in seen
        seen.add(node.id)
    assert sum(n.num_blocks for n in view.nodes) == view.num_blocks == cache.num_cached_blocks
    assert view.nodes[0].subtree_blocks == cache.num_cached_blocks


def test_100000_blocks_render_as_at_most_300_nodes():
    size = 16
    cache, keyer = RadixCache(100_500, size), BlockKeyer(size)
    rng = random.Random(0)
    system_prompts = [[p] * (size * 32) for p in range(4)]
    while cache.num_cached_blocks < 100_000:
        tail = [rng.randrange(8000) for _ in range(size * rng.randrange(1, 40))]
        serve(cache, keyer, rng.choice(system_prompts) + tail + [0])
    view = build_tree_view(blocks_of(cache), size)
    assert len(view.nodes) <= 300
    assert sum(n.num_blocks for n in view.nodes) == view.num_blocks >= 100_000
    shared = [n for n in view.nodes if n.kind == "prefix" and n.num_blocks == 32 and n.parent == "s0"]
    assert len(shared) == 4  # each system prompt is one node
    assert view.num_folded_blocks > 0
