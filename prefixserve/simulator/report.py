"""The simulator's report: aligned tables, JSON, and PNG plots of policies, a remote tier's lift and the sweeps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from .replay import SimulationResult


BOUND_NAME = "infinite_cache_bound"  # the row of one infinite shared cache: what no routing can beat
_COLUMNS = ("policy", "hit rate", "prefill tokens", "imbalance", "queue p50", "queue p99", "TTFT p50", "TTFT p99")


def _seconds(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f} s"


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def _align(rows: list[tuple[str, ...]], num_left: int = 1) -> str:
    """The first `num_left` columns left-aligned, the rest right-aligned, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i < num_left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(results: Sequence[SimulationResult]) -> str:
    """One row per result; with tiers below the pool, the hit rate split by where the hits came from."""
    tiers = [
        tier for tier in ("device", "host", "disk", "remote") if any(tier in r.num_hit_tokens_by_tier for r in results)
    ]
    tiers = tiers if tiers != ["device"] else []  # the pool alone: the hit rate says it all
    header = (_COLUMNS[0], _COLUMNS[1], *(f"{tier} hits" for tier in tiers), *_COLUMNS[2:])
    rows = [header] + [
        (
            r.policy,
            f"{r.hit_rate:.1%}",
            *(_percent(r.tier_hit_rate(tier)) for tier in tiers),
            f"{r.num_prefill_tokens:,}",
            "-" if math.isnan(r.load_imbalance) else f"{r.load_imbalance:.2f}",
            _seconds(r.queue_p50),
            _seconds(r.queue_p99),
            _seconds(r.ttft_p50),
            _seconds(r.ttft_p99),
        )
        for r in results
    ]
    return _align(rows)


def format_load_sweep(sweep: dict[float, list[SimulationResult]]) -> str:
    """Hit rate, TTFT and imbalance per policy at each load (the bound's hit rate on every load's first row)."""
    rows = [("load", "requests", "policy", "hit rate", "TTFT p50", "TTFT p99", "imbalance")]
    for load, results in sweep.items():
        for i, r in enumerate(results):
            rows.append(
                (
                    f"x{load:g}" if i == 0 else "",
                    f"{r.num_requests:,}" if i == 0 else "",
                    r.policy,
                    f"{r.hit_rate:.1%}",
                    _seconds(r.ttft_p50),
                    _seconds(r.ttft_p99),
                    "-" if math.isnan(r.load_imbalance) else f"{r.load_imbalance:.2f}",
                )
            )
    return _align(rows, num_left=3)


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


def plot_tier_lift(
    local: Sequence[SimulationResult],
    tiered: Sequence[SimulationResult],
    path: str | Path,
    title: str = "",
    tiered_label: str = "with the remote tier",
) -> None:
    """Each policy without and with the tiers: hit rate against the infinite-cache bound, TTFT p50 and p99."""
    from matplotlib.figure import Figure

    names = [r.policy for r in local if r.policy != BOUND_NAME]
    by_name = [{r.policy: r for r in results} for results in (local, tiered)]
    bound = by_name[0].get(BOUND_NAME)
    figure = Figure(figsize=(14, 5), layout="constrained")
    axes = figure.subplots(1, 3)
    positions = range(len(names))
    panels = [
        (axes[0], lambda r: r.hit_rate * 100, "token hit rate (%)"),
        (axes[1], lambda r: r.ttft_p50, "TTFT p50 (s)"),
        (axes[2], lambda r: r.ttft_p99, "TTFT p99 (s)"),
    ]
    for axis, value, label in panels:
        for offset, results, run_label in ((-0.2, by_name[0], "local only"), (0.2, by_name[1], tiered_label)):
            axis.bar([p + offset for p in positions], [value(results[name]) for name in names], 0.4, label=run_label)
        axis.set_xticks(list(positions), names, rotation=20)
        axis.set_ylabel(label)
    if bound is not None:
        axes[0].axhline(bound.hit_rate * 100, color="black", linestyle="--", label="infinite shared cache")
    axes[0].legend()
    figure.suptitle(title or "the lift of a shared remote tier")
    figure.savefig(path, dpi=110)


def plot_load_sweep(sweep: dict[float, list[SimulationResult]], path: str | Path, title: str = "") -> None:
    """Hit rate and TTFT p99 against load, one line per policy."""
    from matplotlib.figure import Figure

    loads = sorted(sweep)
    figure = Figure(figsize=(12, 5), layout="constrained")
    axes = figure.subplots(1, 2)
    for name in [r.policy for r in sweep[loads[0]]]:
        rows = [next(r for r in sweep[load] if r.policy == name) for load in loads]
        style = {"color": "black", "linestyle": "--"} if name == BOUND_NAME else {"marker": "o"}
        axes[0].plot(loads, [r.hit_rate * 100 for r in rows], label=name, **style)
        if name != BOUND_NAME:
            axes[1].plot(loads, [r.ttft_p99 for r in rows], label=name, **style)
    axes[0].set_ylabel("token hit rate (%)")
    axes[1].set_ylabel("TTFT p99 (s)")
    axes[1].set_yscale("log")
    for axis in axes:
        axis.set_xlabel("load (x the default agent trace's sessions and session rate)")
        axis.set_xscale("log", base=2)
        axis.set_xticks(loads, [f"x{load:g}" for load in loads])
        axis.minorticks_off()
        axis.legend()
    figure.suptitle(title or "routing policies across load")
    figure.savefig(path, dpi=110)
