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
from a server's /v1/cache/stats, a file or a trace and passes them here. The gap distribution is in
plan/gap_distribution.py, the readers of stats and traces in plan/gap_readers.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from .gap_distribution import GapDistribution, _checked_ttl

GIB = 2**30


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


def plan_ttl(
    distribution: GapDistribution,
    ttls_seconds: Sequence[float] = DEFAULT_TTLS_SECONDS,
    *,
    prefix_tokens: float,
    prefill_seconds_per_token: float,
    kv_bytes_per_token: float,
    releases_per_second: float,
    cost: CostModel = CostModel(),
) -> TTLPlan:
    """Price each candidate TTL and recommend the cheapest.

    prefix_tokens: the mean prefix a returning turn reuses (a miss re-prefills all of it); every release, one
        that never comes back too, is taken to hold this many tokens of KV.
    prefill_seconds_per_token: GPU seconds to prefill one token (a miss's extra TTFT is tokens x this).
    kv_bytes_per_token: K and V of every layer for one token (plan.tiers.kv_bytes_per_token).
    releases_per_second: prefix releases (finished turns) per second; scales memory and dollars, not the choice.
    """
    for name, value in (
        ("prefix_tokens", prefix_tokens),
        ("prefill_seconds_per_token", prefill_seconds_per_token),
        ("kv_bytes_per_token", kv_bytes_per_token),
        ("releases_per_second", releases_per_second),
    ):
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
        rows.append(
            TTLRow(
                ttl,
                survival,
                hit_rate,
                miss_tokens,
                extra_ttft,
                held,
                memory_bytes,
                memory_usd,
                recompute_usd,
                waiting_usd,
                memory_usd + recompute_usd + waiting_usd,
            )
        )
    recommended = rows[0]
    for row in rows[1:]:  # shortest first, so a tie keeps the shorter TTL
        if row.cost_usd_per_hour < recommended.cost_usd_per_hour and not math.isclose(
            row.cost_usd_per_hour, recommended.cost_usd_per_hour, rel_tol=1e-9, abs_tol=1e-15
        ):
            recommended = row
    return TTLPlan(
        tuple(rows),
        recommended,
        prefix_tokens,
        prefill_seconds_per_token,
        kv_bytes_per_token,
        releases_per_second,
        cost,
        distribution.num_releases,
        distribution.return_fraction,
        distribution.range_end,
    )
