"""benchmarks/tiers.py --quick end to end (seconds): it prints its three tables, writes what it says, and every
prefix comes back from the tier the configuration puts it in, with the tokens unchanged."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tiers.py"
PREFIX = 96  # QUICK.working_prefix
LADDER_PREFIX = 128  # QUICK.ladder_prefix


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, default_model_dir):
    results = tmp_path_factory.mktemp("tiers-results")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--results-dir", str(results)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, results


def test_prints_its_tables_and_every_path_it_writes(quick_run):
    out, results = quick_run
    for heading in ("1. Latency ladder", "2. Working set larger than the pool", "3. TTFT of a 128-token prefix"):
        assert heading in out
    written = sorted(line.removeprefix("wrote ") for line in out.splitlines() if line.startswith("wrote "))
    assert written == [str(results / "tiers_quick.json"), str(results / "tiers_quick.png")]
    assert sorted(path.name for path in results.iterdir()) == ["tiers_quick.json", "tiers_quick.png"]
    assert "\r" not in out  # no progress bar when stdout is not a terminal


def load(results: Path) -> dict:
    return json.loads((results / "tiers_quick.json").read_text())


def test_ladder_serves_the_prefix_from_each_place(quick_run):
    served = load(quick_run[1])["ladder"]["served"]
    zero = {"device": 0, "host": 0, "disk": 0, "remote": 0}
    assert served["miss"] == zero
    for source, tier in (("device", "device"), ("host", "host"), ("disk warm", "disk"), ("disk cold", "disk")):
        assert served[source] == {**zero, tier: LADDER_PREFIX}, source


def pass_two(results: Path, configuration: str) -> list[dict]:
    return load(results)["working_set"]["runs"][configuration]["passes"][1]["completions"]


@pytest.mark.parametrize("configuration, tier", [("host only (holds all 4)", "host"), ("disk only", "disk")])
def test_working_set_second_pass_comes_from_the_tier(quick_run, configuration, tier):
    completions = pass_two(quick_run[1], configuration)
    assert [c["by_tier"][tier] for c in completions] == [PREFIX] * 4
    reference = pass_two(quick_run[1], "tiers off")
    assert [c["num_cached_tokens"] for c in reference] == [0] * 4
    assert [c["output_token_ids"] for c in completions] == [c["output_token_ids"] for c in reference]


def test_working_set_host_and_disk_together_serve_every_prefix(quick_run):
    completions = pass_two(quick_run[1], "host (holds 2) + disk")
    assert [c["by_tier"]["host"] + c["by_tier"]["disk"] for c in completions] == [PREFIX] * 4


def test_restart_serves_the_prefix_from_disk_with_the_same_tokens(quick_run):
    for result in load(quick_run[1])["disk_ttft"]:
        assert result["disk_tokens"] == [LADDER_PREFIX], result["dtype"]
        assert result["records_indexed"] > 0
        if result["dtype"] == "float32":
            assert all(result["same_tokens"])
