"""Counters a dashboard needs; gauges are read from the cache when snapshotted."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Optional


@dataclass
class TenantCounters:
    """One tenant's monotonic counters: the operator's view (never shown to another tenant)."""

    queries: int = 0
    hit_queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    over_share_refusals: int = 0  # a block left uncached (with the rest of its prompt): at its max_kv_share


@dataclass
class CacheStats:
    """Monotonic counters (Prometheus counters map onto these one to one)."""

    num_queries: int = 0  # requests looked up
    num_hit_queries: int = 0  # requests that reused at least one block
    num_query_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0  # prompt tokens served from cache = prefill tokens saved
    num_inserted_blocks: int = 0
    num_merged_blocks: int = 0  # computed twice concurrently, folded into the cached copy
    num_collisions: int = 0  # same key, other tokens: treated as a miss
    num_evicted_blocks: int = 0
    num_evicted_tokens: int = 0
    num_expired_blocks: int = 0
    num_min_share_overrides: int = 0  # a tenant's blocks below its minimum evicted to keep a request running
    by_tenant: dict[str, TenantCounters] = field(default_factory=dict)

    def record_query(self, num_query_tokens: int, num_hit_tokens: int, tenant: Optional[str] = None) -> None:
        self.num_queries += 1
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens
        if num_hit_tokens:
            self.num_hit_queries += 1
        if tenant is not None:
            counters = self.tenant(tenant)
            counters.queries += 1
            counters.query_tokens += num_query_tokens
            counters.hit_tokens += num_hit_tokens
            counters.hit_queries += bool(num_hit_tokens)

    def count_over_share(self, tenant: str) -> None:
        self.tenant(tenant).over_share_refusals += 1

    def tenant(self, tenant: str) -> TenantCounters:
        counters = self.by_tenant.get(tenant)
        if counters is None:
            counters = self.by_tenant[tenant] = TenantCounters()
        return counters

    def snapshot(self) -> "CacheStats":
        """A copy another thread may read while the engine counts on."""
        return replace(self, by_tenant={tenant: replace(counters) for tenant, counters in self.by_tenant.items()})

    def tenants_dict(self) -> dict[str, dict]:
        return {tenant: asdict(counters) for tenant, counters in sorted(self.by_tenant.items())}

    @property
    def token_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.num_hit_queries / self.num_queries if self.num_queries else 0.0


@dataclass(frozen=True)
class CacheUsage:
    """Gauges at one instant."""

    num_blocks: int
    num_free_blocks: int  # uncached and unreferenced
    num_cached_unreferenced_blocks: int  # reusable, reclaimable unless pinned
    num_referenced_blocks: int  # in use by running requests
    num_pinned_blocks: int
    num_cached_blocks: int

    @property
    def usage(self) -> float:
        """Fraction of the pool held by running requests (vLLM's kv_cache_usage)."""
        return self.num_referenced_blocks / self.num_blocks


class LatencyHistogram:
    """Bucketed latencies (seconds) for a Prometheus histogram: cumulative counts per upper bound."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if seconds <= bound), len(self.buckets))
        self.counts[index] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """[(upper bound as Prometheus writes it, observations at or below it)], +Inf last."""
        running, out = 0, []
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += count
            out.append((bound, running))
        return out
