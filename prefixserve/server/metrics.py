"""Prometheus metrics, named under `prefixserve:` after vLLM's `vllm:` ones.

Counters and gauges that the engine already keeps are read at scrape time by a
collector, from the snapshot the engine thread publishes after each step (never
from engine state the engine thread is changing); latency histograms are
observed per request.
Each app owns its registry, so tests can run several servers in one process.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..engine.async_engine import EngineSnapshot
from ..metric_names import (
    E2E_LATENCY,
    KV_BLOCKS,
    KV_TIER_CAPACITY_BYTES,
    KV_TIER_FETCH_SECONDS,
    KV_TIER_HIT_TOKENS,
    KV_TIER_REJECTIONS,
    KV_TIER_USED_BYTES,
    PREFIX_REUSE_GAP,
    TENANT_KV_BLOCKS,
    TENANT_TIER_BYTES,
    TTFT,
    server_metric,
)
from .vllm_metrics import VLLMEngineCollector, VLLMLatencies

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


def _single(family_class, name: str, documentation: str, value: float):
    """A metric family of one unlabelled sample, named under `prefixserve:`."""
    family = family_class(server_metric(name), documentation)
    family.add_metric([], value)
    return family


class EngineCollector:
    """Reads the engine's counters and gauges when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], num_rejected: "list[int]") -> None:
        self.snapshot = snapshot
        self._num_rejected = num_rejected

    def collect(self):
        snapshot = self.snapshot()
        stats = snapshot.stats
        usage = snapshot.usage

        def counter(name, documentation, value):
            return _single(CounterMetricFamily, name, documentation, value)

        def gauge(name, documentation, value):
            return _single(GaugeMetricFamily, name, documentation, value)

        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.num_query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.num_hit_tokens)
        yield counter("prefix_cache_requests", "Requests looked up in the prefix cache.", stats.num_queries)
        yield counter(
            "prefix_cache_hit_requests", "Requests that reused at least one cached block.", stats.num_hit_queries
        )
        yield gauge("prefix_cache_request_hit_rate", "Fraction of requests with a prefix hit.", stats.request_hit_rate)
        yield gauge("prefix_cache_token_hit_rate", "Token-weighted prefix hit rate.", stats.token_hit_rate)
        yield counter(
            "prefill_tokens_computed", "Prompt tokens run through the model.", snapshot.num_prefill_tokens_computed
        )
        yield counter("prefill_tokens_saved", "Prompt tokens whose prefill the cache skipped.", stats.num_hit_tokens)
        yield counter("generation_tokens", "Output tokens generated.", snapshot.num_generation_tokens)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by running requests.", usage.usage)
        blocks = GaugeMetricFamily(KV_BLOCKS, "KV blocks by state.", labels=["state"])
        blocks.add_metric(["free"], usage.num_free_blocks)
        blocks.add_metric(["cached"], usage.num_cached_unreferenced_blocks)
        blocks.add_metric(["in_use"], usage.num_referenced_blocks)
        blocks.add_metric(["pinned"], usage.num_pinned_blocks)
        yield blocks
        yield gauge("kv_blocks_total", "KV blocks in the pool.", usage.num_blocks)
        yield counter("evicted_blocks", "Cached blocks evicted to make room.", stats.num_evicted_blocks)
        yield counter("evicted_tokens", "Tokens of cached blocks evicted.", stats.num_evicted_tokens)
        yield counter("expired_blocks", "Cached blocks reclaimed after their TTL.", stats.num_expired_blocks)
        yield counter("num_preemptions", "Running requests preempted for lack of KV blocks.", snapshot.num_preemptions)
        yield gauge("num_requests_running", "Requests in the running batch.", snapshot.num_running)
        yield gauge("num_requests_waiting", "Requests waiting for admission.", snapshot.num_waiting)
        yield counter(
            "rejected_requests", "Requests refused with 429 because the queue was full.", self._num_rejected[0]
        )
        yield from tier_families(snapshot.tiers)
        yield from reuse_gap_families(snapshot.reuse_gaps)
        yield from tenant_families(snapshot.tenants)


def reuse_gap_families(reuse_gaps: dict):
    """The release -> next use gap of prefixes over all tenants (the TTL planner's input), and releases.
    Per tenant they are in GET /v1/cache/stats, behind the admin key: /metrics answers anyone where tenants
    have no keys (a scraper's key where they do), and a tenant's activity over time is no one else's business."""
    if not reuse_gaps:
        return
    overall = reuse_gaps["overall"]
    bounds = [str(float(bound)) for bound in reuse_gaps["bucket_upper_bounds"]] + ["+Inf"]
    cumulative, buckets = 0, []
    for bound, count in zip(bounds, overall["counts"]):
        cumulative += count
        buckets.append((bound, cumulative))
    gaps = HistogramMetricFamily(
        PREFIX_REUSE_GAP, "Time from a request releasing its prefix to the next request that continues it."
    )
    gaps.add_metric([], buckets, overall["sum"])
    yield gaps
    yield _single(
        CounterMetricFamily, "prefix_releases", "Prefixes released by finished requests.", overall["num_releases"]
    )


TIER_COUNTERS = (  # (metric name, TierStats field, help)
    ("kv_tier_bytes_read", "bytes_read", "Bytes read from a KV tier."),
    ("kv_tier_bytes_written", "bytes_written", "Bytes written to a KV tier."),
    ("kv_tier_evictions", "evictions", "Records a KV tier evicted to make room."),
    ("kv_tier_rejected_records", "rejected_records", "Records that failed verification (deleted, recomputed)."),
    ("kv_tier_dropped_puts", "dropped_puts", "Records a KV tier could not store (full, I/O fault, queue full)."),
    ("kv_tier_errors", "errors", "I/O faults of a KV tier."),
    ("kv_tier_slow_reads", "slow_reads", "Reads given up on after the tier deadline (the request recomputed)."),
)


TENANT_COUNTERS = (  # (name, TenantCounters field, documentation)
    ("tenant_prefix_cache_queries", "query_tokens", "A tenant's prompt tokens looked up in the prefix cache."),
    ("tenant_prefix_cache_hits", "hit_tokens", "A tenant's prompt tokens served from the prefix cache."),
    ("tenant_prefix_cache_requests", "queries", "A tenant's requests looked up in the prefix cache."),
    (
        "tenant_over_share_refusals",
        "over_share_refusals",
        "Times a tenant's prompt was left uncached from a block on: it was at its max_kv_share.",
    ),
)


def tenant_families(tenants: dict):
    """Per-tenant families, labelled tenant=...: its cache counters, the pool blocks it holds and pins, against
    its shares. Only the operator's keys read them (/metrics is private where tenants have keys)."""
    if not tenants:
        return
    counters = [
        (CounterMetricFamily(server_metric(name), doc, labels=["tenant"]), field)
        for name, field, doc in TENANT_COUNTERS
    ]
    held = GaugeMetricFamily(
        TENANT_KV_BLOCKS, "KV pool blocks a tenant holds, pins and may hold.", labels=["tenant", "state"]
    )
    tier_bytes = GaugeMetricFamily(TENANT_TIER_BYTES, "Bytes of a KV tier a tenant holds.", labels=["tenant", "tier"])
    for tenant, report in tenants.items():
        for family, field in counters:
            family.add_metric([tenant], report["counters"].get(field, 0))
        pool, pins = report["pool"], report["pins"]
        held.add_metric([tenant, "held"], pool["held"])
        held.add_metric([tenant, "min"], pool["min"])
        if pool["max"] is not None:
            held.add_metric([tenant, "max"], pool["max"])
        held.add_metric([tenant, "pinned"], pins["pinned"])
        if pins["limit"] is not None:
            held.add_metric([tenant, "pin_limit"], pins["limit"])
        for tier, tier_report in report["tiers"].items():
            tier_bytes.add_metric([tenant, tier], tier_report["held"])
    for family, _ in counters:
        yield family
    yield held
    yield tier_bytes


def tier_families(tiers: dict):
    """Per-tier families, labelled tier="host" | "disk": hit tokens, bytes, rejections, usage, fetch latency."""
    if not tiers:
        return
    hits = CounterMetricFamily(KV_TIER_HIT_TOKENS, "Prompt tokens served from a KV tier.", labels=["tier"])
    counters = [
        (CounterMetricFamily(server_metric(name), doc, labels=["tier"]), field) for name, field, doc in TIER_COUNTERS
    ]
    used = GaugeMetricFamily(KV_TIER_USED_BYTES, "Bytes a KV tier holds.", labels=["tier"])
    capacity = GaugeMetricFamily(KV_TIER_CAPACITY_BYTES, "Bytes a KV tier may hold.", labels=["tier"])
    rejections = CounterMetricFamily(
        KV_TIER_REJECTIONS,
        "Records a KV tier's reader refused, by "
        "reason (auth: unsealed, forged or another secret's; nonfinite; checksum; ...).",
        labels=["tier", "reason"],
    )
    latency = HistogramMetricFamily(
        KV_TIER_FETCH_SECONDS,
        "Time from looking a prefix up in a tier to its blocks cached in the pool.",
        labels=["tier"],
    )
    for name, tier in tiers.items():
        hits.add_metric([name], tier.hit_tokens)
        for family, field in counters:
            family.add_metric([name], getattr(tier.stats, field))
        used.add_metric([name], tier.used_bytes)
        capacity.add_metric([name], tier.capacity_bytes)
        latency.add_metric([name], tier.fetch_buckets, tier.fetch_seconds_sum)
        for reason, count in sorted(tier.rejections.items()):
            rejections.add_metric([name, reason], count)
    yield hits
    for family, _ in counters:
        yield family
    yield used
    yield capacity
    yield rejections
    yield latency


class ServerMetrics:
    """Ours under `prefixserve:`, and the model-server protocol's under vLLM's names (vllm_metrics.py)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str, cache_info: dict[str, str]) -> None:
        self.registry = CollectorRegistry()
        self.num_rejected = [0]  # a cell the collector reads; bumped by the API on each 429
        self.registry.register(EngineCollector(snapshot, self.num_rejected))
        self.registry.register(VLLMEngineCollector(snapshot, model_name, cache_info))
        self.vllm_latencies = VLLMLatencies(self.registry, model_name)
        self.ttft = Histogram(TTFT, "Time to first token.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram(
            E2E_LATENCY, "End-to-end request latency.", buckets=LATENCY_BUCKETS, registry=self.registry
        )

    def observe_finished(self, output) -> None:
        metrics = output.metrics
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        if metrics.e2e_latency is not None:
            self.e2e_latency.observe(metrics.e2e_latency)
        self.vllm_latencies.observe(metrics)
