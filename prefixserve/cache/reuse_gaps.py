"""Reuse gaps: how long a released prefix waits for its next request, per tenant and overall.

A TTL is worth what it keeps alive until the next turn, so the planner needs the
distribution of the time between a prefix's release (a request finished with it)
and its next use. The tracker measures it from keys alone, whether or not the
blocks are still cached (a prefix evicted meanwhile still has a gap: that is the
turn a longer TTL would have saved):

    release:   remember the deepest prompt block key and the deepest inserted block key (prompt
               and output) of the finished request, with the time; a chat's next turn usually
               extends the prompt but re-renders the reply, so either may be what it shares
    admission: the deepest of the new request's block keys that is remembered gives the gap
               (then the release is used up: it is followed by at most one next turn)

Keys are scoped (model, tokenizer, tenant), so one tenant's release never matches another
tenant's request. Bounded: the oldest remembered releases go first beyond `max_prefixes`.
Standard library only, no torch.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

# Upper bounds (seconds) of the histogram buckets; a last bucket holds what is longer.
GAP_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400)
DEFAULT_TENANT = "default"  # requests without an API-key tenant
DEFAULT_MAX_PREFIXES = 100_000


@dataclass
class GapHistogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(GAP_BUCKETS) + 1))
    count: int = 0  # gaps observed (releases that came back)
    sum: float = 0.0  # seconds
    num_releases: int = 0
    reused_prefix_tokens: int = 0  # tokens of the remembered prefix at each return, summed

    def observe(self, seconds: float, prefix_tokens: int) -> None:
        self.counts[bisect.bisect_left(GAP_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds
        self.reused_prefix_tokens += prefix_tokens

    def to_dict(self) -> dict:
        return {"counts": list(self.counts), "count": self.count, "sum": self.sum, "num_releases": self.num_releases}


class _Release:
    __slots__ = ("time", "is_used")

    def __init__(self, time: float) -> None:
        self.time = time
        self.is_used = False


class ReuseGapTracker:
    def __init__(
        self, block_size: int, clock: Callable[[], float] = time.monotonic, max_prefixes: int = DEFAULT_MAX_PREFIXES
    ) -> None:
        if max_prefixes < 1:
            raise ValueError(f"max_prefixes must be at least 1, got {max_prefixes}")
        self.block_size = block_size
        self.clock = clock
        self.max_prefixes = max_prefixes
        self._releases: OrderedDict[bytes, tuple[_Release, int]] = OrderedDict()  # key -> (release, tokens)
        self.overall = GapHistogram()
        self.by_tenant: dict[str, GapHistogram] = {}
        self._snapshot: Optional[dict] = None  # memo: readers ask after every engine step

    def released(self, tenant: Optional[str], keys: Sequence[bytes], num_prompt_blocks: int) -> None:
        """A request finished holding these (inserted, leading) block keys, the first
        `num_prompt_blocks` of them (or fewer) from its prompt."""
        if not keys:
            return
        tenant = tenant or DEFAULT_TENANT
        release = _Release(self.clock())
        depths = {len(keys), min(num_prompt_blocks, len(keys))} - {0}
        for depth in sorted(depths):
            key = keys[depth - 1]
            self._releases.pop(key, None)
            self._releases[key] = (release, depth * self.block_size)
        while len(self._releases) > self.max_prefixes:
            self._releases.popitem(last=False)
        self.overall.num_releases += 1
        self._snapshot = None
        self._tenant(tenant).num_releases += 1

    def admitted(self, tenant: Optional[str], keys: Sequence[bytes]) -> Optional[float]:
        """A request arrives with these block keys; returns the gap it closed, if any."""
        for key in reversed(keys):
            remembered = self._releases.pop(key, None)
            if remembered is None:
                continue
            release, num_tokens = remembered
            if release.is_used:  # its other key already closed a gap
                continue
            release.is_used = True
            self._snapshot = None
            gap = max(0.0, self.clock() - release.time)
            self.overall.observe(gap, num_tokens)
            self._tenant(tenant or DEFAULT_TENANT).observe(gap, num_tokens)
            return gap
        return None

    def _tenant(self, tenant: str) -> GapHistogram:
        histogram = self.by_tenant.get(tenant)
        if histogram is None:
            histogram = self.by_tenant[tenant] = GapHistogram()
        return histogram

    @property
    def num_remembered(self) -> int:
        return len(self._releases)

    def snapshot(self) -> dict:
        """The `reuse_gaps` JSON of GET /v1/cache/stats (counts per bucket, not cumulative); the same
        object until something changes, so treat it as read-only."""
        if self._snapshot is None:
            self._snapshot = {
                "bucket_upper_bounds": list(GAP_BUCKETS),
                "overall": self.overall.to_dict(),
                "by_tenant": {tenant: histogram.to_dict() for tenant, histogram in sorted(self.by_tenant.items())},
                "mean_reused_prefix_tokens": self.mean_reused_prefix_tokens,
            }
        return self._snapshot

    def stats_body(self) -> dict:
        """What the TTL planner reads (plan/ttl.py distribution_from_stats): the histograms and the mean
        reused prefix, as GET /v1/cache/stats answers them."""
        return {"reuse_gaps": self.snapshot(), "mean_reused_prefix_tokens": self.mean_reused_prefix_tokens}

    @property
    def mean_reused_prefix_tokens(self) -> float:
        return self.overall.reused_prefix_tokens / self.overall.count if self.overall.count else 0.0
