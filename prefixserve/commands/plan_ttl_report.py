"""The report of `prefixserve plan ttl`: the table and recommendation it prints, the JSON it writes and the
plot of hit rate and cost against TTL, with the duration and size formats they share."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ..plan.ttl import GIB, TTLPlan


def format_plan(plan: TTLPlan, description: str, inputs: dict[str, str]) -> list[str]:
    """The table; `inputs` says where each of the plan's numbers came from (given, measured, stated)."""
    cost = plan.cost
    lines = [
        f"TTL plan from {description}",
        f"  {plan.num_releases:,.0f} prefix releases; {plan.return_fraction:.1%} of them came back at all "
        f"(the rest were never reused in the window)",
        f"  a returning turn reuses {plan.prefix_tokens:,.0f} prefix tokens ({inputs['prefix_tokens']})",
        f"  a miss re-prefills them at {plan.prefill_seconds_per_token * 1e3:.3g} ms a token "
        f"({inputs['prefill_seconds_per_token']})",
        f"  KV {plan.kv_bytes_per_token / 1024:,.4g} KiB a token ({inputs['kv_bytes_per_token']}); "
        f"{plan.releases_per_second:.3g} releases/s ({inputs['releases_per_second']})",
        f"  cost, USD an hour = GiB held x {cost.memory_usd_per_gib_hour:.4g} + GPU hours re-prefilling x "
        f"{cost.gpu_usd_per_hour:.4g} + user seconds waiting x {cost.waiting_usd_per_second:.4g}",
        "  (hit rate, miss tokens and extra TTFT are per returning turn; memory by Little's law, an upper bound "
        "where sessions share a prefix)",
        "",
        f"{'TTL':>8} {'hit rate':>9} {'miss tokens':>12} {'extra TTFT':>11} {'memory held':>12} "
        f"{'memory $/h':>11} {'recompute $/h':>14} {'waiting $/h':>12} {'total $/h':>10}",
    ]
    for row in plan.rows:
        mark = "*" if row.ttl_seconds > plan.range_end else " "
        chosen = "  <- recommended" if row is plan.recommended else ""
        lines.append(
            f"{_duration(row.ttl_seconds):>7}{mark} {row.hit_rate:>9.1%} {row.miss_tokens_per_turn:>12,.0f} "
            f"{_seconds(row.extra_ttft_seconds_per_turn):>11} {_gib(row.memory_bytes):>12} "
            f"{row.memory_usd_per_hour:>11,.4g} {row.recompute_usd_per_hour:>14,.4g} "
            f"{row.waiting_usd_per_hour:>12,.4g} {row.cost_usd_per_hour:>10,.4g}{chosen}"
        )
    best = plan.recommended
    in_seconds = "" if _duration(best.ttl_seconds).endswith(" s") else f" ({best.ttl_seconds:g} s)"
    lines += [
        "",
        f"recommended TTL: {_duration(best.ttl_seconds)}{in_seconds}: {best.hit_rate:.1%} of returning "
        f"turns hit, {_gib(best.memory_bytes)} held, {best.cost_usd_per_hour:,.4g} USD an hour",
    ]
    if len(plan.rows) > 1 and best is plan.rows[0]:
        lines.append("  the shortest candidate: a shorter TTL (or none) may be cheaper still; add shorter --ttls")
    if len(plan.rows) > 1 and best is plan.rows[-1]:
        lines.append("  the longest candidate: a longer TTL may be cheaper still; add longer --ttls")
    if any(row.ttl_seconds > plan.range_end for row in plan.rows):
        lines.append(
            f"  * beyond the histogram's last bound ({_duration(plan.range_end)}): its overflow gaps count "
            f"as misses, so the hit rate there is a lower bound"
        )
    return lines


def plan_json(plan: TTLPlan, description: str, inputs: dict[str, str]) -> dict:
    return {
        "source": description,
        "input_sources": inputs,
        "num_releases": plan.num_releases,
        "return_fraction": plan.return_fraction,
        "prefix_tokens": plan.prefix_tokens,
        "prefill_seconds_per_token": plan.prefill_seconds_per_token,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "releases_per_second": plan.releases_per_second,
        "cost_model": dataclasses.asdict(plan.cost),
        "histogram_range_end_seconds": None if math.isinf(plan.range_end) else plan.range_end,
        "rows": [row._asdict() for row in plan.rows],
        "recommended_ttl_seconds": plan.recommended.ttl_seconds,
    }


def plot_plan(plan: TTLPlan, path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg renders the PNG

    ttls = [row.ttl_seconds for row in plan.rows]
    log_costs = min(row.cost_usd_per_hour for row in plan.rows) > 0  # memory grows over orders of magnitude
    figure = Figure(figsize=(9, 7), layout="constrained")
    hits, costs = figure.subplots(2, 1, sharex=True)
    hits.plot(ttls, [row.hit_rate * 100 for row in plan.rows], marker="o", label="returning turns that hit")
    hits.plot(
        ttls, [row.survival * 100 for row in plan.rows], marker=".", linestyle=":", label="survival (all releases)"
    )
    hits.set_ylabel("%")
    hits.set_ylim(0, 100)
    hits.legend()
    for label, values in (
        ("memory", [row.memory_usd_per_hour for row in plan.rows]),
        ("recompute", [row.recompute_usd_per_hour for row in plan.rows]),
        ("waiting", [row.waiting_usd_per_hour for row in plan.rows]),
        ("total", [row.cost_usd_per_hour for row in plan.rows]),
    ):
        if any(values):
            values = [value if value > 0 or not log_costs else math.nan for value in values]  # a log axis has no 0
            costs.plot(ttls, values, marker="o", label=label, **({"color": "black"} if label == "total" else {}))
    costs.set_ylabel("USD an hour")
    costs.set_xlabel("TTL (seconds)")
    costs.set_xscale("log")
    if log_costs:
        costs.set_yscale("log")
    for axis in (hits, costs):
        axis.axvline(
            plan.recommended.ttl_seconds,
            color="tab:red",
            linestyle="--",
            label=f"recommended: {_duration(plan.recommended.ttl_seconds)}" if axis is costs else None,
        )
    costs.legend()
    figure.suptitle(f"TTL plan: {title}")
    figure.savefig(path, dpi=110)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and (seconds % size == 0 or seconds >= 10 * size):
            return f"{seconds / size:g} {unit}" if seconds % size == 0 else f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def _gib(num_bytes: float) -> str:
    gib = num_bytes / GIB
    return f"{gib / 1024:,.3g} TiB" if gib >= 1024 else f"{gib:.3g} GiB"


def _seconds(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"
