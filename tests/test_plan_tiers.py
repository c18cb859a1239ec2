"""`prefixserve plan tiers`: the crossover computation on given inputs (exact), and the command line with the
prefill cost given (tier reads are timed for real; the model is only its config)."""

import argparse
import json
import math

import pytest

from prefixserve.cli import build_parser, main
from prefixserve.plan.tiers import (
    GPU_PROFILE_NAME,
    LITERATURE_SOURCE,
    Profile,
    crossovers,
    fit_read_cost,
    format_report,
    gpu_profile,
    kv_bytes_per_token,
    report_json,
    smallest_fetched_run,
    to_reach,
)
from prefixserve.tiers import TierCost, plan_fetch

# Dyadic numbers, so every sum below is exact in floating point:
# 512 bytes per token read at 2**20 B/s = 2**-11 s, prefill 2**-9 s: a margin of 3 * 2**-11 s per token.
BLOCK_SIZE = 16
BYTES_PER_TOKEN = 512
PREFILL = 2.0**-9
BANDWIDTH = 2.0**20
MARGIN = 3 * 2.0**-11


def profile(latency: float, bandwidth: float = BANDWIDTH, prefill: float = PREFILL) -> Profile:
    return Profile("given", BLOCK_SIZE, BYTES_PER_TOKEN * BLOCK_SIZE, prefill, {"disk": TierCost(latency, bandwidth)})


# --------------------------------------------------------------------------- computation
def test_kv_bytes_per_token_of_the_built_in_model_and_of_llama_3_8b():
    assert kv_bytes_per_token(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float32") == 16_384
    assert kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16") == 128 * 1024
    with pytest.raises(ValueError, match="int8"):
        kv_bytes_per_token(1, 1, 2, "int8")


def test_crossover_row_on_given_inputs():
    latency = 48 * MARGIN  # crossover at exactly 48 tokens
    (row,) = crossovers(profile(latency))
    assert row.tier == "disk"
    assert row.fetch_seconds_per_token == 2.0**-11
    assert row.break_even_bytes_per_second == BYTES_PER_TOKEN / PREFILL == 2.0**18
    assert row.crossover_tokens == 48.0
    # 3 blocks (48 tokens) cost exactly as much to fetch as to compute, and the planner needs a saving: 4 blocks.
    assert row.crossover_blocks == 4
    assert row.prefix_fetch_seconds == latency + 2000 * 2.0**-11
    assert row.prefix_recompute_seconds == 2000 * PREFILL


def test_smallest_fetched_run_agrees_with_the_engine_planner():
    for latency in (0.0, 1e-6, 0.01, 0.05, 0.2, 48 * MARGIN):
        given = profile(latency)
        smallest = smallest_fetched_run(given, "disk")

        def fetched(num_blocks, given=given):
            return plan_fetch(
                [("disk", num_blocks)], given.block_bytes, PREFILL, BLOCK_SIZE, given.read_costs
            ).num_fetch_blocks

        assert fetched(smallest) == smallest
        assert smallest == 1 or fetched(smallest - 1) == 0


def test_no_crossover_when_a_token_is_no_cheaper_to_read_than_to_compute():
    (at_break_even,) = crossovers(profile(0.001, bandwidth=2.0**18))
    (slower,) = crossovers(profile(0.0, bandwidth=2.0**17))
    for row in (at_break_even, slower):
        assert math.isinf(row.crossover_tokens) and row.crossover_blocks is None


def test_fit_read_cost_recovers_latency_and_bandwidth():
    samples = [(num_bytes, 1e-4 + num_bytes / 1e9) for num_bytes in (1e6, 2e6, 4e6, 8e6)]
    cost = fit_read_cost(samples)
    assert cost.latency_seconds == pytest.approx(1e-4)
    assert cost.bytes_per_second == pytest.approx(1e9)


def test_fit_read_cost_leans_to_a_dearer_fetch_on_noise():
    through_origin = fit_read_cost([(1000, 1e-6), (2000, 4e-6)])  # the line would cross below zero
    assert through_origin.latency_seconds == 0.0
    assert through_origin.bytes_per_second == pytest.approx((1000**2 + 2000**2) / (1000 * 1e-6 + 2000 * 4e-6))
    flat = fit_read_cost([(1000, 2e-6), (2000, 1e-6)])  # larger read faster: nothing to learn a slope from
    assert flat.latency_seconds == pytest.approx(1.5e-6)
    assert flat.bytes_per_second == pytest.approx(2000 / 1e-6)
    with pytest.raises(ValueError, match="two sizes"):
        fit_read_cost([(1000, 1e-6), (1000, 2e-6)])
    with pytest.raises(ValueError, match="positive"):
        fit_read_cost([(1000, 0.0), (2000, 1e-6)])


def test_the_stated_gpu_profile():
    gpu = gpu_profile()
    assert gpu.block_bytes == 16 * 128 * 1024
    assert gpu.prefill_seconds_per_token == 1 / 12_000
    host, disk = crossovers(gpu)
    per_token = 128 * 1024
    assert host.crossover_tokens == pytest.approx(10e-6 / (1 / 12_000 - per_token / 20e9))
    assert disk.crossover_tokens == pytest.approx(100e-6 / (1 / 12_000 - per_token / 3e9))
    assert (host.crossover_blocks, disk.crossover_blocks) == (1, 1)
    assert disk.break_even_bytes_per_second == pytest.approx(per_token * 12_000)


def test_to_reach_solves_for_latency_and_for_bandwidth():
    gpu = gpu_profile()
    match = to_reach(gpu, "disk", 1900)
    assert match.latency_seconds == pytest.approx(1900 * (1 / 12_000 - 128 * 1024 / 3e9))
    for cost in (TierCost(match.latency_seconds, 3e9), TierCost(100e-6, match.bytes_per_second)):
        solved = Profile("solved", gpu.block_size, gpu.block_bytes, gpu.prefill_seconds_per_token, {"disk": cost})
        assert crossovers(solved)[0].crossover_tokens == pytest.approx(1900)


def test_report_names_the_literature_and_is_json_safe():
    gpu = gpu_profile()
    never = profile(0.0, bandwidth=2.0**17)
    lines = format_report([never, gpu], gpu)
    text = "\n".join(lines)
    assert LITERATURE_SOURCE in text and "~1,900" in text and GPU_PROFILE_NAME in text
    assert "never" in text
    data = json.loads(json.dumps(report_json([never, gpu], gpu), allow_nan=False))
    assert data["profiles"][0]["crossovers"][0]["crossover_tokens"] is None
    assert data["literature"]["nvme_crossover_tokens"] == 1900
    assert data["reference"]["to_reach_literature"]["tokens"] == 1900


# --------------------------------------------------------------------------- command line
def plan_tiers_parser() -> argparse.ArgumentParser:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    (actions,) = [a for a in commands.choices["plan"]._actions if isinstance(a, argparse._SubParsersAction)]
    return actions.choices["tiers"]


def test_every_plan_tiers_flag_has_help_and_a_stated_default():
    parser = plan_tiers_parser()
    rendered = " ".join(parser.format_help().split())
    for action in parser._actions:
        assert action.help, f"{action.option_strings[0]} has no help"
        if action.option_strings[0] not in ("-h", "--no-progress"):
            assert "default" in action.help or f"(default: {action.default})" in rendered, action.option_strings


def test_plan_tiers_prints_and_writes_the_report(tmp_path, capsys):
    path = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "tiers",
            "--dtype",
            "float32",
            "--prefill-seconds-per-token",
            "0.001",
            "--disk-dir",
            str(tmp_path),
            "--json",
            str(path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "this machine: prefixserve-tiny, float32 (measured)" in out
    assert GPU_PROFILE_NAME in out and "~1,900" in out
    assert f"wrote {path}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # the timing folder is gone
    data = json.loads(path.read_text())
    measured, priors, gpu = data["profiles"]
    assert measured["block_bytes"] == 16 * 16_384 and measured["prefill_seconds_per_token"] == 0.001
    assert [row["tier"] for row in measured["crossovers"]] == ["host", "disk"]
    for row in measured["crossovers"]:
        assert row["bytes_per_second"] > 0 and row["latency_seconds"] >= 0
        # a CPU engine's prefill is slow: any measured read of this machine wins from the first block
        assert row["crossover_blocks"] == 1
    assert gpu["crossovers"][1]["crossover_tokens"] == pytest.approx(crossovers(gpu_profile())[1].crossover_tokens)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prefill-seconds-per-token", "0"], "must be positive seconds"),
        (["--prefill-seconds-per-token", "1", "--disk-dir", "/no/such/folder"], "not a folder"),
        (["--prefill-seconds-per-token", "1", "--block-size", "3"], "block_size must be a power of two"),
        (["--prefill-seconds-per-token", "1", "--model", "/no/such/model"], "does not exist"),
    ],
)
def test_plan_tiers_names_what_is_wrong(argv, message, capsys):
    assert main(["plan", "tiers", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_tiers_flags_cannot_be_abbreviated(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "tiers", "--prefill", "1"])
    assert "unrecognized arguments: --prefill" in capsys.readouterr().err


# --------------------------------------------------------------------------- the remote tier, timed
@pytest.fixture
def short_timing(monkeypatch):
    """Runs of 1 and 8 blocks, read twice: what the remote tests check is the wiring, not the figures."""
    from prefixserve.commands import tier_reads

    monkeypatch.setattr(tier_reads, "READ_SIZES_BLOCKS", (1, 8))
    monkeypatch.setattr(tier_reads, "READ_REPEATS", 2)


def test_plan_tiers_times_a_redis_with_sealed_records_and_leaves_nothing_there(
    tmp_path, capsys, redis_server, tier_secret_file, short_timing
):
    path = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "tiers",
            "--dtype",
            "float32",
            "--prefill-seconds-per-token",
            "0.001",
            "--disk-dir",
            str(tmp_path),
            "--kv-remote-url",
            redis_server.url,
            "--kv-tier-secret-file",
            tier_secret_file,
            "--json",
            str(path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "records sealed and verified" in out
    measured = json.loads(path.read_text())["profiles"][0]
    assert [row["tier"] for row in measured["crossovers"]] == ["host", "disk", "remote"]
    remote = measured["crossovers"][2]
    assert remote["bytes_per_second"] > 0 and remote["latency_seconds"] >= 0
    assert redis_server.num_keys() == 0  # the timed records were deleted


def test_calibrate_writes_the_remote_tier_it_timed(redis_server, short_timing):
    from prefixserve.commands.simulate import _measure_tiers

    measured = _measure_tiers(redis_server.url, None)
    assert measured["remote_bytes_per_second"] > 0 and measured["remote_latency_seconds"] >= 0
    assert set(measured) >= {"host_bytes_per_second", "disk_bytes_per_second", "kv_bytes_per_token"}
    assert redis_server.num_keys() == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["plan", "tiers", "--prefill-seconds-per-token", "1", "--kv-remote-url", "redis://127.0.0.1:{port}"],
            "the timed records could not be written (is Redis up",
        ),
        (
            ["plan", "tiers", "--prefill-seconds-per-token", "1", "--kv-tier-secret-file", "{secret}"],
            "give --kv-remote-url too",
        ),
        (
            ["simulate", "--trace", "agent", "--kv-remote-url", "redis://127.0.0.1:{port}"],
            "time a Redis for --calibrate; a replay takes the remote tier's cost from --costs",
        ),
    ],
)
def test_a_remote_tier_that_cannot_be_timed_is_named(argv, message, capsys, tier_secret_file):
    from redis_helpers import free_port

    argv = [arg.format(port=free_port(), secret=tier_secret_file) for arg in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
