"""Reuse gaps after a prefix release, as the TTL planner (plan/ttl.py) reads them: a distribution built
from raw gap samples or from a histogram, answering P(next turn within ttl) and E[min(gap, ttl)].

Pure computation: standard library only.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple, Sequence


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

    def __init__(
        self,
        buckets: Sequence[GapBucket],
        num_never_returned: float = 0,
        num_beyond_range: float = 0,
        range_end: float = math.inf,
    ) -> None:
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
            raise ValueError(
                "no releases to plan from (no gaps and no never-returned prefixes); "
                "let the server take traffic first, or pass gaps"
            )
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
    def from_histogram(
        cls, bucket_upper_bounds: Sequence[float], counts: Sequence[float], num_never_returned: float = 0
    ) -> "GapDistribution":
        """Bucket i holds the gaps in (bound i-1, bound i] (the first starts at 0), spread uniformly inside it;
        `counts` has one more entry than the bounds: the overflow bucket, gaps above the last bound."""
        if not bucket_upper_bounds:
            raise ValueError("a gap histogram needs at least one bucket upper bound")
        if len(counts) != len(bucket_upper_bounds) + 1:
            raise ValueError(
                f"a gap histogram needs len(bounds) + 1 counts (the last is the overflow bucket), got "
                f"{len(counts)} counts for {len(bucket_upper_bounds)} bounds"
            )
        bounds = [float(bound) for bound in bucket_upper_bounds]
        if bounds[0] <= 0 or any(high <= low for low, high in zip(bounds, bounds[1:])) or not math.isfinite(bounds[-1]):
            raise ValueError(
                f"bucket upper bounds must be finite, positive and increasing, got {list(bucket_upper_bounds)}"
            )
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
