"""The simulator's tiers below the pool: exact spills, write-throughs and fetches; the remote tier's lift."""

import json
from dataclasses import replace

import pytest

from prefixserve.cli import main
from prefixserve.router.costs import CostModel
from prefixserve.simulator.replay import (
    SimulationConfig,
    infinite_cache_bound,
    prepare_routes,
    simulate,
    working_set_blocks,
)
from prefixserve.simulator.replica import SimulatedReplica, SimulationClock
from prefixserve.simulator.report import BOUND_NAME
from prefixserve.simulator.tier_model import ReplicaTiers, SimulatedTier
from prefixserve.traces.mooncake import Trace, TraceRequest
from prefixserve.traces.named import load_trace

# 1 ms a prompt token (0.512 s a 512-token block), no attention or overhead. 1,000 KV bytes a token,
# 512,000 a block: host 1 ms a block, disk 10 ms, remote 100 ms, plus a latency of one block's read.
TIER_COST = CostModel(
    prefill_seconds_per_token=0.001,
    attention_seconds_per_token_pair=0.0,
    decode_seconds_per_token=0.01,
    decode_batch_size=1.0,
    overhead_seconds=0.0,
    kv_bytes_per_token=1000.0,
    host_latency_seconds=0.001,
    host_bytes_per_second=512e6,
    disk_latency_seconds=0.01,
    disk_bytes_per_second=51.2e6,
    remote_latency_seconds=0.1,
    remote_bytes_per_second=5.12e6,
)


def make_replica(index=0, capacity_blocks=3, host=0, disk=0, remote=None, cost=TIER_COST, clock=None):
    tiers = ReplicaTiers(
        SimulatedTier("host", host) if host else None, SimulatedTier("disk", disk) if disk else None, remote
    )
    return SimulatedReplica(index, capacity_blocks, cost, 512, clock or SimulationClock(), tiers)


def serve(replica, block_ids, input_length=None, output_length=0):
    """Route one request to `replica` and run it to the end; returns its job."""
    request = TraceRequest(replica.clock.now, input_length or 512 * len(block_ids), output_length, block_ids)
    route = prepare_routes(Trace([request], 512))[0]
    replica.enqueue(request, route)
    job = replica.start_prefill()
    replica.clock.now = job.start + job.prefill_seconds
    replica.finish_prefill(job)
    replica.finish(job)
    replica.cache.check_integrity()
    for tier in replica.tiers.tiers:
        tier.index.check_integrity()
    return job


def keys_of(block_ids):
    return prepare_routes(Trace([TraceRequest(0.0, 512 * len(block_ids), 0, block_ids)], 512))[0].keys


def test_evicted_blocks_spill_to_host_and_come_back_at_fetch_cost():
    replica = make_replica(capacity_blocks=3, host=10)
    a, b = [1, 2, 3], [4, 5, 6]
    first = serve(replica, a)
    assert first.fetch.num_fetch_blocks == 0 and first.prefill_seconds == pytest.approx(1.536)
    assert len(replica.tiers.host) == 0  # nothing left the pool yet
    serve(replica, b)  # the pool holds 3 blocks: A's leave, leaf first, into host
    assert set(replica.tiers.host.index.keys()) == set(keys_of(a))
    again = TraceRequest(replica.clock.now, 1536, 0, a)
    assert replica.lower_tier_run(prepare_routes(Trace([again], 512))[0]) == [("host", 2)]  # never the last block
    job = serve(replica, a)
    assert job.num_hit_blocks == 0 and job.fetch.num_fetch_blocks_by_tier == {"host": 2}
    # 1 ms latency + 2 blocks x 1 ms, then the last block computed: 0.512 s
    assert job.fetch.fetch_seconds == pytest.approx(0.003)
    assert job.prefill_seconds == pytest.approx(0.003 + 0.512)
    assert set(replica.tiers.host.index.keys()) == set(keys_of(a)) | set(keys_of(b))  # B spilled on admission


def test_computed_blocks_are_written_through_to_disk_and_the_shared_remote():
    remote = SimulatedTier("remote", 100)
    clock = SimulationClock()
    first, second = (make_replica(i, capacity_blocks=3, disk=100, remote=remote, clock=clock) for i in range(2))
    a = [1, 2, 3]
    serve(first, a)
    assert set(first.tiers.disk.index.keys()) == set(remote.index.keys()) == set(keys_of(a))
    job = serve(second, a)  # another replica reads what the first wrote
    assert job.fetch.num_fetch_blocks_by_tier == {"remote": 2}
    assert job.prefill_seconds == pytest.approx(0.1 + 2 * 0.1 + 0.512)
    assert set(second.tiers.disk.index.keys()) == {keys_of(a)[2]}  # only the block it computed
    assert remote.num_written_blocks == 3  # the copy it computed again was already there
    serve(first, [4, 5, 6])  # no host tier: A's blocks leave the first replica's pool for good...
    job = serve(first, a)  # ...but its disk, first in fetch order, still has them
    assert job.fetch.num_fetch_blocks_by_tier == {"disk": 2}
    assert job.prefill_seconds == pytest.approx(0.01 + 2 * 0.01 + 0.512)


def test_a_tier_slower_than_recomputing_is_not_fetched():
    slow = replace(TIER_COST, remote_bytes_per_second=512_000 / 0.6)  # 0.6 s a block > 0.512 s to recompute it
    remote = SimulatedTier("remote", 100)
    clock = SimulationClock()
    first, second = (make_replica(i, remote=remote, cost=slow, clock=clock) for i in range(2))
    serve(first, [1, 2, 3])
    job = serve(second, [1, 2, 3])
    assert job.num_hit_blocks == 0 and job.fetch.num_fetch_blocks_by_tier == {"remote": 0}
    assert job.prefill_seconds == pytest.approx(1.536)


def test_the_always_policy_fetches_a_run_slower_than_recomputing_as_the_engine_does():
    slow = replace(TIER_COST, remote_bytes_per_second=512_000 / 0.6)  # 0.6 s a block > 0.512 s to recompute it
    remote = SimulatedTier("remote", 100)
    clock = SimulationClock()
    tiers = [ReplicaTiers(remote=remote) for _ in range(2)]
    first, second = (SimulatedReplica(i, 3, slow, 512, clock, tiers[i], fetch_policy="always") for i in range(2))
    serve(first, [1, 2, 3])
    job = serve(second, [1, 2, 3])
    assert job.fetch.num_fetch_blocks_by_tier == {"remote": 2}  # the whole run but the last block (recomputed)
    assert job.prefill_seconds == pytest.approx(0.1 + 2 * 0.6 + 0.512)
    with pytest.raises(ValueError, match=r"fetch_policy \(--kv-fetch-policy\) must be one of cost, always"):
        SimulationConfig(fetch_policy="never")


def test_a_request_that_cannot_be_admitted_fetches_nothing_and_writes_nothing():
    remote = SimulatedTier("remote", 100)
    replica = make_replica(capacity_blocks=4, remote=remote)
    job = serve(replica, [1, 2, 3, 4], input_length=1800, output_length=300)  # needs 5 blocks of 4
    assert replica.num_failed_allocations == 1 and job.fetch.num_fetch_blocks == 0 and len(remote) == 0


def test_a_tier_evicts_its_least_recently_used_leaf_first():
    tier = SimulatedTier("host", 2)
    tier.put(b"a", None)
    tier.put(b"b", b"a")  # a is now b's parent: not a leaf
    tier.put(b"c", None)  # over capacity: the only cold leaf is b
    assert sorted(tier.index.keys()) == [b"a", b"c"] and tier.num_dropped_blocks == 1
    tier.put(b"a", None)  # present: refreshed, not rewritten
    tier.put(b"d", None)  # c is now the least recently used leaf
    assert sorted(tier.index.keys()) == [b"a", b"d"] and tier.num_written_blocks == 4
    with pytest.raises(ValueError, match="the disk tier needs at least 1 block"):
        SimulatedTier("disk", 0)


def test_kv_aware_fetches_on_an_idle_replica_rather_than_queue_behind_the_holder():
    trace = Trace(
        [
            TraceRequest(0.0, 5120, 0, list(range(1, 11))),  # X on replica 0 (a tie on an idle fleet)
            TraceRequest(6.0, 10240, 0, list(range(1, 11)) + list(range(30, 40))),  # Y extends X: replica 0, 5.12 s
            TraceRequest(7.0, 5220, 0, list(range(1, 11)) + [40]),  # X again, while replica 0 computes Y
        ],
        512,
    )
    config = SimulationConfig(
        num_replicas=2, capacity_blocks=100, cost=TIER_COST, remote_blocks=1000, check_integrity=True
    )
    with_remote = simulate(trace, "kv_aware", config)
    # replica 0 has 4.12 s of Y left; replica 1 fetches X's 10 blocks from the remote tier in 1.1 s
    assert with_remote.num_hit_tokens_by_tier == {"device": 5120, "remote": 5120}
    assert with_remote.ttft_p50 == pytest.approx(5.12) and with_remote.queue_p99 == pytest.approx(0.0)
    local = simulate(trace, "kv_aware", replace(config, remote_blocks=0))
    assert local.num_hit_tokens_by_tier == {"device": 10240}  # without it, recomputing X costs more than waiting
    assert local.queue_p99 > 4.0


def test_config_rejects_negative_tier_sizes():
    with pytest.raises(ValueError, match=r"remote_blocks \(--remote-blocks\) must be 0 \(no remote tier\) or more"):
        SimulationConfig(remote_blocks=-1)
    assert SimulationConfig(host_blocks=5, remote_blocks=9).tier_names == ("host", "remote")


def test_cost_model_describes_each_tier_and_rejects_a_zero_bandwidth(tmp_path):
    costs = CostModel().tier_costs()
    assert list(costs) == ["host", "disk", "remote"]
    assert (costs["host"].bytes_per_second, costs["disk"].bytes_per_second, costs["remote"].bytes_per_second) == (
        20e9,
        3e9,
        5e9,
    )
    with pytest.raises(ValueError, match="CostModel.remote_bytes_per_second must be positive"):
        CostModel(remote_bytes_per_second=0.0)
    path = tmp_path / "costs.json"
    path.write_text('{"prefill_seconds_per_token": 1e-4}')  # a file written before the tiers had costs
    assert CostModel.load(path).host_bytes_per_second == 20e9


@pytest.fixture(scope="module")
def conversation():
    trace = load_trace("conversation")
    return trace, prepare_routes(trace)


def test_a_remote_tier_holding_the_working_set_brings_kv_aware_to_the_bound_and_lowers_ttft(conversation):
    trace, routes = conversation
    bound = infinite_cache_bound(trace, routes)
    local = simulate(trace, "kv_aware", SimulationConfig(num_replicas=8), routes)
    shared = simulate(
        trace, "kv_aware", SimulationConfig(num_replicas=8, remote_blocks=working_set_blocks(routes)), routes
    )
    assert local.hit_rate < 0.5 * bound.hit_rate  # the pools alone: under half of what is reachable
    assert shared.hit_rate >= 0.9 * bound.hit_rate
    assert shared.ttft_p50 < local.ttft_p50 and shared.ttft_p99 < local.ttft_p99
    assert shared.num_hit_tokens_by_tier["remote"] > 0.4 * shared.num_hit_tokens


def test_cli_reports_the_lift_of_a_remote_tier(tmp_path, capsys):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    assert (
        main(
            [
                "simulate",
                "--trace",
                "agent",
                "--limit",
                "300",
                "--replicas",
                "4",
                "--host-blocks",
                "50",
                "--remote-blocks",
                "5000",
                "--policies",
                "kv_aware,round_robin",
                "--json",
                str(out_json),
                "--plot",
                str(out_png),
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tiers below the pool: host 50, remote 5,000 (working set" in out
    local, shared = out.split("with a remote tier of 5,000 blocks shared by the fleet:")
    assert "local only (no remote tier):" in local and "remote hits" not in local and "host hits" in local
    assert shared.splitlines()[1].split()[:8] == ["policy", "hit", "rate", "device", "hits", "host", "hits", "remote"]
    body = json.loads(out_json.read_text())
    assert list(body) == ["local_only", "with_remote"]
    assert list(body["with_remote"]) == ["kv_aware", "round_robin", BOUND_NAME]
    assert body["with_remote"]["round_robin"]["remote_hit_rate"] > 0
    assert "remote_hit_rate" not in body["local_only"]["round_robin"]
    lift = tmp_path / "out_lift.png"
    written = [line.removeprefix("wrote ") for line in out.splitlines() if line.startswith("wrote ")]
    assert written == [str(out_json), str(out_png), str(lift)]
    assert lift.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--trace", "agent", "--remote-blocks", "-1", "--no-plot"]) == 2
    assert "remote_blocks (--remote-blocks) must be 0 (no remote tier) or more, got -1" in capsys.readouterr().err
