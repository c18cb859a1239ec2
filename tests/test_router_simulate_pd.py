"""The step-level replay of whole and disaggregated fleets (`prefixserve simulate --pd`)."""

import json
import math
from dataclasses import replace

import pytest

from prefixserve.cli import main
from prefixserve.router.costs import CostModel
from prefixserve.simulator.pd_replay import fleet_roles, parse_pd, simulate_steps
from prefixserve.simulator.replay import SimulationConfig, prepare_routes
from prefixserve.simulator.steps import last_block_tokens
from prefixserve.traces.mooncake import Trace, TraceRequest
from prefixserve.traces.named import load_trace

# 1 ms a prompt token, no attention term or overhead; a 10 ms decode step plus nothing for KV reads;
# chunks of 512 tokens (0.512 s); 1,000 KV bytes a token and a shared tier at 512 MB/s (1 ms a 512-token block).
COST = CostModel(
    prefill_seconds_per_token=0.001,
    attention_seconds_per_token_pair=0.0,
    decode_seconds_per_token=0.01,
    decode_batch_size=1.0,
    overhead_seconds=0.0,
    kv_bytes_per_token=1000.0,
    decode_bytes_per_second=1e30,
    prefill_chunk_tokens=512.0,
    remote_latency_seconds=0.0,
    remote_bytes_per_second=512e6,
)


def replay(requests, roles, cost=COST, **options):
    trace = Trace(requests, 512)
    config = SimulationConfig(len(roles), 100, cost, remote_blocks=1000, fetch_policy="always", check_integrity=True)
    return simulate_steps(trace, "kv_aware", config, roles, **options)


def by_arrival(result):
    return sorted(result.trails, key=lambda trail: trail.arrival)


def test_a_prefill_slows_decoding_on_a_whole_replica_and_not_on_a_decode_replica():
    decoding = TraceRequest(0.0, 1000, 1001, [1, 2])  # decodes 1,000 tokens (10 s) after its first
    long_prompt = TraceRequest(1.5, 5120, 2, list(range(10, 20)))  # arrives while the first decodes
    whole = by_arrival(replay([decoding, long_prompt], fleet_roles(1, 0)))
    alone = by_arrival(replay([decoding], fleet_roles(1, 0)))
    assert alone[0].tpot == pytest.approx(0.01)  # one step a token, nothing else running
    assert alone[0].ttft == pytest.approx(1.0)
    # on the whole replica the 5,120-token prefill rides along 10 steps of the batch: each 0.512 s longer
    assert whole[0].tpot == pytest.approx((1000 * 0.01 + 10 * 0.512) / 1000, rel=1e-6)
    split = by_arrival(replay([decoding, long_prompt], fleet_roles(1, 1)))
    # on the decode replica only the engine block holding the last token is computed beside the batch
    tail = last_block_tokens(5120) * 0.001
    assert split[1].arrival + split[1].ttft < 10  # handed over while the first still decodes
    assert split[0].tpot == pytest.approx((1000 * 0.01 + tail) / 1000, rel=1e-6)
    assert split[1].decode_fetched_bytes == (5120 - last_block_tokens(5120)) * 1000


def test_the_decode_replica_reads_only_what_it_lacks():
    shared = list(range(8))  # 4,096 tokens every request starts with
    first = TraceRequest(0.0, 8 * 512 + 512 + 100, 4, shared + [100, 101])
    second = TraceRequest(30.0, 8 * 512 + 512 + 100, 4, shared + [200, 201])
    slow = replace(COST, remote_bytes_per_second=5.12e6)  # 100 ms a block: where a prefix is held matters
    trails = by_arrival(replay([first, second], fleet_roles(1, 2), slow))
    assert trails[0].decode_hit_blocks == 0  # nothing anywhere: the prefill replica computed it all
    assert trails[0].written_bytes == (first.input_length - last_block_tokens(first.input_length)) * 1000
    # the second goes to the decode replica holding the shared blocks and reads only its own
    assert trails[1].decode_replica == trails[0].decode_replica
    assert trails[1].decode_hit_blocks == len(shared)
    uncached_blocks = math.ceil((second.input_length - len(shared) * 512) / 512)
    assert 0 < trails[1].decode_fetched_bytes <= (uncached_blocks + 1) * 512 * 1000
    # and the prefill replica computed only what the shared prefix did not cover
    assert trails[1].prefill_hit_blocks == len(shared)
    # (the last trace block is never a hit, as in the policy replay): its blocks and the decode side's last
    assert trails[1].computed_tokens == second.input_length - len(shared) * 512 + last_block_tokens(second.input_length)


def test_conditional_disaggregation_prefills_short_misses_on_the_decode_replica():
    shared = list(range(8))
    requests = [
        TraceRequest(0.0, 8 * 512 + 100, 4, shared + [100]),
        TraceRequest(30.0, 8 * 512 + 100, 4, shared + [200]),
    ]
    handed = by_arrival(replay(requests, fleet_roles(1, 1)))
    local = by_arrival(replay(requests, fleet_roles(1, 1), local_prefill_tokens=1024))
    assert handed[1].prefill_replica.startswith("prefill")
    # the decode replica holds the shared 8 blocks: 612 tokens missing, under the threshold
    assert local[0].prefill_replica.startswith("prefill")
    assert local[1].prefill_replica == local[1].decode_replica and local[1].written_bytes == 0
    with pytest.raises(ValueError, match="local_prefill_tokens"):
        replay(requests, fleet_roles(1, 1), local_prefill_tokens=-1)


def test_a_backed_up_prefill_pool_is_not_waited_for():
    requests = [
        TraceRequest(0.0, 4096, 4, list(range(8))),
        TraceRequest(0.5, 4096, 4, list(range(10, 18))),
        TraceRequest(9.0, 4096, 4, list(range(20, 28))),
    ]
    trails = by_arrival(replay(requests, fleet_roles(1, 1), max_prefill_queue=1.0))
    assert trails[0].prefill_replica.startswith("prefill")
    # 3.6 s of the first prompt still to compute: the second is prefilled on the decode replica
    assert trails[1].prefill_replica.startswith("decode") and trails[1].written_bytes == 0
    assert trails[2].prefill_replica.startswith("prefill")  # the pool is free again
    with pytest.raises(ValueError, match="max_prefill_queue"):
        replay(requests, fleet_roles(1, 1), max_prefill_queue=-1.0)


def test_every_request_is_answered_and_the_split_computes_no_more_than_the_tails():
    trace = load_trace("conversation", limit=400)
    routes = prepare_routes(trace)
    config = SimulationConfig(4, 1000, CostModel(), remote_blocks=20000, check_integrity=True)
    whole = simulate_steps(trace, "kv_aware", config, fleet_roles(4, 0), routes)
    split = simulate_steps(trace, "kv_aware", config, fleet_roles(2, 2), routes)
    for result in (whole, split):
        assert len(result.trails) == 400 and all(trail.ttft > 0 for trail in result.trails)
    assert split.hit_rate == pytest.approx(whole.hit_rate, abs=0.01)
    for trail in split.trails:
        assert trail.decode_replica.startswith("decode") and trail.prefill_replica.startswith("prefill")
        lacking = trail.prompt_blocks - trail.decode_hit_blocks
        assert trail.decode_fetched_bytes <= (lacking + 1) * 512 * CostModel().kv_bytes_per_token


def test_roles_and_splits_are_checked():
    assert fleet_roles(2, 0) == ["both", "both"] and fleet_roles(1, 2) == ["prefill", "decode", "decode"]
    assert parse_pd("3:5") == (3, 5)
    for bad in ("3", "a:b", "0:4", "4:0"):
        with pytest.raises(ValueError, match="--pd"):
            parse_pd(bad)
    with pytest.raises(ValueError, match="shared tier"):
        simulate_steps(
            Trace([TraceRequest(0.0, 512, 1, [1])], 512), "kv_aware", SimulationConfig(2), ["prefill", "decode"]
        )


def test_simulate_pd_command(tmp_path, capsys):
    trails, metrics = tmp_path / "trails.jsonl", tmp_path / "pd.json"
    code = main(
        [
            "simulate",
            "--trace",
            "conversation",
            "--limit",
            "200",
            "--replicas",
            "4",
            "--pd",
            "1:3,2:2",
            "--pd-trails",
            str(trails),
            "--json",
            str(metrics),
            "--no-plot",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "both x4" in out and "pd 1:3 against both x4: TPOT p99" in out and "pd 2:2" in out
    rows = [json.loads(line) for line in trails.read_text().splitlines()]
    assert len(rows) == 3 * 200 and {row["fleet"] for row in rows} == {"both x4", "pd 1:3", "pd 2:2"}
    assert set(json.loads(metrics.read_text())) == {"both x4", "pd 1:3", "pd 2:2"}
    code = main(["simulate", "--trace", "conversation", "--limit", "20", "--replicas", "4", "--pd", "3:3", "--no-plot"])
    assert code == 2 and "equal hardware" in capsys.readouterr().err
