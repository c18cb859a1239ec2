"""The dashboard's JSON snapshot: the server's own /metrics samples, pool pressure, TTFT quantiles, tenants, tree.

Counters are not re-derived: they are the samples of the app's Prometheus registry, keyed
as /metrics prints them (`prefixserve:prefix_cache_hits_total`, `prefixserve:kv_blocks{state="free"}`),
so the page and /metrics cannot disagree. The page turns successive snapshots into rates.
Nothing here carries token ids or text.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Optional, Sequence

from ...cache.scoping import compose_salt
from ...cache.tree_view import DEFAULT_MAX_NODES, build_tree_view
from ...engine.tenant_report import tenant_report
from ...metric_names import TTFT, TTFT_BY_CACHE
from .recorder import NO_KEY

SHARED_SCOPE = "(shared)"  # the unsalted scope (no tenant key, no salt; public prefixes); parenthesised like "(no key)"


def sample_key(name: str, labels: dict) -> str:
    """A sample as Prometheus' text format names it: `name` or `name{a="x",b="y"}`."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def registry_samples(registry) -> tuple[dict[str, float], dict[str, list[tuple[float, float]]]]:
    """(every sample but histogram buckets and _created, {histogram series: [(upper bound, cumulative count)]})."""
    samples: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if sample.name.endswith("_bucket"):
                labels = {k: v for k, v in sample.labels.items() if k != "le"}
                series = sample_key(family.name, labels)
                buckets.setdefault(series, []).append((float(sample.labels["le"]), sample.value))
                continue
            samples[sample_key(sample.name, sample.labels)] = sample.value
    return samples, buckets


def histogram_quantile(q: float, cumulative: Sequence[tuple[float, float]]) -> Optional[float]:
    """Prometheus' histogram_quantile: linear within the bucket holding rank q; None when empty.

    A rank in the +Inf bucket answers the largest finite bound (as Prometheus does).
    """
    if not cumulative or cumulative[-1][1] == 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in cumulative:
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def latency_summary(series: Sequence[tuple[float, float]], samples: dict, count_key: str, sum_key: str) -> dict:
    """Count, sum, p50 and p99 since start, and the cumulative buckets (the page takes windows of them)."""
    return {
        "count": samples.get(count_key, 0.0),
        "sum": samples.get(sum_key, 0.0),
        "p50": histogram_quantile(0.5, series),
        "p99": histogram_quantile(0.99, series),
        "buckets": [[upper if math.isfinite(upper) else "+Inf", count] for upper, count in series],
    }


def scope_names(core, tenants) -> dict[bytes, str]:
    """Scope digest -> what the dashboard calls it: the shared scope, or a tenant id (keys without cache_salt)."""
    names = {core.scope.digest: SHARED_SCOPE}
    for tenant in tenants:
        names[core.scope.with_salt(compose_salt(tenant, None)).digest] = tenant
    return names


def read_engine(core, tenant_ids: list[str], include_tree: bool, max_nodes: int) -> dict:
    """Pool gauges and the tree view, read on the engine thread between steps."""
    cache = core.cache
    usage = cache.usage()
    pool = {
        "num_blocks": usage.num_blocks,
        "free": usage.num_free_blocks,
        "cached": usage.num_cached_unreferenced_blocks,
        "in_use": usage.num_referenced_blocks,
        "pinned": usage.num_pinned_blocks,
        "reclaimable": cache.num_reclaimable_blocks,
        "usage": usage.usage,
        # what eviction could not free right now: 1.0 means the next admission must wait
        "pressure": 1.0 - (usage.num_free_blocks + cache.num_reclaimable_blocks) / usage.num_blocks,
    }
    shares = tenant_report(core)["tenants"]  # each tenant's share of the pool and of the pin cap
    if not include_tree:
        return {"pool": pool, "shares": shares}
    tiers = core.tiers.tiers.values()
    tier_keys = {tier.name: tier.keys() for tier in tiers if not tier.traits.shared}  # a shared tier is not listed
    view = build_tree_view(
        map(cache.get, cache.keys()),
        cache.block_size,
        max_nodes=max_nodes,
        scope_names=scope_names(core, tenant_ids),
        tier_keys=tier_keys,
        now=cache.clock(),
    )
    tree = asdict(view)
    tree["max_nodes"] = max_nodes
    return {"pool": pool, "shares": shares, "tree": tree}


async def build_snapshot(state, include_tree: bool = True, max_nodes: int = DEFAULT_MAX_NODES) -> dict:
    metrics = state.metrics
    tenant_ids = sorted(set(state.settings.api_keys.values()))
    engine_view = await state.engine.call(lambda core: read_engine(core, tenant_ids, include_tree, max_nodes))
    samples, buckets = registry_samples(metrics.registry)
    ttft = {"all": latency_summary(buckets.get(TTFT, []), samples, TTFT + "_count", TTFT + "_sum")}
    for outcome in ("hit", "miss"):
        labels = sample_key("", {"cache": outcome})
        ttft[outcome] = latency_summary(
            buckets.get(TTFT_BY_CACHE + labels, []),
            samples,
            TTFT_BY_CACHE + "_count" + labels,
            TTFT_BY_CACHE + "_sum" + labels,
        )
    held = engine_view["tree"]["blocks_by_scope"] if include_tree else {}
    recorded = getattr(metrics, "tenants", {})
    tenants = []
    for tenant in sorted(set(tenant_ids) | set(recorded)):
        counts = recorded.get(tenant)
        share = engine_view["shares"].get(tenant)
        scope = SHARED_SCOPE if tenant == NO_KEY else tenant
        tenants.append(
            {
                "tenant": tenant,
                "num_requests": counts.num_requests if counts else 0,
                "prompt_tokens": counts.num_prompt_tokens if counts else 0,
                "cached_tokens": counts.num_cached_tokens if counts else 0,
                "hit_rate": counts.hit_rate if counts else 0.0,
                # its share of the pool: blocks of its private scopes it holds, its minimum and maximum (None:
                # no maximum), and the pins held against its pin_share; None for "(no key)"
                "kv_share": share["pool"] if share else None,
                "pins": share["pins"] if share else None,
                "blocks_held": held.get(scope, 0) if include_tree else None,
            }
        )
    return {
        "mode": "server",
        "time": time.time(),
        "model": state.settings.served_model_name,
        "block_size": state.engine.queries.block_size,
        "metrics": samples,
        "ttft": ttft,
        "pool": engine_view["pool"],
        "tenants": tenants,
        "tree": engine_view.get("tree"),
    }
