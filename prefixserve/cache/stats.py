"""Counters a dashboard needs; gauges are read from the cache when snapshotted."""

from __future__ import annotations

from dataclasses import dataclass


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

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += 1
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens
        if num_hit_tokens:
            self.num_hit_queries += 1

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
