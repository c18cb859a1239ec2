"""benchmarks/noisy_neighbour.py, small, end to end: it prints its table and writes what it says, and the shares
keep more of A's hits than plain LRU does (hit rates: deterministic, whatever the machine's speed)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "noisy_neighbour.py"


def test_a_small_run_prints_its_table_and_the_shares_keep_as_hits(tmp_path, default_model_dir):
    options = ["--runs", "1", "--a-requests", "12", "--pool-blocks", "96", "--documents", "3"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *options, "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "A + B, shares on" in done.stdout and "vs A alone" in done.stdout
    assert (tmp_path / "noisy_neighbour.png").stat().st_size > 0
    medians = json.loads((tmp_path / "noisy_neighbour.json").read_text())["medians"]
    assert medians["A + B, shares on"] > medians["A + B, no shares"]
    assert medians["A alone"] >= medians["A + B, shares on"]
