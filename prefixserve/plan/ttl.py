"""How long to keep a released prefix: the TTL that minimises memory held plus recomputing the misses.

A session's turn ends and releases its prefix; the next turn comes back after a *gap* (or never).
With a TTL the prefix is kept until `release + ttl`, so for one release:

    the next turn hits          when gap <= ttl                 P = survival(ttl)
    the prefix is held for      min(gap, ttl) seconds           (the full ttl when it never comes back)
    memory held, on average     releases/s x E[min(gap, ttl)] x bytes per prefix      (Little's law)

The stated cost, per hour of traffic, is what an operator pays for:

    memory     GiB held x USD per GiB-hour (the HBM or DRAM that holds the KV)
    recompute  GPU seconds re-prefilling the misses x USD per GPU-hour / 3600
    waiting    seconds users wait for those re-prefills x USD per waiting second (0 unless stated)

Memory, recompute and waiting all scale with the release rate, so the recommended TTL does not
depend on it; only the absolute memory and dollars do. Memory is an upper bound: prefixes that
sessions share (a system prompt) are counted once per release here, once in the real cache.

Pure computation: standard library only. The command line (commands/plan_ttl.py) reads the gaps
from a server's /v1/cache/stats, a file or a trace and passes them here.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Sequence

GIB = 2**30


class GapBucket(NamedTuple):
    """`count` gaps spread uniformly over (low, high]; a single observed gap is a bucket with low == high."""

    low: float
    high: float
    count: float


class GapDistribution:
    """Reuse gaps after a prefix release, and the releases that never came back in the window.

    Built from raw samples (`from_samples`) or from a histogram (`from_histogram`). Inside a
    histogram bucket the gaps are assumed spread uniformly between its bounds. The histogram's
    overflow bucket (gaps above its last bound) came back, but later than the histogram can say:
    those count as misses at every TTL and are held for the whole TTL, which is exact up to the
    last bound and the pessimistic side beyond it (`range_end`).
    """

    def __init__(self, buckets: Sequence[GapBucket], num_never_returned: float = 0,
                 num_beyond_range: float = 0, range_end: float = math.inf) -> None:
        ordered = sorted(buckets, key=lambda bucket: (bucket.high, bucket.low))
        for bucket in ordered:
            if not (0 <= bucket.low <= bucket.high < math.inf) or not (0 <= bucket.count < math.inf):
                raise ValueError(f"a gap bucket needs 0 <= low <= high < inf and a finite count >= 0, got {bucket}")
        for previous, bucket in zip(ordered, ordered[1:]):
            if bucket.low < previous.high:
                raise ValueError(f"gap buckets overlap: {previous} and {bucket}; give disjoint bucket bounds")
        for name, value in (("never-returned releases", num_never_returned), ("overflow gaps", num_beyond_range)):
            if not 0 <= value < math.inf:
                raise ValueError(f"the count of {name} must be a finite number >= 0, got {value}")
        self.buckets = tuple(ordered)
        self.num_never_returned = num_never_returned
        self.num_beyond_range = num_beyond_range
        self.range_end = range_end
        self.num_returned = sum(bucket.count for bucket in ordered) + num_beyond_range
        self.num_releases = self.num_returned + num_never_returned
        if not self.num_releases > 0:
            raise ValueError("no releases to plan from (no gaps and no never-returned prefixes); "
                             "let the server take traffic first, or pass gaps")
        # Cumulative count and count x mean gap over the buckets in order: a query bisects instead of summing.
        self._highs = [bucket.high for bucket in ordered]
        self._cumulative_counts = [0.0]
        self._cumulative_gap_sums = [0.0]
        for bucket in ordered:
            self._cumulative_counts.append(self._cumulative_counts[-1] + bucket.count)
            mean_gap = (bucket.low + bucket.high) / 2
            self._cumulative_gap_sums.append(self._cumulative_gap_sums[-1] + bucket.count * mean_gap)

    @classmethod
    def from_samples(cls, gaps_seconds: Sequence[float], num_never_returned: float = 0) -> "GapDistribution":
        """Each observed gap (seconds from a prefix's release to its next use) as itself."""
        for gap in gaps_seconds:
            if not (isinstance(gap, (int, float)) and not isinstance(gap, bool) and 0 <= gap < math.inf):
                raise ValueError(f"gaps must be finite seconds >= 0, got {gap!r}; drop negative or missing values")
        counts: dict[float, int] = {}
        for gap in gaps_seconds:
            counts[float(gap)] = counts.get(float(gap), 0) + 1
        return cls([GapBucket(gap, gap, count) for gap, count in counts.items()], num_never_returned)

    @classmethod
    def from_histogram(cls, bucket_upper_bounds: Sequence[float], counts: Sequence[float],
                       num_never_returned: float = 0) -> "GapDistribution":
        """Bucket i holds the gaps in (bound i-1, bound i] (the first starts at 0), spread uniformly inside it;
        `counts` has one more entry than the bounds: the overflow bucket, gaps above the last bound."""
        if not bucket_upper_bounds:
            raise ValueError("a gap histogram needs at least one bucket upper bound")
        if len(counts) != len(bucket_upper_bounds) + 1:
            raise ValueError(f"a gap histogram needs len(bounds) + 1 counts (the last is the overflow bucket), got "
                             f"{len(counts)} counts for {len(bucket_upper_bounds)} bounds")
        bounds = [float(bound) for bound in bucket_upper_bounds]
        if bounds[0] <= 0 or any(high <= low for low, high in zip(bounds, bounds[1:])) or not math.isfinite(bounds[-1]):
            raise ValueError(f"bucket upper bounds must be finite, positive and increasing, "
                             f"got {list(bucket_upper_bounds)}")
        for count in counts:
            if isinstance(count, bool) or not isinstance(count, (int, float)) or not 0 <= count < math.inf:
                raise ValueError(f"histogram counts must be finite numbers >= 0, got {list(counts)}")
        lows = [0.0, *bounds[:-1]]
        buckets = [GapBucket(low, high, count) for low, high, count in zip(lows, bounds, counts) if count]
        return cls(buckets, num_never_returned, num_beyond_range=counts[-1], range_end=bounds[-1])

    @property
    def return_fraction(self) -> float:
        """Of all releases, the share whose next turn came back at all (at any gap)."""
        return self.num_returned / self.num_releases

    def survival(self, ttl: float) -> float:
        """P(the next turn arrives within ttl | a release): never-returned releases count in the denominator."""
        return self._returned_within(_checked_ttl(ttl)) / self.num_releases

    def expected_held_seconds(self, ttl: float) -> float:
        """E[min(gap, ttl)] over all releases: how long one release keeps its prefix, a never-returned one for ttl."""
        ttl = _checked_ttl(ttl)
        index = bisect.bisect_right(self._highs, ttl)  # buckets [0, index) end at or before ttl: held their gap
        held = self._cumulative_gap_sums[index]
        counted = self._cumulative_counts[index]
        if index < len(self.buckets) and self.buckets[index].low < ttl:  # the one bucket ttl cuts through
            low, high, count = self.buckets[index]
            # Uniform on (low, high]: the gaps below ttl are held their gap, the rest are held ttl.
            held += count * ((ttl * ttl - low * low) / 2 + ttl * (high - ttl)) / (high - low)
            counted += count
        return (held + (self.num_releases - counted) * ttl) / self.num_releases

    def _returned_within(self, ttl: float) -> float:
        index = bisect.bisect_right(self._highs, ttl)
        within = self._cumulative_counts[index]
        if index < len(self.buckets) and self.buckets[index].low < ttl:
            low, high, count = self.buckets[index]
            within += count * (ttl - low) / (high - low)
        return within


def _checked_ttl(ttl: float) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < math.inf:
        raise ValueError(f"a TTL must be a positive, finite number of seconds, got {ttl!r}")
    return float(ttl)


# --------------------------------------------------------------------------- the plan
# The stated prices: an H100 rented at $2.50 an hour, its 80 GiB of HBM priced pro rata (KV kept in host
# DRAM costs roughly a tenth of that: pass its price instead).
DEFAULT_GPU_USD_PER_HOUR = 2.50
DEFAULT_MEMORY_USD_PER_GIB_HOUR = DEFAULT_GPU_USD_PER_HOUR / 80
DEFAULT_TTLS_SECONDS = (10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 43200, 86400)


@dataclass(frozen=True)
class CostModel:
    """What an hour of the plan costs, in USD: memory held, GPU time re-prefilling misses, users kept waiting."""

    gpu_usd_per_hour: float = DEFAULT_GPU_USD_PER_HOUR
    memory_usd_per_gib_hour: float = DEFAULT_MEMORY_USD_PER_GIB_HOUR
    waiting_usd_per_second: float = 0.0  # the value of a second of extra TTFT to one user; 0: not priced

    def __post_init__(self) -> None:
        for name in ("gpu_usd_per_hour", "memory_usd_per_gib_hour", "waiting_usd_per_second"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite price >= 0, got {value!r}")


class TTLRow(NamedTuple):
    """One candidate TTL. `*_per_turn` and `hit_rate` are per next turn that comes back at all."""

    ttl_seconds: float
    survival: float  # P(next turn within ttl | a release), never-returned releases included
    hit_rate: float  # P(next turn within ttl | it comes back); 0 when none come back
    miss_tokens_per_turn: float  # prefix tokens re-prefilled, on average
    extra_ttft_seconds_per_turn: float  # the re-prefill a returning user waits for, on average
    held_seconds_per_release: float  # E[min(gap, ttl)]
    memory_bytes: float  # held on average (Little's law)
    memory_usd_per_hour: float
    recompute_usd_per_hour: float
    waiting_usd_per_hour: float
    cost_usd_per_hour: float


@dataclass(frozen=True)
class TTLPlan:
    rows: tuple[TTLRow, ...]  # by TTL, shortest first
    recommended: TTLRow  # the least cost; a tie goes to the shorter TTL
    prefix_tokens: float
    prefill_seconds_per_token: float
    kv_bytes_per_token: float
    releases_per_second: float
    cost: CostModel
    num_releases: float
    return_fraction: float
    range_end: float  # beyond this gap the input cannot tell a hit (histogram's last bound; inf for samples)


def plan_ttl(distribution: GapDistribution, ttls_seconds: Sequence[float] = DEFAULT_TTLS_SECONDS, *,
             prefix_tokens: float, prefill_seconds_per_token: float, kv_bytes_per_token: float,
             releases_per_second: float, cost: CostModel = CostModel()) -> TTLPlan:
    """Price each candidate TTL and recommend the cheapest.

    prefix_tokens: the mean prefix a returning turn reuses (a miss re-prefills all of it); every release, one
        that never comes back too, is taken to hold this many tokens of KV.
    prefill_seconds_per_token: GPU seconds to prefill one token (a miss's extra TTFT is tokens x this).
    kv_bytes_per_token: K and V of every layer for one token (plan.tiers.kv_bytes_per_token).
    releases_per_second: prefix releases (finished turns) per second; scales memory and dollars, not the choice.
    """
    for name, value in (("prefix_tokens", prefix_tokens), ("prefill_seconds_per_token", prefill_seconds_per_token),
                        ("kv_bytes_per_token", kv_bytes_per_token), ("releases_per_second", releases_per_second)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive, finite number, got {value!r}")
    if not ttls_seconds:
        raise ValueError("no candidate TTLs; pass at least one positive number of seconds")
    ttls = sorted({_checked_ttl(ttl) for ttl in ttls_seconds})
    returns_per_hour = releases_per_second * 3600 * distribution.return_fraction
    rows = []
    for ttl in ttls:
        survival = distribution.survival(ttl)
        hit_rate = survival / distribution.return_fraction if distribution.num_returned else 0.0
        miss_tokens = (1 - hit_rate) * prefix_tokens if distribution.num_returned else 0.0
        extra_ttft = miss_tokens * prefill_seconds_per_token
        held = distribution.expected_held_seconds(ttl)
        memory_bytes = releases_per_second * held * prefix_tokens * kv_bytes_per_token
        memory_usd = memory_bytes / GIB * cost.memory_usd_per_gib_hour
        recompute_usd = returns_per_hour * extra_ttft * cost.gpu_usd_per_hour / 3600
        waiting_usd = returns_per_hour * extra_ttft * cost.waiting_usd_per_second
        rows.append(TTLRow(ttl, survival, hit_rate, miss_tokens, extra_ttft, held, memory_bytes, memory_usd,
                           recompute_usd, waiting_usd, memory_usd + recompute_usd + waiting_usd))
    recommended = rows[0]
    for row in rows[1:]:  # shortest first, so a tie keeps the shorter TTL
        if row.cost_usd_per_hour < recommended.cost_usd_per_hour and not math.isclose(
                row.cost_usd_per_hour, recommended.cost_usd_per_hour, rel_tol=1e-9, abs_tol=1e-15):
            recommended = row
    return TTLPlan(tuple(rows), recommended, prefix_tokens, prefill_seconds_per_token, kv_bytes_per_token,
                   releases_per_second, cost, distribution.num_releases, distribution.return_fraction,
                   distribution.range_end)


# --------------------------------------------------------------------------- inputs
def distribution_from_stats(stats_json: Mapping, tenant: Optional[str] = None) -> GapDistribution:
    """The gap histogram of a server's `GET /v1/cache/stats` body (all tenants, or one): its `num_releases` minus
    its `count` are the releases that have not come back (yet)."""
    fix = "pass the JSON body of a server's GET /v1/cache/stats"
    gaps = stats_json.get("reuse_gaps") if isinstance(stats_json, Mapping) else None
    if not isinstance(gaps, Mapping) or not isinstance(gaps.get("bucket_upper_bounds"), list):
        raise ValueError(f"no reuse_gaps.bucket_upper_bounds in these stats; {fix}")
    if tenant is None:
        histogram, where = gaps.get("overall"), "reuse_gaps.overall"
    else:
        by_tenant = gaps.get("by_tenant") or {}
        if tenant not in by_tenant:
            known = ", ".join(sorted(by_tenant)) or "none recorded"
            raise ValueError(f"tenant {tenant!r} has no reuse gaps in these stats; tenants: {known}")
        histogram, where = by_tenant[tenant], f"reuse_gaps.by_tenant[{tenant!r}]"
    if not isinstance(histogram, Mapping) or not isinstance(histogram.get("counts"), list):
        raise ValueError(f"{where} has no counts list; {fix}")
    counts = histogram["counts"]
    num_releases = histogram.get("num_releases")
    num_returned = histogram.get("count", sum(c for c in counts if isinstance(c, (int, float))))
    if isinstance(num_releases, bool) or not isinstance(num_releases, (int, float)) or num_releases < num_returned:
        raise ValueError(f"{where}.num_releases must be a number >= its count of gaps ({num_returned}), "
                         f"got {num_releases!r}; {fix}")
    try:
        distribution = GapDistribution.from_histogram(gaps["bucket_upper_bounds"], counts,
                                                      num_never_returned=num_releases - num_returned)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if not math.isclose(distribution.num_returned, num_returned):
        raise ValueError(f"{where}: count {num_returned} is not the sum of its counts "
                         f"({distribution.num_returned:g}); {fix}")
    return distribution


class TraceGaps(NamedTuple):
    distribution: GapDistribution
    mean_reused_prefix_tokens: float  # 0 when nothing came back
    releases_per_second: float  # over the trace's span


def gaps_from_trace(requests: Sequence, block_size: int) -> TraceGaps:
    """Reuse gaps in a block-id trace (objects with arrival_time, input_length, hash_ids, in arrival order).

    Each request releases its prefix of full blocks when it arrives (the gap so includes the turn's own
    prefill and decode). The release comes back at the first later request whose block ids contain the
    release's last full block id (ids are prefix-chained: that request starts with the whole prefix);
    releases nobody reuses by the end of the trace never came back. Requests under one block release nothing.
    """
    pending: dict[int, tuple[float, int]] = {}  # last full block id -> (release time, full blocks)
    gaps, reused_tokens, num_releases = [], 0, 0
    for request in requests:
        for block_id in request.hash_ids:
            if block_id in pending:
                released_at, num_blocks = pending.pop(block_id)
                gaps.append(request.arrival_time - released_at)
                reused_tokens += num_blocks * block_size
        num_full_blocks = request.input_length // block_size
        if num_full_blocks:
            pending[request.hash_ids[num_full_blocks - 1]] = (request.arrival_time, num_full_blocks)
            num_releases += 1
    if not num_releases:
        raise ValueError(f"no request in this trace holds a full block of {block_size} tokens; nothing to plan")
    span = requests[-1].arrival_time - requests[0].arrival_time
    if not span > 0:
        raise ValueError("every request in this trace arrives at the same time; a TTL plan needs gaps between them")
    return TraceGaps(GapDistribution.from_samples(gaps, num_never_returned=num_releases - len(gaps)),
                     reused_tokens / len(gaps) if gaps else 0.0, num_releases / span)
