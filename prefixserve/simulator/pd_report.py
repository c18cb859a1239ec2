"""The prefill/decode replay's report: a table of whole and split fleets, the comparison, and a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .report import _align, _seconds

if TYPE_CHECKING:
    from .pd_replay import StepResult


def format_pd_table(results: Sequence[StepResult]) -> str:
    rows = [
        (
            "fleet",
            "hit rate",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "TPOT p99",
            "prefill wait p99",
            "decode wait p99",
            "KV moved/request",
        )
    ]
    for r in results:
        rows.append(
            (
                r.name,
                f"{r.hit_rate:.1%}",
                *(
                    _seconds(r.percentile(name, q))
                    for name, q in (
                        ("ttft", 50),
                        ("ttft", 99),
                        ("tpot", 50),
                        ("tpot", 99),
                        ("prefill_wait", 99),
                        ("decode_wait", 99),
                    )
                ),
                f"{r.moved_bytes_per_request / 1e9:.2f} GB",
            )
        )
    return _align(rows)


def compare_line(whole: StepResult, split: StepResult) -> str:
    """How a split fleet does against the whole one: TPOT p99 x better, TTFT p50 x (above 1: worse)."""
    tpot = whole.percentile("tpot", 99) / split.percentile("tpot", 99)
    ttft = split.percentile("ttft", 50) / whole.percentile("ttft", 50)
    return f"{split.name} against {whole.name}: TPOT p99 {tpot:.2f}x better, TTFT p50 {ttft:.2f}x"


def plot_pd(results: Sequence[StepResult], path: str | Path, title: str = "") -> None:
    """TTFT and TPOT percentiles of each fleet, side by side."""
    from matplotlib.figure import Figure

    names = [r.name for r in results]
    positions = range(len(names))
    figure = Figure(figsize=(12, 5), layout="constrained")
    axes = figure.subplots(1, 2)
    for axis, metric, label in ((axes[0], "ttft", "TTFT (s)"), (axes[1], "tpot", "TPOT (s)")):
        for offset, q in ((-0.2, 50), (0.2, 99)):
            axis.bar([p + offset for p in positions], [r.percentile(metric, q) for r in results], 0.4, label=f"p{q}")
        axis.set_xticks(list(positions), names, rotation=20)
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle(title or "whole and disaggregated fleets")
    figure.savefig(path, dpi=110)
