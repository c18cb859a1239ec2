"""`prefixserve plan ttl`: read reuse gaps (a server's cache stats, a file, a trace), price candidate TTLs
with plan/ttl.py (pure computation), print the table and the recommendation, optionally plot and write JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import NamedTuple, Optional

from ..plan.tiers import GPU_PREFILL_TOKENS_PER_SECOND, REFERENCE_PREFIX_TOKENS
from ..plan.ttl import (DEFAULT_GPU_USD_PER_HOUR, DEFAULT_MEMORY_USD_PER_GIB_HOUR, DEFAULT_TTLS_SECONDS, GIB,
                        CostModel, GapDistribution, TTLPlan, distribution_from_stats, gaps_from_trace, plan_ttl)
from .paths import output_path
from .server_get import get_from_server

PLAN_TTL_SUMMARY = ("recommend how long to keep a released prefix: per candidate TTL, the chance the next turn "
                    "still finds it, the cold prefill of the misses and the memory held, priced in USD an hour")
STATED_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3-8B in bfloat16, as plan tiers' stated GPU profile
STATED_RELEASES_PER_SECOND = 1.0
STATS_PATH = "/v1/cache/stats"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?\s*$")
_UNIT_SECONDS = {None: 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


class GapSource(NamedTuple):
    distribution: GapDistribution
    description: str
    prefix_tokens: Optional[float] = None  # measured by the source, when it says
    releases_per_second: Optional[float] = None


def add_plan_ttl_arguments(actions, formatter_class: type) -> None:
    """The `ttl` action under `prefixserve plan`; `actions` is plan's subparsers object."""
    ttl = actions.add_parser("ttl", help=PLAN_TTL_SUMMARY, description=PLAN_TTL_SUMMARY, allow_abbrev=False,
                             formatter_class=formatter_class)
    ttl.set_defaults(usage_error=ttl.error)
    source = ttl.add_mutually_exclusive_group(required=True)
    source.add_argument("--gaps", metavar="FILE",
                        help="gap seconds as a JSON list or numbers separated by spaces, commas or lines; or the JSON "
                             "body of a server's GET /v1/cache/stats")
    source.add_argument("--url", metavar="URL", help="a running 'prefixserve serve': fetch its /v1/cache/stats")
    source.add_argument("--trace", metavar="NAME|FILE",
                        help="a Mooncake trace (built in: conversation, synthetic); a gap is the time from a request "
                             "to the next one that starts with its whole prefix")
    ttl.add_argument("--admin-api-key", metavar="KEY", help="the server's admin key, for --url (default: none sent)")
    ttl.add_argument("--tenant", metavar="ID", help="plan from this tenant's gaps in the stats (default: all tenants)")
    ttl.add_argument("--num-never-returned", type=float, metavar="N",
                     help="with a list of gaps: releases whose prefix was never reused in the window (default: 0; "
                          "stats and traces count their own)")
    ttl.add_argument("--ttls", default=",".join(_duration(ttl) for ttl in DEFAULT_TTLS_SECONDS).replace(" ", ""),
                     metavar="LIST", help="candidate TTLs, comma-separated, in seconds or with a unit: 90, 5m, 2h, 1d")
    ttl.add_argument("--prefix-tokens", type=float, metavar="N",
                     help=f"mean prefix a returning turn reuses (default: the stats' or the trace's mean; "
                          f"{REFERENCE_PREFIX_TOKENS:,}, stated, for a list of gaps)")
    ttl.add_argument("--prefill-seconds-per-token", type=float, metavar="SECONDS",
                     help="GPU seconds to prefill one token (default: Llama-3-8B on one H100 at "
                                             f"{GPU_PREFILL_TOKENS_PER_SECOND:,.0f} tokens/s, stated)")
    ttl.add_argument("--kv-bytes-per-token", type=float, metavar="BYTES",
                     help=f"KV bytes of one token, all layers (default: {STATED_KV_BYTES_PER_TOKEN:,}, Llama-3-8B "
                          f"in bfloat16, stated)")
    ttl.add_argument("--releases-per-second", type=float, metavar="RATE",
                     help="prefix releases (finished turns) a second; scales memory and dollars, not the "
                          f"recommendation (default: the trace's rate; {STATED_RELEASES_PER_SECOND:g}, stated, "
                          "otherwise)")
    ttl.add_argument("--gpu-usd-per-hour", type=float, default=DEFAULT_GPU_USD_PER_HOUR, metavar="USD",
                     help="price of the GPU time that re-prefills a miss")
    ttl.add_argument("--memory-usd-per-gib-hour", type=float, default=DEFAULT_MEMORY_USD_PER_GIB_HOUR,
                     metavar="USD", help="price of holding a GiB of KV for an hour (default: an H100's 80 GiB "
                                         f"of HBM pro rata, {DEFAULT_MEMORY_USD_PER_GIB_HOUR:.4g}; DRAM is ~10x less)")
    ttl.add_argument("--waiting-usd-per-second", type=float, default=0.0, metavar="USD",
                     help="what a second of extra TTFT costs you, per user kept waiting; 0 leaves waiting unpriced")
    ttl.add_argument("--plot", metavar="FILE.png", help="also plot hit rate and cost against TTL (default: no plot)")
    ttl.add_argument("--json", metavar="FILE", help="also write the plan here (default: no JSON)")


def plan_ttl_command(args: argparse.Namespace) -> int:
    """Raises OSError or ValueError with a one-line message on bad input; plan() turns them into exit code 2."""
    ttls = parse_ttls(args.ttls)
    cost = CostModel(args.gpu_usd_per_hour, args.memory_usd_per_gib_hour, args.waiting_usd_per_second)
    plot_path = output_path("--plot", args.plot) if args.plot else None
    json_path = output_path("--json", args.json) if args.json else None
    if args.tenant is not None and args.trace:
        raise ValueError("--tenant needs cache stats (--gaps STATS.json or --url); a trace has no tenants")
    if args.num_never_returned is not None and not args.gaps:
        raise ValueError("--num-never-returned goes with a list of --gaps; stats and traces count their own")
    source = read_gaps(args)
    kind = "trace's" if args.trace else "stats'"
    prefix_tokens, prefix_from = _chosen(args.prefix_tokens, (source.prefix_tokens, f"the {kind} mean"),
                                         (REFERENCE_PREFIX_TOKENS, "stated; pass --prefix-tokens"))
    prefill, prefill_from = _chosen(args.prefill_seconds_per_token, (
        1 / GPU_PREFILL_TOKENS_PER_SECOND, f"stated: Llama-3-8B on one H100 at {GPU_PREFILL_TOKENS_PER_SECOND:,.0f} "
                                           f"tokens/s; pass --prefill-seconds-per-token"))
    kv_bytes, kv_from = _chosen(args.kv_bytes_per_token, (
        STATED_KV_BYTES_PER_TOKEN, "stated: Llama-3-8B in bfloat16; pass --kv-bytes-per-token"))
    rate, rate_from = _chosen(args.releases_per_second, (source.releases_per_second, "the trace's rate"),
                              (STATED_RELEASES_PER_SECOND, "stated; scales memory and dollars, not the choice"))
    plan = plan_ttl(source.distribution, ttls, prefix_tokens=prefix_tokens, prefill_seconds_per_token=prefill,
                    kv_bytes_per_token=kv_bytes, releases_per_second=rate, cost=cost)
    inputs = {"prefix_tokens": prefix_from, "prefill_seconds_per_token": prefill_from,
              "kv_bytes_per_token": kv_from, "releases_per_second": rate_from}
    print("\n".join(format_plan(plan, source.description, inputs)))
    if plot_path:
        plot_plan(plan, plot_path, source.description)
        print(f"wrote {plot_path}")
    if json_path:
        json_path.write_text(json.dumps(plan_json(plan, source.description, inputs), indent=2) + "\n",
                             encoding="utf-8")
        print(f"wrote {json_path}")
    return 0


def _chosen(given: Optional[float], *fallbacks: tuple[Optional[float], str]) -> tuple[float, str]:
    """The flag's value when given, else the first fallback the source has, with where it came from."""
    if given is not None:
        return given, "given"
    return next((value, label) for value, label in fallbacks if value)


def parse_ttls(text: str) -> list[float]:
    ttls = []
    for part in (part for part in text.split(",") if part.strip()):
        match = _DURATION.match(part)
        if not match or not float(match.group(1)) > 0:
            raise ValueError(f"--ttls: {part.strip()!r} is not a positive duration; write seconds or 90s, 5m, 2h, 1d")
        ttls.append(float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    if not ttls:
        raise ValueError("--ttls lists no TTL; give comma-separated durations such as 60,5m,1h")
    return ttls


# --------------------------------------------------------------------------- inputs
def read_gaps(args: argparse.Namespace) -> GapSource:
    if args.trace:
        from ..traces.mooncake import load_trace

        trace = load_trace(args.trace)
        found = gaps_from_trace(trace.requests, trace.block_size)
        return GapSource(found.distribution, f"trace {trace.name} ({len(trace):,} requests over "
                                             f"{_duration(trace.duration)})",
                         found.mean_reused_prefix_tokens or None, found.releases_per_second)
    if args.url:
        return _from_stats(fetch_stats(args.url, args.admin_api_key), f"{args.url.rstrip('/')}{STATS_PATH}",
                           args.tenant)
    path = Path(args.gaps)
    if not path.is_file():
        raise FileNotFoundError(f"--gaps {args.gaps}: no such file; pass a list of gap seconds or a saved "
                                f"{STATS_PATH} body")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = _numbers(text, args.gaps)
    if isinstance(data, dict):
        if args.num_never_returned is not None:
            raise ValueError(f"--num-never-returned goes with a list of gaps; the stats in --gaps {args.gaps} "
                             f"count their own (num_releases minus count)")
        return _from_stats(data, f"--gaps {args.gaps}", args.tenant)
    if not isinstance(data, list):
        raise ValueError(f"--gaps {args.gaps}: JSON {type(data).__name__}, not a list of gap seconds or a "
                         f"{STATS_PATH} object")
    if args.tenant is not None:
        raise ValueError(f"--tenant needs cache stats; --gaps {args.gaps} is a plain list of gaps")
    try:
        distribution = GapDistribution.from_samples(data, args.num_never_returned or 0)
    except ValueError as error:
        raise ValueError(f"--gaps {args.gaps}: {error}") from None
    return GapSource(distribution, f"--gaps {args.gaps} ({len(data):,} gaps)")


def _numbers(text: str, name: str) -> list[float]:
    parts = [part for part in re.split(r"[\s,]+", text) if part]
    try:
        return [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"--gaps {name}: neither JSON nor numbers separated by spaces, commas or lines; "
                         f"pass gap seconds or a saved {STATS_PATH} body") from None


def _from_stats(stats, description: str, tenant: Optional[str]) -> GapSource:
    distribution = distribution_from_stats(stats, tenant)
    prefix_tokens = stats.get("mean_reused_prefix_tokens")
    usable = isinstance(prefix_tokens, (int, float)) and not isinstance(prefix_tokens, bool) and prefix_tokens > 0
    label = f"{description}" + (f", tenant {tenant}" if tenant is not None else "")
    return GapSource(distribution, label, float(prefix_tokens) if usable else None)


def fetch_stats(url: str, admin_api_key: Optional[str], transport=None) -> dict:
    """GET the server's cache stats; any failure is a ValueError naming what to check."""
    address, response = get_from_server(url, STATS_PATH, admin_api_key, transport)
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        hint = "" if admin_api_key else "; pass --admin-api-key"
        raise ValueError(f"--url: {address} answered {response.status_code}: {message or response.text[:200]}{hint}")
    if not isinstance(body, dict):
        raise ValueError(f"--url: {address} did not answer a JSON object; is it a prefixserve server?")
    return body


# --------------------------------------------------------------------------- report
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
            f"{row.waiting_usd_per_hour:>12,.4g} {row.cost_usd_per_hour:>10,.4g}{chosen}")
    best = plan.recommended
    in_seconds = "" if _duration(best.ttl_seconds).endswith(" s") else f" ({best.ttl_seconds:g} s)"
    lines += ["", f"recommended TTL: {_duration(best.ttl_seconds)}{in_seconds}: {best.hit_rate:.1%} of returning "
                  f"turns hit, {_gib(best.memory_bytes)} held, {best.cost_usd_per_hour:,.4g} USD an hour"]
    if len(plan.rows) > 1 and best is plan.rows[0]:
        lines.append("  the shortest candidate: a shorter TTL (or none) may be cheaper still; add shorter --ttls")
    if len(plan.rows) > 1 and best is plan.rows[-1]:
        lines.append("  the longest candidate: a longer TTL may be cheaper still; add longer --ttls")
    if any(row.ttl_seconds > plan.range_end for row in plan.rows):
        lines.append(f"  * beyond the histogram's last bound ({_duration(plan.range_end)}): its overflow gaps count "
                     f"as misses, so the hit rate there is a lower bound")
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
    hits.plot(ttls, [row.survival * 100 for row in plan.rows], marker=".", linestyle=":",
              label="survival (all releases)")
    hits.set_ylabel("%")
    hits.set_ylim(0, 100)
    hits.legend()
    for label, values in (("memory", [row.memory_usd_per_hour for row in plan.rows]),
                          ("recompute", [row.recompute_usd_per_hour for row in plan.rows]),
                          ("waiting", [row.waiting_usd_per_hour for row in plan.rows]),
                          ("total", [row.cost_usd_per_hour for row in plan.rows])):
        if any(values):
            values = [value if value > 0 or not log_costs else math.nan for value in values]  # a log axis has no 0
            costs.plot(ttls, values, marker="o", label=label, **({"color": "black"} if label == "total" else {}))
    costs.set_ylabel("USD an hour")
    costs.set_xlabel("TTL (seconds)")
    costs.set_xscale("log")
    if log_costs:
        costs.set_yscale("log")
    for axis in (hits, costs):
        axis.axvline(plan.recommended.ttl_seconds, color="tab:red", linestyle="--",
                     label=f"recommended: {_duration(plan.recommended.ttl_seconds)}" if axis is costs else None)
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
