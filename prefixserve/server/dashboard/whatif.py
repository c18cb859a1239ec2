"""The dashboard's what-if panels: JSON computed from this server's own measurements (admin key only).

    GET /dashboard/api/price     blended input price per vendor and TTFT, at the measured (or a given)
                                 hit rate and prompt length                         plan/price.py
    GET /dashboard/api/tiers     fetch vs recompute seconds against prefix length, per tier, crossover
                                 marked, from the engine's learnt prefill and read costs   plan/tiers.py
    GET /dashboard/api/ttl       survival of the next turn and the cost of a miss against TTL, from the
                                 measured reuse gaps                                 plan/ttl.py
    GET /dashboard/api/capacity  the recent request log (or a built-in trace) replayed through the real
                                 radix cache at other pool sizes: hit rate, evictions, the price of an
                                 undersized pool
                                                                                     plan/capacity.py

Engine state is read between steps (`state.engine.call`); the planners run off the event loop.
A panel with nothing measured yet answers `"available": false` and why, not an error; a bad query
value is a 400 with an OpenAI error body naming the parameter. The dashboard includes `whatif_routes`.
"""

from __future__ import annotations

import asyncio
import math
from typing import NamedTuple, Optional

from fastapi import APIRouter, Request

from ...engine.tier_context import DEFAULT_PREFILL_SECONDS_PER_TOKEN
from ...http import APIError
from ...metric_names import TTFT, TTFT_BY_CACHE
from ...plan.capacity import capacity_sweep, requests_from_trace, working_set_blocks
from ...plan.gap_readers import distribution_from_stats
from ...plan.price import (
    PRICE_TABLE_NOTE,
    check_inputs,
    estimated_ttft,
    fixed_seconds_from_measured,
    price_json,
    price_table,
)
from ...plan.tiers import Profile, crossovers
from ...plan.ttl import DEFAULT_TTLS_SECONDS, plan_ttl
from ...tiers import TierCost
from ...tiers.disk import DISK_READ_COST
from ...tiers.host import HOST_READ_COST
from ...traces.mooncake import BUILT_IN_TRACES
from ...traces.named import load_trace

whatif_routes = APIRouter()

DEFAULT_PROMPT_TOKENS = 2000  # the price panel's prompt length before any request is measured
POOL_FRACTIONS = (0.125, 0.25, 0.5, 1, 2, 4)  # default capacity sizes, as multiples of this pool
MAX_SIZES = 16
MAX_CURVE_TOKENS = 1_000_000
# Past any context window or cache lifetime: larger (finite) inputs only overflow the arithmetic into
# infinities JSON cannot carry, so they are a 400 naming the bound.
MAX_PROMPT_TOKENS = 10_000_000
MAX_TTL_SECONDS = 366 * 86400.0
MAX_POOL_BLOCKS = 1 << 24
NUM_CURVE_POINTS = 48
DEFAULT_TRACE_REQUESTS = 2000  # a built-in trace's first requests, for the capacity panel
MAX_TRACE_REQUESTS = 20_000


class EngineCosts(NamedTuple):
    """What the engine knows of its own costs, read between steps."""

    block_size: int
    block_bytes: int
    num_pool_blocks: int
    prefill_seconds_per_token: float
    prefill_source: str
    read_costs: dict[str, TierCost]  # plain copies
    read_source: str


def engine_costs(core) -> EngineCosts:
    """Prefill per token as the engine's tier planner learns it from prefill-heavy steps; each tier's read
    cost as its own reads taught it (the tiers' start-up priors when the server runs without tiers)."""
    tiers = core.tiers
    prefill = tiers.context.prefill_seconds_per_token
    if tiers.tiers:
        read_costs = {name: _copy(tier.read_cost) for name, tier in tiers.tiers.items()}
        read_source = "measured: each tier's fit of its own reads (start-up priors until it has read)"
    else:
        read_costs = {"host": _copy(HOST_READ_COST), "disk": _copy(DISK_READ_COST)}
        read_source = "the tiers' start-up priors (this server has no KV tiers)"
    return EngineCosts(
        core.config.block_size,
        tiers.context.block_bytes,  # a pool block's KV, every layer: what a tier record's payload holds
        core.cache.pool.num_blocks,
        prefill,
        "measured: the engine's moving average over prefill-heavy steps"
        if prefill != DEFAULT_PREFILL_SECONDS_PER_TOKEN
        else "default (no prefill-heavy step measured yet)",
        read_costs,
        read_source,
    )


def _copy(cost: TierCost) -> TierCost:
    return TierCost(cost.latency_seconds, cost.bytes_per_second)


async def _admin_engine(request: Request, function):
    state = request.app.state.server
    return state, await state.engine.call(function)


def _float(request: Request, name: str, low: float, high: float = math.inf) -> Optional[float]:
    text = request.query_params.get(name)
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (low <= value <= high) or math.isinf(value):
        bound = f"[{low:g}, {high:g}]" if high < math.inf else f"at least {low:g}"
        raise APIError(400, f"{name} must be a number {bound}, got {text!r}", param=name, code="invalid_value")
    return value


def _list(request: Request, name: str, parse, default, high: float = math.inf):
    text = request.query_params.get(name)
    if not text:
        return default
    try:
        values = [parse(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or len(values) > MAX_SIZES or any(not (0 < value <= high) or math.isinf(value) for value in values):
        bound = f" of at most {high:g}" if high < math.inf else ""
        raise APIError(
            400,
            f"{name} must be up to {MAX_SIZES} comma-separated positive numbers{bound}, got {text!r}",
            param=name,
            code="invalid_value",
        )
    return values


# ------------------------------------------------------------------------------------------- price
def _measured_ttft(metrics) -> dict:
    """Mean TTFT overall (and by hit / miss where the dashboard's recorder splits it), from the registry."""
    registry = getattr(metrics, "registry", None)
    out = {"mean_ttft_seconds": None, "mean_ttft_hit_seconds": None, "mean_ttft_miss_seconds": None}
    if registry is None:
        return out

    def mean(name: str, labels: Optional[dict] = None) -> Optional[float]:
        count = registry.get_sample_value(f"{name}_count", labels)
        total = registry.get_sample_value(f"{name}_sum", labels)
        return total / count if count and total is not None else None

    out["mean_ttft_seconds"] = mean(TTFT)
    for outcome in ("hit", "miss"):
        out[f"mean_ttft_{outcome}_seconds"] = mean(TTFT_BY_CACHE, {"cache": outcome})
    return out


@whatif_routes.get("/dashboard/api/price")
async def price(request: Request):
    """Each vendor's blended input price and this server's TTFT at a hit rate and prompt length
    (defaults: this server's token hit rate and mean prompt length)."""
    hit_rate = _float(request, "hit_rate", 0.0, 1.0)
    prompt_tokens = _float(request, "prompt_tokens", 1.0, MAX_PROMPT_TOKENS)

    def read(core):
        stats = core.cache.stats
        return stats.token_hit_rate, stats.num_query_tokens, stats.num_queries, engine_costs(core)

    state, (measured_hit_rate, num_query_tokens, num_queries, costs) = await _admin_engine(request, read)
    measured = {
        "hit_rate": measured_hit_rate if num_queries else None,
        "mean_prompt_tokens": num_query_tokens / num_queries if num_queries else None,
        "num_requests": num_queries,
        **_measured_ttft(state.metrics),
    }
    measured_or_default = "measured" if num_queries else "default (none measured)"
    sources = {
        "hit_rate": "query" if hit_rate is not None else measured_or_default,
        "prompt_tokens": "query"
        if prompt_tokens is not None
        else ("measured" if num_queries else f"default ({DEFAULT_PROMPT_TOKENS:,} tokens, none measured)"),
        "prefill_seconds_per_token": costs.prefill_source,
    }
    hit_rate = hit_rate if hit_rate is not None else (measured_hit_rate if num_queries else 0.0)
    prompt_tokens = (
        prompt_tokens if prompt_tokens is not None else (measured["mean_prompt_tokens"] or DEFAULT_PROMPT_TOKENS)
    )
    check_inputs(hit_rate, prompt_tokens)
    fixed = 0.0
    if measured["mean_ttft_seconds"] is not None and num_queries:
        fixed = fixed_seconds_from_measured(
            measured["mean_ttft_seconds"],
            measured_hit_rate,
            measured["mean_prompt_tokens"],
            costs.prefill_seconds_per_token,
        )
        sources["fixed_ttft_seconds"] = "measured: mean TTFT less the prefill the model charges at the measured point"
    else:
        sources["fixed_ttft_seconds"] = "none measured: 0"
    ttft = estimated_ttft(hit_rate, prompt_tokens, costs.prefill_seconds_per_token, fixed)
    body = price_json(price_table(hit_rate, prompt_tokens), ttft)
    return {
        "object": "dashboard.price",
        "hit_rate": hit_rate,
        "prompt_tokens": prompt_tokens,
        "measured": measured,
        "sources": sources,
        **body,
        "note": PRICE_TABLE_NOTE,
    }


# ------------------------------------------------------------------------------------------- tiers
@whatif_routes.get("/dashboard/api/tiers")
async def tiers(request: Request):
    """Per tier: fetch and recompute seconds at prefix lengths up to `max_tokens`, and the crossover."""
    max_tokens = _float(request, "max_tokens", 1.0, MAX_CURVE_TOKENS)
    _, costs = await _admin_engine(request, engine_costs)
    profile = Profile(
        "this server", costs.block_size, costs.block_bytes, costs.prefill_seconds_per_token, costs.read_costs
    )
    rows = crossovers(profile)
    if max_tokens is None:  # three times the furthest finite crossover, within [64 blocks, the curve cap]
        finite = [row.crossover_tokens for row in rows if math.isfinite(row.crossover_tokens)]
        max_tokens = min(max(64 * costs.block_size, 3 * max(finite, default=0)), MAX_CURVE_TOKENS)
    step = max(1, math.ceil(max_tokens / costs.block_size / NUM_CURVE_POINTS)) * costs.block_size
    lengths = list(range(step, int(max_tokens) + 1, step)) or [costs.block_size]
    per_token = profile.bytes_per_token
    return {
        "object": "dashboard.tiers",
        "block_size": costs.block_size,
        "block_bytes": costs.block_bytes,
        "bytes_per_token": per_token,
        "prefill_seconds_per_token": costs.prefill_seconds_per_token,
        "sources": {"prefill_seconds_per_token": costs.prefill_source, "read_costs": costs.read_source},
        "prefix_tokens": lengths,
        "recompute_seconds": [tokens * costs.prefill_seconds_per_token for tokens in lengths],
        "tiers": [
            {
                "tier": row.tier,
                "latency_seconds": row.latency_seconds,
                "bytes_per_second": row.bytes_per_second,
                "fetch_seconds": [costs.read_costs[row.tier].seconds(tokens * per_token) for tokens in lengths],
                "crossover_tokens": row.crossover_tokens if math.isfinite(row.crossover_tokens) else None,
                "crossover_blocks": row.crossover_blocks,  # the smallest run the engine's planner fetches
                "break_even_bytes_per_second": row.break_even_bytes_per_second,
            }
            for row in rows
        ],
    }


# --------------------------------------------------------------------------------------------- ttl
@whatif_routes.get("/dashboard/api/ttl")
async def ttl(request: Request):
    """Per candidate TTL: survival of the next turn, the misses' re-prefill and the USD an hour, from the
    measured reuse gaps (all tenants, or `tenant`)."""
    tenant = request.query_params.get("tenant") or None
    ttls = _list(request, "ttls", float, list(DEFAULT_TTLS_SECONDS), MAX_TTL_SECONDS)
    prefix_tokens = _float(request, "prefix_tokens", 1.0, MAX_PROMPT_TOKENS)

    def read(core):
        log = core.outputs.request_log.snapshot()
        return (
            core.reuse_gaps.stats_body(),
            engine_costs(core),
            [entry.arrival_time for entry in log if entry.finished],
        )

    _, (stats, costs, finished_arrivals) = await _admin_engine(request, read)
    by_tenant = stats["reuse_gaps"].get("by_tenant", {})
    if tenant is not None and tenant not in by_tenant:
        known = ", ".join(sorted(by_tenant)) or "none"
        raise APIError(
            400,
            f"tenant {tenant!r} has no reuse gaps yet; tenants with gaps: {known}",
            param="tenant",
            code="invalid_value",
        )
    histogram = by_tenant[tenant] if tenant is not None else stats["reuse_gaps"]["overall"]
    if not histogram.get("num_releases"):
        return {
            "object": "dashboard.ttl",
            "available": False,
            "reason": "no prefix has been released yet: the TTL panel needs finished requests",
        }
    distribution = distribution_from_stats(stats, tenant)
    span = max(finished_arrivals, default=0.0) - min(finished_arrivals, default=0.0)
    rate, rate_source = (
        (len(finished_arrivals) / span, "measured: finished requests in the request log / their span")
        if span > 0
        else (1.0, "stated: 1 a second (too few finished requests to measure)")
    )
    mean_prefix = stats["mean_reused_prefix_tokens"]
    tokens = prefix_tokens or mean_prefix or DEFAULT_PROMPT_TOKENS
    plan = plan_ttl(
        distribution,
        ttls,
        prefix_tokens=tokens,
        prefill_seconds_per_token=costs.prefill_seconds_per_token,
        kv_bytes_per_token=costs.block_bytes / costs.block_size,
        releases_per_second=rate,
    )
    return {
        "object": "dashboard.ttl",
        "available": True,
        "tenant": tenant,
        "prefix_tokens": tokens,
        "releases_per_second": rate,
        "num_releases": plan.num_releases,
        "return_fraction": plan.return_fraction,
        "range_end_seconds": plan.range_end if math.isfinite(plan.range_end) else None,
        "sources": {
            "prefix_tokens": "query"
            if prefix_tokens
            else ("measured: mean reused prefix" if mean_prefix else "default (none reused yet)"),
            "releases_per_second": rate_source,
            "prefill_seconds_per_token": costs.prefill_source,
        },
        "rows": [row._asdict() for row in plan.rows],
        "recommended": plan.recommended._asdict(),
    }


# ---------------------------------------------------------------------------------------- capacity
@whatif_routes.get("/dashboard/api/capacity")
async def capacity(request: Request):
    """The request log (or a built-in trace, `trace=`) replayed at pool sizes `sizes` (blocks; default: 1/8x to
    4x this pool's tokens)."""
    sizes = _list(request, "sizes", int, None, MAX_POOL_BLOCKS)
    trace_name = request.query_params.get("trace") or None
    if trace_name is not None and trace_name not in BUILT_IN_TRACES:
        raise APIError(
            400,
            f"trace must be one of {', '.join(BUILT_IN_TRACES)}, got {trace_name!r}; omit it to "
            "replay this server's request log",
            param="trace",
            code="invalid_value",
        )
    limit = _float(request, "limit", 1, MAX_TRACE_REQUESTS)

    def read(core):
        return core.outputs.request_log.snapshot(), engine_costs(core)

    _, (log, costs) = await _admin_engine(request, read)
    block_size, source = costs.block_size, "this server's request log (the most recent requests)"
    if trace_name is not None:
        trace = await asyncio.to_thread(load_trace, trace_name, int(limit or DEFAULT_TRACE_REQUESTS))
        log, block_size = await asyncio.to_thread(requests_from_trace, trace), trace.block_size
        source = f"the built-in {trace_name} trace, its first {len(log):,} requests ({block_size} tokens a block)"
    pool_blocks = costs.num_pool_blocks * costs.block_size // block_size
    sizes = sizes or sorted({max(1, round(pool_blocks * fraction)) for fraction in POOL_FRACTIONS})
    if not log:
        return {
            "object": "dashboard.capacity",
            "available": False,
            "reason": "the request log is empty: the capacity panel replays requests this server has served",
        }
    working_set = working_set_blocks(log)
    largest_request = max(len(entry.prompt_keys) + len(entry.output_keys) + 1 for entry in log)
    # A pool that holds every block ever cached plus one request never evicts: larger ones replay the same.
    never_evicts = working_set + largest_request
    replayed = sorted({min(size, never_evicts) for size in sizes})
    results = await asyncio.to_thread(capacity_sweep, log, replayed, block_size, costs.prefill_seconds_per_token)
    by_size = {result.pool_blocks: result for result in results}
    rows = [
        {**by_size[min(size, never_evicts)].to_dict(), "pool_blocks": size, "pool_tokens": size * block_size}
        for size in sizes
    ]
    return {
        "object": "dashboard.capacity",
        "available": True,
        "block_size": block_size,
        "current_pool_blocks": pool_blocks,
        "num_requests": len(log),
        "working_set_blocks": working_set,
        "prefill_seconds_per_token": costs.prefill_seconds_per_token,
        "sources": {"requests": source, "prefill_seconds_per_token": costs.prefill_source},
        "sizes": rows,
    }
