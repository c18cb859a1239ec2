"""Where the TTL planner's reuse gaps come from: the gap histogram of a server's GET /v1/cache/stats body,
or the gaps between requests of a block-id trace; each gives a GapDistribution (plan/gap_distribution.py).

Pure computation: standard library only.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Optional, Sequence

from .gap_distribution import GapDistribution


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
        raise ValueError(
            f"{where}.num_releases must be a number >= its count of gaps ({num_returned}), got {num_releases!r}; {fix}"
        )
    try:
        distribution = GapDistribution.from_histogram(
            gaps["bucket_upper_bounds"], counts, num_never_returned=num_releases - num_returned
        )
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if not math.isclose(distribution.num_returned, num_returned):
        raise ValueError(
            f"{where}: count {num_returned} is not the sum of its counts ({distribution.num_returned:g}); {fix}"
        )
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
    return TraceGaps(
        GapDistribution.from_samples(gaps, num_never_returned=num_releases - len(gaps)),
        reused_tokens / len(gaps) if gaps else 0.0,
        num_releases / span,
    )
