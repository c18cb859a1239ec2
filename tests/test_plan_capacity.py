"""plan/capacity.py: a request log replayed through the real radix cache, with exact expectations on crafted logs,
and the same hits as the router's simulator on a trace it replays one request at a time."""

import hashlib

import pytest

from prefixserve.plan.capacity import ReplayRequest, capacity_sweep, replay, requests_from_trace, working_set_blocks
from prefixserve.simulator.replay import SimulationConfig, simulate
from prefixserve.traces.mooncake import Trace, TraceRequest
from prefixserve.traces.named import load_trace

BLOCK_SIZE = 4


def chain(*names: str) -> tuple[bytes, ...]:
    """Chained keys, as the engine's: key i commits to every name before it."""
    keys, parent = [], b"scope"
    for name in names:
        parent = hashlib.sha256(parent + name.encode()).digest()
        keys.append(parent)
    return tuple(keys)


def cycling_log(num_rounds: int = 3) -> list[ReplayRequest]:
    """Prefixes A, B, C in turn: each prompt one full block and a tail of 1 (5 tokens), so each holds 2 blocks."""
    return [ReplayRequest(float(i), None, chain(name), 5) for i, name in enumerate(["A", "B", "C"] * num_rounds)]


def test_three_prefixes_cycling_hit_exactly_when_the_pool_holds_them_all_and_never_below():
    log = cycling_log()
    # 3 cached blocks + the running request's tail: from 4 blocks on, every repeat hits its one full block.
    for size in (4, 5, 100):
        result = replay(log, size, BLOCK_SIZE, prefill_seconds_per_token=0.5, check_integrity=True)
        assert (result.num_requests, result.num_prompt_tokens) == (9, 45)
        assert result.num_hit_tokens == 6 * 4 and result.hit_rate == 24 / 45
        assert result.num_evicted_blocks == 0 and result.num_capacity_miss_tokens == 0
        assert result.capacity_miss_seconds == 0
    # LRU on a cycle longer than the pool: each prefix is evicted just before it comes back.
    three = replay(log, 3, BLOCK_SIZE, prefill_seconds_per_token=0.5, check_integrity=True)
    assert three.num_hit_tokens == 0
    assert three.num_evicted_blocks == 7  # C's admission evicts A, and each of the 6 repeats evicts one
    assert three.num_evicted_tokens == 28
    assert three.num_capacity_miss_tokens == 24  # the 6 repeats' blocks, which an unbounded cache served
    assert three.capacity_miss_seconds == 12.0
    two = replay(log, 2, BLOCK_SIZE, check_integrity=True)
    assert (two.num_hit_tokens, two.num_evicted_blocks, two.num_capacity_miss_tokens) == (0, 8, 24)


def test_a_request_larger_than_the_pool_is_all_recomputed_and_cached_nowhere():
    result = replay(cycling_log(), 1, BLOCK_SIZE)
    assert result.num_oversized_requests == 9
    assert (result.num_hit_tokens, result.num_evicted_blocks, result.num_capacity_miss_tokens) == (0, 0, 24)


def test_output_blocks_inserted_at_finish_are_hits_for_the_next_turn():
    turn_1_prompt, turn_1_output = chain("sys"), chain("sys", "answer")[1:]
    turn_2 = chain("sys", "answer", "question")
    with_output = [ReplayRequest(0.0, "t", turn_1_prompt, 5, turn_1_output), ReplayRequest(1.0, "t", turn_2, 13)]
    without_output = [ReplayRequest(0.0, "t", turn_1_prompt, 5), ReplayRequest(1.0, "t", turn_2, 13)]
    assert replay(with_output, 10, BLOCK_SIZE, check_integrity=True).num_hit_tokens == 8
    assert replay(without_output, 10, BLOCK_SIZE, check_integrity=True).num_hit_tokens == 4


def test_the_last_block_of_a_block_aligned_prompt_is_never_a_hit_and_arrival_order_rules():
    keys = chain("a", "b")
    log = [ReplayRequest(2.0, None, keys, 8), ReplayRequest(1.0, None, keys, 8)]  # given out of order
    result = replay(log, 10, BLOCK_SIZE, check_integrity=True)
    assert result.num_hit_tokens == 4  # the engine recomputes the last token, so block 1 is recomputed


def test_sweep_and_working_set_and_bad_inputs():
    log = cycling_log()
    assert [r.num_hit_tokens for r in capacity_sweep(log, [2, 3, 4], BLOCK_SIZE)] == [0, 0, 24]
    assert working_set_blocks(log) == 3
    with pytest.raises(ValueError, match="at least 1 block"):
        capacity_sweep(log, [4, 0], BLOCK_SIZE)
    with pytest.raises(ValueError, match="wrong block_size"):
        replay([ReplayRequest(0.0, None, chain("a", "b"), 7)], 10, BLOCK_SIZE)


def test_a_trace_replays_to_the_same_hits_as_the_simulator_one_request_at_a_time():
    trace = load_trace("conversation", limit=300)
    # Far apart and without outputs, so the simulator's one replica runs them one at a time as the replay does.
    spaced = Trace(
        [TraceRequest(1000.0 * i, r.input_length, 0, r.hash_ids) for i, r in enumerate(trace.requests)],
        trace.block_size,
    )
    requests = requests_from_trace(spaced)
    for size in (40, 200, 5000):
        ours = replay(requests, size, spaced.block_size, check_integrity=True)
        simulated = simulate(spaced, "round_robin", SimulationConfig(num_replicas=1, capacity_blocks=size))
        assert ours.num_hit_tokens == simulated.num_hit_tokens
        assert ours.num_evicted_blocks == simulated.num_evicted_blocks
        assert ours.num_oversized_requests == simulated.num_failed_allocations
    small, large = (replay(requests, size, spaced.block_size) for size in (40, 5000))
    assert small.num_hit_tokens < large.num_hit_tokens and small.num_evicted_blocks > 0
