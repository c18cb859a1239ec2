"""The fleet simulator: exact small replays, the agent workload's policy ranking, traces, CLI."""

import gzip
import json
import logging
import math

import pytest

from prefixserve.cli import main
from prefixserve.simulator.replay import (
    CostModel,
    SimulationConfig,
    compare_policies,
    infinite_cache_bound,
    prepare_routes,
    simulate,
)
from prefixserve.simulator.report import BOUND_NAME, format_table, results_to_json
from prefixserve.traces.agents import AgentTraceConfig, generate_agent_trace
from prefixserve.traces.mooncake import TRACE_DIR, Trace, TraceFormatError, TraceRequest, load_mooncake
from prefixserve.traces.named import load_trace

CONVERSATION = TRACE_DIR / "conversation.jsonl.gz"  # shipped in the package: no test reads outside the clone
# 1 ms a prompt token, 10 ms an output token, no attention term or overhead, no decode batching.
SIMPLE_COST = CostModel(
    prefill_seconds_per_token=0.001,
    attention_seconds_per_token_pair=0.0,
    decode_seconds_per_token=0.01,
    decode_batch_size=1.0,
    overhead_seconds=0.0,
)


def one_replica(capacity_blocks=100):
    return SimulationConfig(num_replicas=1, capacity_blocks=capacity_blocks, cost=SIMPLE_COST, check_integrity=True)


# ---------------------------------------------------------------- exact replays
def test_queued_request_waits_and_then_hits_the_prefix_the_first_one_inserted():
    trace = Trace(
        [
            TraceRequest(0.0, 1800, 100, [1, 2, 3, 4]),  # 3 full blocks + a partial one
            TraceRequest(1.0, 1300, 100, [1, 2, 5]),  # 2 full blocks: both hit (the last block 5 is partial)
        ],
        block_size=512,
    )
    result = simulate(trace, "round_robin", one_replica())
    assert result.num_hit_tokens == 1024
    assert result.num_prefill_tokens == 1800 + 1300 - 1024
    # the second waits for the first's prefill (1.8 s), then computes 276 tokens
    assert result.queue_p50 == pytest.approx(0.4) and result.queue_p99 == pytest.approx(0.792)
    assert result.ttft_p50 == pytest.approx((1.8 + 1.076) / 2)
    assert result.load_imbalance == 1.0
    bound = infinite_cache_bound(trace)
    assert bound.num_hit_tokens == 1024 and math.isnan(bound.ttft_p50)


def test_unsorted_trace_is_refused():
    trace = Trace([TraceRequest(5.0, 100, 1, [1]), TraceRequest(1.0, 100, 1, [2])], 512)
    with pytest.raises(ValueError, match="arrival order"):
        simulate(trace, "round_robin", one_replica())


def test_last_block_is_never_a_hit_even_when_full():
    trace = Trace([TraceRequest(0.0, 1536, 0, [1, 2, 3]), TraceRequest(10.0, 1536, 0, [1, 2, 3])], 512)
    assert simulate(trace, "kv_aware", one_replica()).num_hit_tokens == 1024
    assert infinite_cache_bound(trace).num_hit_tokens == 1024


def test_capacity_pressure_evicts_least_recently_used_leaves():
    # 6 blocks: A and B fill the pool, C evicts all of A (leaf first), A again evicts all of B.
    # C again hits blocks 7, 8 and needs one block for its recomputed last block: the LRU leaf is
    # C's own old block 9 (A's blocks are newer), so 3 + 3 + 1 evictions.
    a, b, c = [1, 2, 3], [4, 5, 6], [7, 8, 9]
    trace = Trace([TraceRequest(10.0 * i, 1536, 0, ids) for i, ids in enumerate([a, b, c, a, c])], 512)
    result = simulate(trace, "round_robin", one_replica(capacity_blocks=6))
    assert result.num_evicted_blocks == 7
    assert result.num_hit_tokens == 2 * 512
    assert result.num_failed_allocations == 0


def test_request_larger_than_the_cache_is_computed_without_caching():
    trace = Trace([TraceRequest(0.0, 1800, 300, [1, 2, 3, 4]), TraceRequest(5.0, 1800, 300, [1, 2, 3, 4])], 512)
    result = simulate(trace, "round_robin", one_replica(capacity_blocks=4))  # needs ceil(2100/512) = 5
    assert result.num_failed_allocations == 2
    assert result.num_hit_tokens == 0 and result.num_prefill_tokens == 3600


def test_blocks_held_by_decoding_requests_cannot_be_evicted():
    # B arrives while A decodes for 30 s holding 10 of the 11 blocks: 1 free block, B needs 4.
    trace = Trace([TraceRequest(0.0, 1800, 3000, [1, 2, 3, 4]), TraceRequest(5.0, 1800, 100, [9, 8, 7, 6])], 512)
    result = simulate(trace, "round_robin", one_replica(capacity_blocks=11))
    assert result.num_failed_allocations == 1
    assert result.num_evicted_blocks == 0


# ------------------------------------------------------------- agent workload
@pytest.fixture(scope="module")
def agent_run():
    trace = generate_agent_trace(AgentTraceConfig(seed=0))
    results = compare_policies(trace, ["round_robin", "kv_aware"], SimulationConfig(num_replicas=8))
    return trace, {result.policy: result for result in results}


def test_kv_aware_beats_round_robin_on_agent_sessions(agent_run):
    trace, results = agent_run
    round_robin, kv_aware, bound = results["round_robin"], results["kv_aware"], results[BOUND_NAME]
    # round robin scatters each session's turns, so most turns recompute history another replica holds
    assert round_robin.num_prefill_tokens >= 4 * kv_aware.num_prefill_tokens
    assert bound.hit_rate - 0.05 <= kv_aware.hit_rate <= bound.hit_rate
    # at this load (no queueing) kv_aware keeps sessions where their history is rather than evening out
    # busy time; the balance it keeps under saturating load is asserted in test_router_simulate_load.py
    assert kv_aware.ttft_p99 < round_robin.ttft_p99
    assert round_robin.hit_rate <= bound.hit_rate
    assert kv_aware.num_requests == len(trace) and kv_aware.num_failed_allocations == 0


def test_simulation_is_deterministic_for_a_seed():
    first = generate_agent_trace(AgentTraceConfig(seed=3, num_sessions=30))
    second = generate_agent_trace(AgentTraceConfig(seed=3, num_sessions=30))
    assert first.requests == second.requests
    assert first.requests != generate_agent_trace(AgentTraceConfig(seed=4, num_sessions=30)).requests
    config = SimulationConfig(num_replicas=4, capacity_blocks=200, seed=5, check_integrity=True)
    policies = ["power_of_two", "kv_aware", "least_loaded"]
    runs = [[r.metrics() for r in compare_policies(trace, policies, config)] for trace in (first, second)]
    assert runs[0] == runs[1]


def test_agent_sessions_grow_and_share_system_prompts():
    config = AgentTraceConfig(seed=1, num_sessions=12)
    trace = generate_agent_trace(config)
    by_session: dict[int, list[TraceRequest]] = {}
    for request in trace.requests:
        assert len(request.hash_ids) == math.ceil(request.input_length / config.block_size)
        by_session.setdefault(request.session_id, []).append(request)
    for turns in by_session.values():
        for earlier, later in zip(turns, turns[1:]):
            assert later.arrival_time - earlier.arrival_time >= config.turn_gap_seconds
            num_full = earlier.input_length // config.block_size
            assert later.hash_ids[:num_full] == earlier.hash_ids[:num_full]  # the whole history is resent
    firsts = [turns[0].hash_ids[0] for turns in by_session.values()]
    assert len(set(firsts)) <= config.num_system_prompts < len(firsts)


# ---------------------------------------------------------------- Mooncake files
def test_mooncake_loader_reads_the_first_lines():
    trace = load_mooncake(CONVERSATION, limit=200)
    assert len(trace) == 200 and trace.block_size == 512 and trace.name == "conversation"
    first = trace.requests[0]
    assert (first.arrival_time, first.input_length, first.output_length) == (0.0, 6758, 500)
    assert first.hash_ids == list(range(14))
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in trace.requests)
    assert [r.arrival_time for r in trace.requests] == sorted(r.arrival_time for r in trace.requests)


def test_infinite_cache_bound_of_the_conversation_trace_is_37_percent():
    trace = load_trace("conversation")
    assert len(trace) == 12031 and trace.name == "conversation"
    assert infinite_cache_bound(trace, prepare_routes(trace)).hit_rate == pytest.approx(0.373, abs=0.002)


def test_built_in_traces_by_name():
    synthetic = load_trace("synthetic")
    assert len(synthetic) == 3993 and synthetic.name == "synthetic"
    assert infinite_cache_bound(synthetic).hit_rate == pytest.approx(0.650, abs=0.002)
    agent = load_trace("agent", limit=30, seed=2)
    assert len(agent) == 30 and agent.requests == generate_agent_trace(AgentTraceConfig(seed=2)).requests[:30]
    assert (TRACE_DIR / "README.md").read_text().count("Apache") >= 1


ROW = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'


def test_plain_and_gzip_files_read_alike_whatever_their_name(tmp_path):
    rows = ROW + ROW.replace('"timestamp": 0', '"timestamp": 5')
    (tmp_path / "plain.jsonl").write_text(rows)
    (tmp_path / "packed.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    (tmp_path / "misnamed.jsonl").write_bytes(gzip.compress(rows.encode()))  # read by its magic bytes
    traces = [load_trace(str(tmp_path / name)) for name in ("plain.jsonl", "packed.jsonl.gz", "misnamed.jsonl")]
    assert [t.name for t in traces] == ["plain", "packed", "misnamed"]
    assert traces[0].requests == traces[1].requests == traces[2].requests and len(traces[0]) == 2


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]', "not valid JSON"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', "missing field(s) output_length"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "expected ceil(600/512) = 2"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp must be"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}', "hash_ids must be"),
    ],
)
def test_mooncake_loader_names_file_and_line_of_a_bad_row(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(ROW + line + "\n")
    with pytest.raises(TraceFormatError, match=rf"trace.jsonl:2: .*{message.replace('(', '.').replace(')', '.')}"):
        load_mooncake(path)


def test_missing_trace_file_names_the_built_in_traces(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="nope.jsonl does not exist; pass a Mooncake trace .* conversation, synthetic, agent"
    ):
        load_trace(str(tmp_path / "nope.jsonl"))


def test_a_directory_is_not_a_trace(tmp_path):
    with pytest.raises(IsADirectoryError, match=f"trace {tmp_path} is a directory, not a file"):
        load_trace(str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"\n  \n\n", gzip.compress(b"")])
def test_an_empty_trace_is_an_error_naming_the_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=f"{path}: no requests in this trace"):
        load_trace(str(path))


def test_a_broken_gzip_or_binary_file_is_a_format_error(tmp_path):
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress((ROW * 100).encode())[:40])
    with pytest.raises(TraceFormatError, match="cut.jsonl.gz: not a readable gzip file"):
        load_trace(str(cut))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00 not text\n")
    with pytest.raises(TraceFormatError, match="binary.jsonl:1: not UTF-8 text"):
        load_trace(str(binary))
    with pytest.raises(ValueError, match="--limit"):
        load_trace("agent", limit=0)


# ------------------------------------------------------------------ costs, report, CLI
def test_cost_model_round_trips_and_rejects_unknown_fields(tmp_path):
    path = tmp_path / "costs.json"
    SIMPLE_COST.save(path)
    assert CostModel.load(path) == SIMPLE_COST
    path.write_text('{"prefill_seconds_per_token": 1e-4, "seconds_per_token": 2}')
    with pytest.raises(ValueError, match=r"unknown cost model field\(s\) \['seconds_per_token'\]"):
        CostModel.load(path)
    assert CostModel(
        prefill_seconds_per_token=0.001, attention_seconds_per_token_pair=1e-6, overhead_seconds=0.5
    ).prefill_seconds(1000, 400) == pytest.approx(0.5 + 0.6 + 1e-6 * 420_300)
    with pytest.raises(FileNotFoundError, match="calibrate"):
        CostModel.load(tmp_path / "missing.json")


def test_table_columns_line_up(agent_run):
    _, results = agent_run
    lines = format_table(list(results.values())).splitlines()
    assert lines[0].split()[:3] == ["policy", "hit", "rate"]
    assert len({len(line) for line in lines}) == 1
    assert lines[-1].startswith(BOUND_NAME) and lines[-1].rstrip().endswith("-")
    body = results_to_json(list(results.values()))
    assert body[BOUND_NAME]["ttft_p50_s"] is None and 0 < body["kv_aware"]["hit_rate"] < 1


def test_cli_writes_json_and_plots_and_prints_every_path(tmp_path, capsys):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    code = main(
        [
            "simulate",
            "--trace",
            "agent",
            "--limit",
            "300",
            "--replicas",
            "4",
            "--policies",
            "kv_aware,round_robin",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
            "--sweep",
            "capacity",
            "--sweep-capacities",
            "50,400",
            "--no-progress",
        ]
    )
    assert code == 0
    body = json.loads(out_json.read_text())
    assert list(body) == ["kv_aware", "round_robin", BOUND_NAME]
    assert set(body["kv_aware"]) >= {"hit_rate", "prefill_tokens", "load_imbalance", "ttft_p99_s", "queue_p50_s"}
    sweep_png = tmp_path / "out_sweep.png"
    for png in (out_png, sweep_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "capacity 50:" in out
    written = [line.removeprefix("wrote ") for line in out.splitlines() if line.startswith("wrote ")]
    assert written == [str(out_json), str(out_png), str(sweep_png)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "out.png", "out_sweep.png"]


def test_cli_default_plot_lands_in_the_working_directory_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--trace", "agent", "--limit", "50", "--policies", "kv_aware"]) == 0
    captured = capsys.readouterr()
    written = [line.removeprefix("wrote ") for line in captured.out.splitlines() if line.startswith("wrote ")]
    assert written == [str(tmp_path / "simulate_policies.png")]
    assert [p.name for p in tmp_path.iterdir()] == ["simulate_policies.png"]  # nothing written unannounced
    # progress was on, but stderr is no terminal here: no bar, no redraws
    assert "\r" not in captured.err and "req/s" not in captured.err and "it/s" not in captured.err

    (tmp_path / "simulate_policies.png").unlink()
    assert main(["simulate", "--trace", "agent", "--limit", "50", "--policies", "kv_aware", "--no-plot"]) == 0
    assert "wrote" not in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_cli_replays_a_built_in_trace_by_name(capsys):
    assert (
        main(
            [
                "simulate",
                "--trace",
                "conversation",
                "--limit",
                "100",
                "--replicas",
                "2",
                "--policies",
                "kv_aware",
                "--no-plot",
                "--no-progress",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("conversation: 100 requests")


def test_cli_reports_user_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default --plot would land here
    assert main(["simulate", "--trace", "agent", "--policies", "kv_aware,fastest"]) == 2
    assert "unknown routing policy 'fastest'; choose one of round_robin" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl does not exist; pass a Mooncake trace" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path)]) == 2
    assert f"trace {tmp_path} is a directory, not a file" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["simulate", "--trace", str(tmp_path / "empty.jsonl"), "--no-plot"]) == 2
    assert f"{tmp_path / 'empty.jsonl'}: no requests in this trace" in capsys.readouterr().err
    assert main(["simulate", "--trace", "agent", "--json", str(tmp_path / "no" / "out.json")]) == 2
    assert f"--json {tmp_path / 'no' / 'out.json'}: folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    assert main(["simulate", "--trace", "agent", "--plot", str(tmp_path)]) == 2
    assert f"--plot {tmp_path}: is a directory" in capsys.readouterr().err
    assert main(["simulate", "--trace", "agent", "--limit", "0"]) == 2
    assert "--limit) must be at least 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [tmp_path / "empty.jsonl"]  # no error left a file behind


def test_cli_needs_a_trace_unless_calibrating(capsys):
    assert main(["simulate"]) == 2
    assert (
        "--trace NAME|FILE is required unless --calibrate is given (built-in traces: conversation"
        in capsys.readouterr().err
    )


def test_calibrate_writes_a_cost_model_the_simulator_loads(tmp_path, default_model_dir, capsys, caplog):
    caplog.set_level(logging.INFO, logger="prefixserve.calibrate")
    path = tmp_path / "costs.json"
    assert main(["simulate", "--calibrate", str(path)]) == 0
    cost = CostModel.load(path)
    assert cost.prefill_seconds_per_token > 0 and cost.decode_seconds_per_token > 0
    assert cost.description.startswith("calibrated: prefixserve-tiny")
    assert cost.description.endswith("; host and disk reads measured, remote stated")
    # the tiers were timed on this machine with the built-in model's records, the remote keeps its stated cost
    assert 0 < cost.kv_bytes_per_token < CostModel().kv_bytes_per_token
    assert (cost.host_bytes_per_second, cost.disk_bytes_per_second) != (
        CostModel().host_bytes_per_second,
        CostModel().disk_bytes_per_second,
    )
    assert cost.remote_bytes_per_second == CostModel().remote_bytes_per_second
    assert capsys.readouterr().out.startswith(f"wrote {path}: ")
    steps = [record.getMessage() for record in caplog.records if record.name == "prefixserve.calibrate"]
    assert steps[0] == "calibrating (1/6): loading the model ..." and len(steps) == 6  # not a terminal: lines
