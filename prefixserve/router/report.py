"""The simulator's report: an aligned table, JSON, and PNG plots of policies and of a capacity sweep."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from .simulate import SimulationResult


BOUND_NAME = "infinite_cache_bound"  # the row of one infinite shared cache: what no routing can beat
_COLUMNS = ("policy", "hit rate", "prefill tokens", "imbalance", "queue p50", "queue p99", "TTFT p50", "TTFT p99")


def format_table(results: Sequence[SimulationResult]) -> str:
    def seconds(value: float) -> str:
        return "-" if math.isnan(value) else f"{value:.3f} s"

    rows = [_COLUMNS] + [
        (r.policy, f"{r.hit_rate:.1%}", f"{r.num_prefill_tokens:,}",
         "-" if math.isnan(r.load_imbalance) else f"{r.load_imbalance:.2f}",
         seconds(r.queue_p50), seconds(r.queue_p99), seconds(r.ttft_p50), seconds(r.ttft_p99))
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def results_to_json(results: Sequence[SimulationResult]) -> dict[str, dict[str, Optional[float]]]:
    return {r.policy: r.metrics() for r in results}


def plot_policies(results: Sequence[SimulationResult], path: str | Path, title: str = "") -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg renders the PNG

    policies = [r for r in results if r.policy != BOUND_NAME]
    bound = next((r for r in results if r.policy == BOUND_NAME), None)
    names = [r.policy for r in policies]
    figure = Figure(figsize=(12, 8), layout="constrained")
    axes = figure.subplots(2, 2)
    panels = [
        (axes[0][0], [r.hit_rate * 100 for r in policies], "token hit rate (%)"),
        (axes[0][1], [r.num_prefill_tokens / 1e6 for r in policies], "prefill tokens computed (millions)"),
        (axes[1][0], [r.load_imbalance for r in policies], "load imbalance (max / mean busy time)"),
    ]
    for axis, values, label in panels:
        axis.bar(names, values, color="tab:blue")
        axis.set_ylabel(label)
        axis.tick_params(axis="x", rotation=20)
    if bound is not None:
        axes[0][0].axhline(bound.hit_rate * 100, color="black", linestyle="--", label="infinite shared cache")
        axes[0][0].legend()
    axis = axes[1][1]
    positions = range(len(names))
    axis.bar([p - 0.2 for p in positions], [r.ttft_p50 for r in policies], 0.4, label="TTFT p50")
    axis.bar([p + 0.2 for p in positions], [r.ttft_p99 for r in policies], 0.4, label="TTFT p99")
    axis.set_xticks(list(positions), names, rotation=20)
    axis.set_ylabel("seconds")
    axis.legend()
    figure.suptitle(title or "routing policies")
    figure.savefig(path, dpi=110)


def plot_capacity_sweep(sweep: dict[int, list[SimulationResult]], path: str | Path, title: str = "") -> None:
    from matplotlib.figure import Figure

    capacities = sorted(sweep)
    figure = Figure(figsize=(8, 5), layout="constrained")
    axis = figure.subplots()
    for name in [r.policy for r in sweep[capacities[0]]]:
        rates = [next(r for r in sweep[c] if r.policy == name).hit_rate * 100 for c in capacities]
        style = {"color": "black", "linestyle": "--"} if name == BOUND_NAME else {"marker": "o"}
        axis.plot(capacities, rates, label=name, **style)
    axis.set_xscale("log")
    axis.set_xlabel("cache capacity per replica (blocks)")
    axis.set_ylabel("token hit rate (%)")
    axis.legend()
    figure.suptitle(title or "hit rate vs cache size")
    figure.savefig(path, dpi=110)

