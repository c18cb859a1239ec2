"""Routing policies on fake replica views: exact choices, ties, thresholds, ring stability."""

import random
from dataclasses import dataclass

import pytest

from prefixserve.cache import BlockKeyer, CacheScope, EventQueue, RadixCache
from prefixserve.router.policies import POLICIES, ConsistentHash, KVAware, RouteRequest
from prefixserve.router.policy_options import PolicyOptions
from prefixserve.router.policy_registry import make_policy
from prefixserve.router.prefix_mirror import PrefixMirror
from prefixserve.tiers import TierCost

SCOPE = CacheScope("model", "tokenizer").digest
KEYER = BlockKeyer(1)


@dataclass
class FakeReplica:
    name: str
    load: float = 0.0
    hits: int = 0

    def num_hit_blocks(self, request):
        return self.hits


def request_of(block_ids, tokens_per_block=512):
    """A request of full blocks only: one key per block id."""
    return RouteRequest(KEYER.keys(SCOPE, block_ids), block_ids, SCOPE, len(block_ids), tokens_per_block)


def fleet(loads, hits=None):
    hits = hits or [0] * len(loads)
    return [FakeReplica(f"r{i}", load, hit) for i, (load, hit) in enumerate(zip(loads, hits))]


ANY = request_of([1, 2, 3])


def test_registry_names_and_unknown_policy():
    assert list(POLICIES) == ["round_robin", "least_loaded", "power_of_two", "consistent_hash", "kv_aware"]
    with pytest.raises(
        ValueError,
        match="unknown routing policy 'fastest'; choose one of round_robin, "
        "least_loaded, power_of_two, consistent_hash, kv_aware",
    ):
        make_policy("fastest")


def test_round_robin_cycles_over_replicas():
    policy = make_policy("round_robin")
    replicas = fleet([5, 0, 0])
    assert [policy.choose(ANY, replicas) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_breaks_ties_by_lowest_index():
    policy = make_policy("least_loaded")
    assert policy.choose(ANY, fleet([2.0, 1.0, 1.0, 3.0])) == 1
    assert policy.choose(ANY, fleet([0.0, 0.0])) == 0


def test_power_of_two_is_seeded_and_takes_the_less_loaded_sample():
    replicas = fleet([4.0, 3.0, 2.0, 1.0, 0.0, 5.0, 6.0, 7.0])
    rng = random.Random(7)
    expected = []
    for _ in range(50):
        first, second = sorted(rng.sample(range(8), 2))
        expected.append(second if replicas[second].load < replicas[first].load else first)
    policy = make_policy("power_of_two", PolicyOptions(seed=7))
    assert [policy.choose(ANY, replicas) for _ in range(50)] == expected
    rng = random.Random(7)
    lower_of_each_pair = [min(rng.sample(range(8), 2)) for _ in range(20)]
    tied = make_policy("power_of_two", PolicyOptions(seed=7))
    assert [tied.choose(ANY, fleet([1.0] * 8)) for _ in range(20)] == lower_of_each_pair
    assert make_policy("power_of_two").choose(ANY, fleet([3.0])) == 0


def test_consistent_hash_uses_only_the_first_k_blocks():
    policy = make_policy("consistent_hash", PolicyOptions(hash_prefix_blocks=4))
    replicas = fleet([0.0] * 8)
    base = policy.choose(request_of([1, 2, 3, 4, 5, 6]), replicas)
    assert policy.choose(request_of([1, 2, 3, 4, 99]), replicas) == base
    assert policy.choose(request_of([1, 2, 3, 4]), fleet([9.0] * 8)) == base  # load is ignored
    choices = {policy.choose(request_of([1, 2, 3, first]), replicas) for first in range(40)}
    assert len(choices) > 1  # the 4th block is part of the position


def test_consistent_hash_moves_only_the_removed_replicas_prefixes():
    policy = ConsistentHash(PolicyOptions(virtual_nodes=64))
    replicas = fleet([0.0] * 8)
    rng = random.Random(0)
    requests = [request_of([rng.randrange(10**6) for _ in range(5)]) for _ in range(800)]
    before = [replicas[policy.choose(r, replicas)].name for r in requests]
    assert all(before.count(f"r{i}") > 40 for i in range(8))  # virtual nodes spread the ring
    survivors = [replica for replica in replicas if replica.name != "r3"]
    after = [survivors[policy.choose(r, survivors)].name for r in requests]
    for old, new in zip(before, after):
        if old != "r3":
            assert new == old
        else:
            assert new != "r3"
    assert len({new for old, new in zip(before, after) if old == "r3"}) > 1  # r3's share is spread out


def test_consistent_hash_spreads_prompts_shorter_than_a_block_by_their_tokens():
    policy = make_policy("consistent_hash")
    replicas = fleet([0.0] * 8)
    short = [RouteRequest([], [token, 7, 7], SCOPE, 1, 16) for token in range(50)]
    choices = [policy.choose(request, replicas) for request in short]
    assert len(set(choices)) > 1
    assert [policy.choose(request, fleet([1.0] * 8)) for request in short] == choices
    assert policy.choose(RouteRequest([], [], SCOPE, 0, 16), replicas) in range(8)


def kv_options(block_seconds=0.1, threshold=1.5, slack=0.5):
    return PolicyOptions(
        miss_token_seconds=block_seconds / 512, balance_threshold=threshold, balance_slack_seconds=slack
    )


def test_kv_aware_minimises_missed_blocks_times_weight_plus_load():
    policy = make_policy("kv_aware", kv_options(block_seconds=0.125))
    request = request_of(list(range(10)))
    # costs: 10 x 0.125 + 0 = 1.25;  7 x 0.125 + 0.25 = 1.125;  5 x 0.125 + 0.375 = 1.0
    assert policy.choose(request, fleet([0.0, 0.25, 0.375], [0, 3, 5])) == 2
    # costs 1.25, 1.125, 1.125: the tie goes to the lower index
    assert policy.choose(request, fleet([0.0, 0.25, 0.5], [0, 3, 5])) == 1
    assert policy.choose(request, fleet([0.0, 0.0, 0.0], [4, 4, 4])) == 0


def test_kv_aware_weight_counts_tokens_not_blocks():
    options = PolicyOptions(miss_token_seconds=0.001, balance_slack_seconds=100.0)
    # one 16-token block is worth 0.016 s, one 512-token block 0.512 s
    small = RouteRequest(KEYER.keys(SCOPE, [1, 2]), [1, 2], SCOPE, 2, 16)
    large = RouteRequest(small.keys, small.token_ids, SCOPE, 2, 512)
    replicas = fleet([0.1, 0.0], [1, 0])
    assert make_policy("kv_aware", options).choose(small, replicas) == 1
    assert make_policy("kv_aware", options).choose(large, replicas) == 0


def test_kv_aware_falls_back_to_least_loaded_above_the_threshold():
    policy = KVAware(kv_options(block_seconds=1.0, threshold=1.5, slack=2.5))
    request = request_of(list(range(10)))
    # mean load 1.0: the limit is 1.0 x 1.5 + 2.5 = 4.0, and 4.0 is not above it
    assert policy.choose(request, fleet([4.0, 0.0, 0.0, 0.0], [9, 0, 0, 0])) == 0
    assert policy.num_fallbacks == 0
    # mean 1.0625: limit 4.09375 < 4.25, so the least-loaded replica (lowest index on a tie) wins
    assert policy.choose(request, fleet([4.25, 0.0, 0.0, 0.0], [9, 0, 0, 0])) == 1
    assert policy.num_fallbacks == 1


@dataclass
class FakeReplicaWithPool(FakeReplica):
    kv_cache_usage: float = 0.0  # the share of its pool running requests hold


def test_kv_aware_prices_a_miss_higher_where_running_requests_fill_the_pool():
    options = PolicyOptions(miss_token_seconds=0.1 / 512, balance_slack_seconds=100.0, kv_usage_weight=3.0)
    request = request_of(list(range(10)))
    # A new prefix: 10 blocks x 0.1 s x (1 + 3 x usage) = 3.7 s on the full pool, 1.3 s on the emptier one.
    full, roomy = FakeReplicaWithPool("full", kv_cache_usage=0.9), FakeReplicaWithPool("roomy", kv_cache_usage=0.1)
    assert KVAware(options).choose(request, [full, roomy]) == 1
    assert KVAware(options).choose(request, fleet([0.0, 0.0])) == 0  # views without it: a tie, the lower index
    # A session at home stays there however full its pool: one block missing (0.37 s) against ten (1.0 s).
    home = FakeReplicaWithPool("home", hits=9, kv_cache_usage=0.9)
    assert KVAware(options).choose(request, [FakeReplicaWithPool("empty"), home]) == 1


@pytest.mark.parametrize("wait, factor, moved", [(1.2, 0.5, False), (1.2, 0.0, True), (1.5, 0.5, True)])
def test_kv_aware_moves_a_request_only_where_the_wait_saved_pays_for_its_recompute(wait, factor, moved):
    """Past the guard's limit, the request moves from the replica holding 9 of its 10 blocks (waiting `wait`) to an
    idle one only if 0 + 1.0 s of prefill there + factor x the 0.9 s it recomputes beyond here < wait + 0.1 s."""
    options = PolicyOptions(
        miss_token_seconds=1.0 / 512,
        balance_slack_seconds=0.0,
        prefill_seconds_per_token=0.1 / 512,
        move_cost_factor=factor,
    )
    policy = KVAware(options)
    assert policy.choose(request_of(list(range(10))), fleet([wait, 0.0], [9, 0])) == (1 if moved else 0)
    assert policy.num_fallbacks == int(moved)


def test_kv_aware_spreads_a_hot_prefix_once_its_replica_is_overloaded():
    policy = KVAware(kv_options(block_seconds=1.0, threshold=1.5, slack=0.5))
    replicas = fleet([0.0] * 4, [9, 0, 0, 0])  # only replica 0 holds the hot prefix
    request = request_of(list(range(10)))
    counts = [0] * 4
    for _ in range(200):
        index = policy.choose(request, replicas)
        counts[index] += 1
        replicas[index].load += 1.0
        mean = sum(r.load for r in replicas) / 4
        assert replicas[0].load <= mean * 1.5 + 0.5 + 1.0  # at most one request past the limit
    assert counts[0] > counts[1] and min(counts) > 0
    assert policy.num_fallbacks > 0


def test_prefix_mirror_follows_the_replicas_events():
    events = EventQueue()
    cache = RadixCache(8, 1, events=events)
    mirror = PrefixMirror()
    ids = [10, 11, 12, 13]
    keys = KEYER.keys(SCOPE, ids)
    blocks = cache.allocate(4)
    parent = SCOPE
    for i, block in enumerate(blocks):
        blocks[i] = cache.insert(block, keys[i], ids[i : i + 1], parent)
        parent = blocks[i]
    cache.release(blocks)
    for event in events.drain():
        mirror.apply(event)
    request = RouteRequest(keys, ids, SCOPE, 4, 512)
    assert mirror.num_hit_blocks(request) == 3  # the last block is always recomputed
    assert mirror.num_hit_blocks(request) == len(cache.match(SCOPE, keys, ids, record_stats=False).blocks)
    cache.evict(2)  # leaves first: blocks 3 and 2
    for event in events.drain():
        mirror.apply(event)
    assert mirror.num_hit_blocks(request) == 2
    cache.clear()
    for event in events.drain():
        mirror.apply(event)
    assert mirror.num_hit_blocks(request) == 0


# ------------------------------------------------------------ kv_aware and the tiers below the pool
@dataclass
class TieredReplica:
    """A view that also reports its lower-tier run and, optionally, its prefill queue."""

    name: str
    load: float = 0.0
    hits: int = 0
    run: tuple = ()

    def num_hit_blocks(self, request):
        return self.hits

    def lower_tier_run(self, request):
        return list(self.run)


@dataclass
class QueuedReplica(FakeReplica):
    queue_seconds: float = 0.0


def tier_options(remote_seconds_per_block=0.001, remote_latency=0.01):
    """Blocks of 512 tokens: recompute 0.0512 s a block (1e-4 s a token), weighted 0.1 s; 512,000 bytes a block."""
    return PolicyOptions(
        miss_token_seconds=0.1 / 512,
        balance_slack_seconds=100.0,
        prefill_seconds_per_token=1e-4,
        kv_bytes_per_token=1000,
        tier_costs={
            "host": TierCost(0.001, 512e6),
            "remote": TierCost(remote_latency, 512_000 / remote_seconds_per_block),
        },
    )


def test_kv_aware_moves_a_request_to_an_idle_replica_that_can_fetch_its_prefix():
    request = request_of(list(range(10)))  # 9 blocks can hit, the last is always computed
    busy_holder = TieredReplica("r0", load=0.5, hits=9)  # 0.5 + 1 x 0.1 = 0.6
    idle_fetcher = TieredReplica("r1", run=(("remote", 9),))  # 0.01 + 9 x 0.001 + 1 x 0.1 = 0.119
    policy = KVAware(tier_options())
    assert policy.missing_seconds(request, idle_fetcher) == pytest.approx(0.119)
    assert policy.missing_seconds(request, busy_holder) == pytest.approx(0.1)
    assert policy.choose(request, [busy_holder, idle_fetcher]) == 1
    # the same idle replica without the remote run recomputes all 10 blocks: 1.0 > 0.6, so wait for the holder
    assert policy.choose(request, [busy_holder, TieredReplica("r1")]) == 0


def test_kv_aware_prices_a_run_as_the_engines_planner_fetches_it():
    request = request_of(list(range(10)))
    # host 3 blocks (0.001 + 3 x 0.001) then remote 6 (0.01 + 6 x 0.001): both fetched, 1 block computed
    mixed = TieredReplica("r0", run=(("host", 3), ("remote", 6)))
    assert KVAware(tier_options()).missing_seconds(request, mixed) == pytest.approx(0.004 + 0.016 + 0.1)
    # a remote slower per block (0.06 s) than recomputing (0.0512 s) is never fetched: host only, 7 computed
    slow = KVAware(tier_options(remote_seconds_per_block=0.06))
    assert slow.missing_seconds(request, mixed) == pytest.approx(0.004 + 7 * 0.1)
    assert slow.choose(request, [TieredReplica("r0", load=0.5, hits=9), TieredReplica("r1", run=(("remote", 9),))]) == 0
    # without tier costs (the HTTP router's options today) a run is ignored, and views without runs still work
    plain = KVAware(kv_options(block_seconds=0.1))
    assert plain.missing_seconds(request, mixed) == pytest.approx(1.0)
    assert make_policy("kv_aware", tier_options()).choose(request, fleet([0.5, 0.0], [9, 0])) == 0


def test_kv_aware_waits_on_the_prefill_queue_when_the_view_knows_it():
    request = request_of(list(range(10)))
    options = kv_options(block_seconds=0.1, slack=100.0)
    # 5 s of load, but only 0.1 s of it is prefill ahead in the queue (the rest is decoding): 0.2 < 1.0
    decoding_holder = QueuedReplica("r0", load=5.0, hits=9, queue_seconds=0.1)
    assert KVAware(options).choose(request, [decoding_holder, FakeReplica("r1")]) == 0
    assert KVAware(options).choose(request, [FakeReplica("r0", 5.0, 9), FakeReplica("r1")]) == 1


def test_kv_aware_guard_falls_back_to_the_cheapest_replica_under_the_limit():
    policy = KVAware(kv_options(block_seconds=1.0, threshold=1.5, slack=2.5))
    request = request_of(list(range(10)))
    # replica 0 holds 9 blocks but is over the limit (4.09); of the rest, replica 2 holds 5: not least loaded 1
    assert policy.choose(request, fleet([4.25, 0.0, 0.25, 0.0], [9, 0, 5, 0])) == 2
    assert policy.num_fallbacks == 1


class MirroredReplica:
    """Idle, with a mirror the router updates as it routes (as router/fleet.py does)."""

    def __init__(self, name):
        self.name, self.load, self.mirror = name, 0.0, PrefixMirror()

    def num_hit_blocks(self, request):
        return self.mirror.num_hit_blocks(request)


def test_kv_aware_spreads_new_prefixes_over_an_idle_fleet_then_keeps_them_sticky():
    policy = make_policy("kv_aware")
    replicas = [MirroredReplica(f"r{i}") for i in range(4)]
    prefixes = [request_of([100 * p + i for i in range(6)]) for p in range(8)]

    def route(request):
        index = policy.choose(request, replicas)
        replicas[index].mirror.keys.update(request.keys)
        return index

    # one at a time on an idle fleet (every cost ties): the least recently chosen replica, not always replica 0
    assert [route(request) for request in prefixes] == [0, 1, 2, 3, 0, 1, 2, 3]
    # the same prefixes again, in another order: each back to the replica that holds it
    assert [route(prefixes[p]) for p in (5, 2, 7, 0)] == [1, 2, 3, 0]
