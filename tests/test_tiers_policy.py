"""Fetch versus recompute: exact plans on constructed costs, crossovers, and costs learned from observations."""

from __future__ import annotations

import math

import pytest

from prefixserve.tiers import FetchPlan, TierCost, choose_fetch, crossover_tokens, find_run, plan_fetch

BLOCK_SIZE = 16
BLOCK_BYTES = 1_000_000  # 1 MB a block: round numbers below
PREFILL = 1e-3  # seconds a token: a block costs 16 ms to recompute


def costs(**tiers: tuple[float, float]) -> dict[str, TierCost]:
    return {name: TierCost(latency, bandwidth) for name, (latency, bandwidth) in tiers.items()}


def plan(run, cost_table) -> FetchPlan:
    return plan_fetch(run, BLOCK_BYTES, PREFILL, BLOCK_SIZE, cost_table)


def test_fast_tiers_are_fetched_whole():
    # host: 1 ms + 10 blocks at 1 GB/s = 11 ms vs 160 ms; disk: 5 ms + 30 blocks at 0.5 GB/s = 65 ms vs 480 ms
    result = plan([("host", 10), ("disk", 30)], costs(host=(1e-3, 1e9), disk=(5e-3, 5e8)))
    assert result == FetchPlan({"host": 10, "disk": 30}, 0, pytest.approx(0.076), 0.0)
    assert result.num_fetch_blocks == 40


def test_a_tier_slower_than_recompute_is_cut_with_everything_after_it():
    # disk at 50 MB/s: 20 ms a block against 16 ms to recompute it; the host blocks stay worth it
    result = plan([("host", 10), ("disk", 30)], costs(host=(1e-3, 1e9), disk=(0.0, 5e7)))
    assert result.num_fetch_blocks_by_tier == {"host": 10, "disk": 0}
    assert result.num_recompute_blocks == 30
    assert result.fetch_seconds == pytest.approx(0.011)
    assert result.recompute_seconds == pytest.approx(30 * 0.016)


def test_latency_decides_short_runs():
    # disk latency 100 ms: 2 blocks (32 ms of prefill) are not worth it, 20 blocks (320 ms) are
    table = costs(disk=(0.1, 1e10))
    assert plan([("disk", 2)], table).num_fetch_blocks_by_tier == {"disk": 0}
    assert plan([("disk", 20)], table).num_fetch_blocks_by_tier == {"disk": 20}


def test_a_slow_short_segment_is_fetched_when_the_segments_behind_it_pay_for_it():
    # remote: 1 block behind a 30 ms latency (saves -14 ms alone); host behind it saves 9 x 15 ms
    table = costs(remote=(0.03, 1e12), host=(0.0, 1e9))
    result = plan([("remote", 1), ("host", 9)], table)
    assert result.num_fetch_blocks_by_tier == {"remote": 1, "host": 9} and result.num_recompute_blocks == 0
    # but not when they cannot: 1 host block saves only 15 ms
    result = plan([("remote", 1), ("host", 1)], costs(remote=(0.035, 1e12), host=(0.0, 1e9)))
    assert result.num_fetch_blocks_by_tier == {"remote": 0, "host": 0} and result.num_recompute_blocks == 2
    assert result.fetch_seconds == 0.0 and result.recompute_seconds == pytest.approx(0.032)


def test_a_tier_may_appear_twice_and_counts_add_up():
    table = costs(host=(0.0, 1e9), disk=(0.0, 1e9))
    result = plan([("host", 3), ("disk", 4), ("host", 5)], table)
    assert result.num_fetch_blocks_by_tier == {"host": 8, "disk": 4}


def test_empty_run_and_bad_input():
    assert plan([], {}) == FetchPlan({}, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="no TierCost for tier 'disk'"):
        plan([("disk", 3)], {})
    with pytest.raises(ValueError, match="-1 blocks"):
        plan([("host", -1)], costs(host=(0.0, 1e9)))
    with pytest.raises(ValueError, match="bandwidth > 0"):
        TierCost(0.0, 0.0)


def test_crossover_tokens():
    # fetch costs 1e6/16/1e9 = 62.5 us a token against 1 ms of prefill: margin 937.5 us;
    # a 5 ms latency is paid back after 5e-3 / 937.5e-6 = 5.33 tokens
    cost = TierCost(5e-3, 1e9)
    assert crossover_tokens(cost, BLOCK_BYTES, BLOCK_SIZE, PREFILL) == pytest.approx(5e-3 / (1e-3 - 62.5e-6))
    assert crossover_tokens(TierCost(0.0, 1e9), BLOCK_BYTES, BLOCK_SIZE, PREFILL) == 0.0
    assert (
        crossover_tokens(TierCost(5e-3, 1.6e7), BLOCK_BYTES, BLOCK_SIZE, PREFILL) == math.inf
    )  # reading is slower than computing
    # the plan and the crossover agree: 100 ms of latency pays back after 106.7 tokens, so a run of
    # 6 blocks (96 tokens) is recomputed and one of 7 blocks (112 tokens) is fetched
    slow = TierCost(0.1, 1e9)
    assert crossover_tokens(slow, BLOCK_BYTES, BLOCK_SIZE, PREFILL) == pytest.approx(106.67, abs=0.01)
    assert plan([("disk", 6)], {"disk": slow}).num_fetch_blocks_by_tier == {"disk": 0}
    assert plan([("disk", 7)], {"disk": slow}).num_fetch_blocks_by_tier == {"disk": 7}


def test_observe_recovers_latency_and_bandwidth_from_mixed_sizes():
    cost = TierCost(latency_seconds=1.0, bytes_per_second=1.0)  # a wild prior
    for index in range(60):
        num_bytes = (1 + index % 3) * 65536
        cost.observe(num_bytes, 2e-4 + num_bytes / 2e9)
    assert cost.latency_seconds == pytest.approx(2e-4, rel=1e-6)
    assert cost.bytes_per_second == pytest.approx(2e9, rel=1e-6)
    assert cost.num_observations == 60


def test_observe_with_one_size_moves_latency_then_bandwidth():
    cost = TierCost(latency_seconds=1e-3, bytes_per_second=1e9)
    cost.observe(1_000_000, 3e-3)  # 1 ms of transfer at the prior bandwidth: the rest is latency
    assert cost.latency_seconds == pytest.approx(2e-3) and cost.bytes_per_second == 1e9
    fast = TierCost(latency_seconds=1e-3, bytes_per_second=1e9)
    fast.observe(1_000_000, 5e-4)  # faster than the prior bandwidth allows: no latency, more bandwidth
    assert fast.latency_seconds == 0.0 and fast.bytes_per_second == pytest.approx(2e9)
    fast.observe(0, 1.0)  # empty and zero-time observations carry no information
    fast.observe(10, 0.0)
    assert fast.num_observations == 1


def test_observe_is_an_exponential_moving_average():
    cost = TierCost(latency_seconds=0.0, bytes_per_second=1e9, smoothing=0.5)
    cost.observe(1000, 1e-3)
    cost.observe(1000, 3e-3)  # same size: the mean time is (1 + 3) / 2 ms
    assert cost.seconds(1000) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="smoothing"):
        TierCost(0.0, 1.0, smoothing=0.0)


class Held:
    """A tier holding a set of keys, as find_run sees one."""

    def __init__(self, name: str, keys) -> None:
        self.name, self.keys = name, set(keys)

    def contains(self, keys) -> int:
        run = 0
        while run < len(keys) and keys[run] in self.keys:
            run += 1
        return run


def test_find_run_continues_each_tier_where_the_nearer_one_stopped():
    keys = [bytes([i]) for i in range(10)]
    host, disk, remote = Held("host", keys[2:5] + keys[7:8]), Held("disk", keys[:7]), Held("remote", keys)
    assert find_run([host, disk, remote], keys, 2) == [("host", 3), ("disk", 2), ("remote", 3)]
    # host's block 7 is past its run: after disk stops at 7 only the tiers below are asked
    assert find_run([host, disk], keys, 2) == [("host", 3), ("disk", 2)]
    assert find_run([Held("host", []), disk], keys, 0) == [("disk", 7)]  # a tier holding none is left out
    assert find_run([host, disk], keys, 10) == [] and find_run([], keys, 0) == []


def test_choose_fetch_always_takes_the_whole_run_and_cost_is_the_planner():
    run = [("host", 2), ("disk", 3)]
    table = costs(host=(0.0, 1e12), disk=(10.0, 1e6))  # disk: 10 s to read, far slower than recomputing
    assert choose_fetch("cost", run, BLOCK_BYTES, PREFILL, BLOCK_SIZE, table) == plan(run, table)
    always = choose_fetch("always", run, BLOCK_BYTES, PREFILL, BLOCK_SIZE, table)
    assert always.num_fetch_blocks_by_tier == {"host": 2, "disk": 3} and always.num_recompute_blocks == 0
    assert always.fetch_seconds == pytest.approx(table["host"].seconds(2 * BLOCK_BYTES) + 10.0 + 3.0)
    with pytest.raises(ValueError, match="kv_fetch_policy must be one of"):
        choose_fetch("sometimes", run, BLOCK_BYTES, PREFILL, BLOCK_SIZE, table)
