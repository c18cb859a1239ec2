"""Fetch or recompute: where a prompt's run continues below the pool, and how much of it to read back.

The engine (engine/kv_tiers.py) and the fleet simulator (simulator/tier_model.py) both call find_run
and choose_fetch, so the simulator predicts what a replica does.

find_run: the tiers are asked nearest first; each one's leading run continues where the tier
before it stopped (host 0-9, then disk from 10, then remote), which is what a replica can
promote in order, each block hanging from its parent.

kv_fetch_policy "always": fetch the whole run. "cost" (the default):

A read of n blocks from a tier costs `latency + n * block_bytes / bandwidth`; recomputing
them costs `n * block_size * prefill_seconds_per_token`. Both are measured: each tier
keeps a TierCost current from its own reads, and engine/operations/calibrate.py measures prefill.

Per-token prefill is taken as constant, which undercounts attention's growth with
position, so the model errs towards recomputing long prefixes: the safe side.
Fetching and recomputing are assumed not to overlap (Cake-style overlap would only
favour fetching more).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from ..config import FETCH_POLICIES

MIN_RELATIVE_VARIANCE = 1e-9  # below this spread of sizes, observations cannot separate latency from bandwidth


@dataclass
class TierCost:
    """Access latency and bandwidth of one tier, refreshed by `observe` (an exponential moving average)."""

    latency_seconds: float
    bytes_per_second: float
    smoothing: float = 0.2  # weight of each new observation
    num_observations: int = 0
    # EMA moments of (bytes, seconds): a weighted least-squares line, seconds = latency + bytes / bandwidth
    _moments: Optional[list[float]] = field(default=None, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.latency_seconds < 0 or self.bytes_per_second <= 0:
            raise ValueError(
                f"TierCost needs latency >= 0 and bandwidth > 0, got {self.latency_seconds}, {self.bytes_per_second}"
            )
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    def seconds(self, num_bytes: float) -> float:
        return self.latency_seconds + num_bytes / self.bytes_per_second

    def observe(self, num_bytes: int, seconds: float) -> None:
        """Fold in one operation that moved `num_bytes` in `seconds`.

        With reads of different sizes the fitted line gives both latency (intercept)
        and bandwidth (slope); while all sizes are alike it keeps the bandwidth and
        moves the latency, or, when even zero latency is too slow to explain the
        observation, the bandwidth.
        """
        if num_bytes <= 0 or seconds <= 0:
            return
        x, y = float(num_bytes), float(seconds)
        with self._lock:
            new = [x, y, x * x, x * y]
            if self._moments is None:
                self._moments = new
            else:
                a = self.smoothing
                self._moments = [(1 - a) * old + a * value for old, value in zip(self._moments, new)]
            mean_x, mean_y, mean_xx, mean_xy = self._moments
            variance = mean_xx - mean_x * mean_x
            covariance = mean_xy - mean_x * mean_y
            bytes_per_second = self.bytes_per_second
            if variance > MIN_RELATIVE_VARIANCE * mean_x * mean_x and covariance > 0:
                bytes_per_second = variance / covariance
            latency = mean_y - mean_x / bytes_per_second
            if latency < 0:
                latency, bytes_per_second = 0.0, mean_x / mean_y
            self.latency_seconds, self.bytes_per_second = latency, bytes_per_second
            self.num_observations += 1


@dataclass(frozen=True)
class FetchPlan:
    num_fetch_blocks_by_tier: dict[str, int]  # every tier of the run, 0 where nothing is fetched
    num_recompute_blocks: int  # blocks of the run left to prefill
    fetch_seconds: float  # estimated
    recompute_seconds: float  # estimated, for the run's blocks that are recomputed

    @property
    def num_fetch_blocks(self) -> int:
        return sum(self.num_fetch_blocks_by_tier.values())


class HoldsBlocks(Protocol):
    name: str

    def contains(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of `keys` held."""


def find_run(tiers: Sequence[HoldsBlocks], keys: Sequence[bytes], start: int) -> list[tuple[str, int]]:
    """keys[start:]'s consecutive run below the pool as (tier, blocks) segments in chain order, nearest
    tier first, each continuing where the one before stopped; tiers holding none of it are left out."""
    run = []
    for tier in tiers:
        found = tier.contains(keys[start:]) if start < len(keys) else 0
        if found:
            run.append((tier.name, found))
            start += found
    return run


def choose_fetch(
    policy: str,
    run: Sequence[tuple[str, int]],
    block_bytes: int,
    prefill_seconds_per_token: float,
    block_size: int,
    costs: dict[str, TierCost],
) -> FetchPlan:
    """What of `run` to read back under kv_fetch_policy `policy`: "cost" plans (plan_fetch), "always"
    fetches it all."""
    if policy == "cost":
        return plan_fetch(run, block_bytes, prefill_seconds_per_token, block_size, costs)
    if policy != "always":
        raise ValueError(f"kv_fetch_policy must be one of {FETCH_POLICIES}, got {policy!r}")
    fetched: dict[str, int] = {}
    for tier, num_blocks in run:
        fetched[tier] = fetched.get(tier, 0) + num_blocks
    seconds = sum(costs[tier].seconds(num_blocks * block_bytes) for tier, num_blocks in run if num_blocks)
    return FetchPlan(fetched, 0, seconds, 0.0)


def plan_fetch(
    num_blocks_by_tier: list[tuple[str, int]],
    block_bytes: int,
    prefill_seconds_per_token: float,
    block_size: int,
    costs: dict[str, TierCost],
) -> FetchPlan:
    """Choose the leading part of a run of lower-tier blocks to fetch; the rest is recomputed.

    `num_blocks_by_tier` is the run in chain order, e.g. [("host", 10), ("disk", 30)]
    (a tier may appear more than once). Only a leading part can be fetched: the
    recomputed blocks must be the run's tail. Within one segment the cost of
    fetching is affine in the block count and recomputing is linear, so the best
    cut is at a segment boundary: the plan takes the boundary that saves the most
    time, fetching nothing unless it saves some. That is the greedy "stop at the
    first tier not worth it", except that a slow short segment is still fetched
    when the cheap segments behind it more than pay for it.
    """
    recompute_per_block = block_size * prefill_seconds_per_token
    fetch_by_segment = []
    for tier, num_blocks in num_blocks_by_tier:
        if num_blocks < 0:
            raise ValueError(f"tier {tier!r} has {num_blocks} blocks in the run")
        if tier not in costs:
            raise ValueError(f"no TierCost for tier {tier!r}; costs cover {sorted(costs)}")
        fetch_by_segment.append(costs[tier].seconds(num_blocks * block_bytes) if num_blocks else 0.0)
    best_cut, best_saving = 0, 0.0
    saving = 0.0
    for cut, ((_, num_blocks), fetch_seconds) in enumerate(zip(num_blocks_by_tier, fetch_by_segment), start=1):
        saving += num_blocks * recompute_per_block - fetch_seconds
        if saving > best_saving:
            best_cut, best_saving = cut, saving
    fetched: dict[str, int] = {tier: 0 for tier, _ in num_blocks_by_tier}
    for tier, num_blocks in num_blocks_by_tier[:best_cut]:
        fetched[tier] += num_blocks
    num_recompute = sum(num_blocks for _, num_blocks in num_blocks_by_tier[best_cut:])
    return FetchPlan(fetched, num_recompute, sum(fetch_by_segment[:best_cut]), num_recompute * recompute_per_block)


def crossover_tokens(cost: TierCost, block_bytes: int, block_size: int, prefill_seconds_per_token: float) -> float:
    """Prefix length in tokens above which one fetch from this tier beats recomputing it.

    latency + tokens * (block_bytes / block_size) / bandwidth < tokens * prefill_seconds_per_token,
    so tokens > latency / (prefill per token - fetch per token); infinite when a token
    is no cheaper to read than to compute.
    """
    fetch_per_token = block_bytes / block_size / cost.bytes_per_second
    margin = prefill_seconds_per_token - fetch_per_token
    if margin <= 0:
        return math.inf
    return cost.latency_seconds / margin
