"""Fetch or recompute, per tier: the prefix length above which reading its KV back beats prefilling it.

    fetch(n tokens)     = latency + n * KV bytes per token / bandwidth
    recompute(n tokens) = n * prefill seconds per token
    crossover           = latency / (prefill per token - KV bytes per token / bandwidth)

This is the linear model the engine's planner decides with (tiers/policy.py), so a row's
"blocks" column is exactly the smallest run `plan_fetch` fetches. It ignores attention's
growth with position (recompute is dearer than this for long prefixes: the safe side) and
any overlap of fetching with computing. When a token is no cheaper to read than to compute
(bandwidth below the break-even bandwidth) a fetch never wins under this model.

Pure computation: the command line measures this machine (prefixserve plan tiers), the GPU
profile below is stated, and both come here as numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from ..tiers import TierCost, crossover_tokens, plan_fetch
from ..tiers.record import DTYPE_SIZES

REFERENCE_PREFIX_TOKENS = 2000  # the prefix the tables also price whole
LITERATURE_NVME_CROSSOVER_TOKENS = 1900
LITERATURE_SOURCE = "Cake / LMCache reports"
LITERATURE_CLAIM = (
    "an NVMe fetch beats recompute above about 1,900 tokens for an 8B-class model on a fast GPU "
    "(one reported setup, not a universal figure)"
)

# The stated GPU profile: Llama-3-8B (32 layers, 8 KV heads of 128) in bfloat16 on one H100.
GPU_PROFILE_NAME = "Llama-3-8B bf16, one H100 (stated)"
GPU_PREFILL_TOKENS_PER_SECOND = 12_000.0
GPU_HOST_COST = TierCost(latency_seconds=10e-6, bytes_per_second=20e9)
GPU_DISK_COST = TierCost(latency_seconds=100e-6, bytes_per_second=3e9)
GPU_BANDWIDTH_SWEEP = (1.6e9, 2e9, 3e9, 6e9)  # NVMe bandwidths the sensitivity line prices


@dataclass(frozen=True)
class Profile:
    """One machine and model: what a block weighs, what a token costs to prefill, what each tier costs to read."""

    name: str
    block_size: int  # tokens per block
    block_bytes: int  # KV payload of one block
    prefill_seconds_per_token: float
    read_costs: dict[str, TierCost]  # tier name -> latency and bandwidth, in fetch order
    assumptions: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_bytes < 1:
            raise ValueError(
                f"{self.name}: block_size and block_bytes must be positive, "
                f"got {self.block_size} and {self.block_bytes}"
            )
        if not self.prefill_seconds_per_token > 0:
            raise ValueError(
                f"{self.name}: prefill seconds per token must be positive, got {self.prefill_seconds_per_token}"
            )

    @property
    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_size


class TierCrossover(NamedTuple):
    profile: str
    tier: str
    latency_seconds: float
    bytes_per_second: float
    bytes_per_token: float
    fetch_seconds_per_token: float
    prefill_seconds_per_token: float
    break_even_bytes_per_second: float  # below this bandwidth a token is cheaper to compute than to read
    crossover_tokens: float  # math.inf: a fetch never wins
    crossover_blocks: Optional[int]  # the smallest run plan_fetch fetches; None: never
    prefix_fetch_seconds: float  # REFERENCE_PREFIX_TOKENS read back
    prefix_recompute_seconds: float  # REFERENCE_PREFIX_TOKENS prefilled


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V of every layer for one token."""
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unknown KV dtype {dtype!r}; one of {sorted(DTYPE_SIZES)}")
    return 2 * num_layers * num_kv_heads * head_dim * DTYPE_SIZES[dtype]


def fit_read_cost(samples: Sequence[tuple[int, float]]) -> TierCost:
    """Latency and bandwidth from reads of different sizes: least squares of seconds = latency + bytes / bandwidth.

    Noise can tilt the line: a negative intercept is refitted through the origin (all of
    the time is bandwidth), and a flat or falling one keeps the mean time as latency and
    the largest read's rate as bandwidth, so each error leans towards a dearer fetch.
    """
    if len({num_bytes for num_bytes, _ in samples}) < 2:
        raise ValueError(f"fitting latency and bandwidth needs reads of at least two sizes, got {list(samples)}")
    if any(num_bytes <= 0 or seconds <= 0 for num_bytes, seconds in samples):
        raise ValueError(f"every read needs positive bytes and seconds, got {list(samples)}")
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    variance = sum((x - mean_x) ** 2 for x, _ in samples)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in samples)
    if covariance <= 0:
        largest_bytes, largest_seconds = max(samples)
        return TierCost(latency_seconds=mean_y, bytes_per_second=largest_bytes / largest_seconds)
    seconds_per_byte = covariance / variance
    latency = mean_y - seconds_per_byte * mean_x
    if latency < 0:
        seconds_per_byte = sum(x * y for x, y in samples) / sum(x * x for x, _ in samples)
        latency = 0.0
    return TierCost(latency_seconds=latency, bytes_per_second=1 / seconds_per_byte)


def smallest_fetched_run(profile: Profile, tier: str) -> Optional[int]:
    """The fewest blocks of `tier` that plan_fetch would fetch rather than recompute; None when it never does."""
    cost = profile.read_costs[tier]
    margin_per_block = (
        profile.block_size * profile.prefill_seconds_per_token - profile.block_bytes / cost.bytes_per_second
    )
    if margin_per_block <= 0:
        return None

    def fetches(num_blocks: int) -> bool:
        plan = plan_fetch(
            [(tier, num_blocks)],
            profile.block_bytes,
            profile.prefill_seconds_per_token,
            profile.block_size,
            {tier: cost},
        )
        return plan.num_fetch_blocks == num_blocks

    # The formula's guess, then settled against the planner itself (floating point may put it one off).
    num_blocks = math.floor(cost.latency_seconds / margin_per_block) + 1
    while num_blocks > 1 and fetches(num_blocks - 1):
        num_blocks -= 1
    while not fetches(num_blocks):
        num_blocks += 1
    return num_blocks


def crossovers(profile: Profile) -> list[TierCrossover]:
    """One row per tier of the profile, in its order."""
    rows = []
    for tier, cost in profile.read_costs.items():
        per_token = profile.bytes_per_token
        rows.append(
            TierCrossover(
                profile=profile.name,
                tier=tier,
                latency_seconds=cost.latency_seconds,
                bytes_per_second=cost.bytes_per_second,
                bytes_per_token=per_token,
                fetch_seconds_per_token=per_token / cost.bytes_per_second,
                prefill_seconds_per_token=profile.prefill_seconds_per_token,
                break_even_bytes_per_second=per_token / profile.prefill_seconds_per_token,
                crossover_tokens=crossover_tokens(
                    cost, profile.block_bytes, profile.block_size, profile.prefill_seconds_per_token
                ),
                crossover_blocks=smallest_fetched_run(profile, tier),
                prefix_fetch_seconds=cost.seconds(REFERENCE_PREFIX_TOKENS * per_token),
                prefix_recompute_seconds=REFERENCE_PREFIX_TOKENS * profile.prefill_seconds_per_token,
            )
        )
    return rows


def gpu_profile(
    prefill_tokens_per_second: float = GPU_PREFILL_TOKENS_PER_SECOND,
    host: TierCost = GPU_HOST_COST,
    disk: TierCost = GPU_DISK_COST,
    block_size: int = 16,
) -> Profile:
    """The stated profile: an 8B Llama-3 on an H100, pinned host DRAM over PCIe, and NVMe."""
    per_token = kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assumptions = (
        f"KV of Llama-3-8B in bf16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes = {per_token // 1024} KiB per token",
        f"prefill on one H100: {prefill_tokens_per_second:,.0f} tokens/s (assumed; the range usually quoted is "
        f"10,000-13,000)",
        f"host: DRAM over PCIe, {host.bytes_per_second / 1e9:g} GB/s, {host.latency_seconds * 1e6:g} us per fetch",
        f"disk: NVMe, {disk.bytes_per_second / 1e9:g} GB/s, {disk.latency_seconds * 1e6:g} us per fetch",
        f"blocks of {block_size} tokens; no overlap of fetch and compute",
    )
    return Profile(
        GPU_PROFILE_NAME,
        block_size,
        per_token * block_size,
        1 / prefill_tokens_per_second,
        {"host": host, "disk": disk},
        assumptions,
    )


def bandwidth_sweep(profile: Profile, tier: str, bandwidths: Sequence[float]) -> list[tuple[float, float]]:
    """(bandwidth, crossover tokens) for the tier's latency at each bandwidth."""
    latency = profile.read_costs[tier].latency_seconds
    return [
        (
            bandwidth,
            crossover_tokens(
                TierCost(latency, bandwidth), profile.block_bytes, profile.block_size, profile.prefill_seconds_per_token
            ),
        )
        for bandwidth in bandwidths
    ]


class CrossoverMatch(NamedTuple):
    """What one tier would need for its crossover to land on a given prefix length."""

    tokens: float
    latency_seconds: float  # at the tier's bandwidth
    bytes_per_second: float  # at the tier's latency; the break-even bandwidth plus a sliver


def to_reach(profile: Profile, tier: str, tokens: float) -> CrossoverMatch:
    """Solve latency / (prefill - bytes per token / bandwidth) = tokens for latency, then for bandwidth."""
    cost = profile.read_costs[tier]
    margin = profile.prefill_seconds_per_token - profile.bytes_per_token / cost.bytes_per_second
    latency = tokens * margin if margin > 0 else math.inf
    needed_margin = cost.latency_seconds / tokens
    if needed_margin >= profile.prefill_seconds_per_token:
        bandwidth = math.inf  # even an infinitely fast read leaves the latency too dear
    else:
        bandwidth = profile.bytes_per_token / (profile.prefill_seconds_per_token - needed_margin)
    return CrossoverMatch(tokens, latency, bandwidth)


# ------------------------------------------------------------------------ report
def format_report(profiles: Sequence[Profile], reference: Profile, reference_tier: str = "disk") -> list[str]:
    """The table, the literature's figure, each profile's assumptions, and what `reference` would need to match it."""
    lines = [
        "Fetch or recompute: above the crossover prefix length, reading a prefix's KV back from the tier beats "
        "prefilling it again",
        "(fetch = latency + tokens x KV bytes per token / bandwidth; recompute = tokens x prefill seconds per token; "
        "'blocks' = the smallest run the engine's planner fetches)",
        "",
        f"{'':<8}{'read':^21}  {'per token':^26}  {'crossover':^15}  {f'{REFERENCE_PREFIX_TOKENS:,}-token prefix':^20}",
        f"{'tier':<8}{'latency':>10} {'bandwidth':>10}  {'KV':>8} {'read':>8} {'prefill':>8}  {'tokens':>8} "
        f"{'blocks':>6}  {'fetch':>9} {'recompute':>10}",
    ]
    for profile in profiles:
        lines.append(profile.name)
        for row in crossovers(profile):
            lines.append(
                f"  {row.tier:<6}{_seconds(row.latency_seconds):>10} {_rate(row.bytes_per_second):>10}  "
                f"{_bytes(row.bytes_per_token):>8} {_seconds(row.fetch_seconds_per_token):>8} "
                f"{_seconds(row.prefill_seconds_per_token):>8}  {_tokens(row.crossover_tokens):>8} "
                f"{'never' if row.crossover_blocks is None else row.crossover_blocks:>6}  "
                f"{_seconds(row.prefix_fetch_seconds):>9} {_seconds(row.prefix_recompute_seconds):>10}"
            )
    lines.append(LITERATURE_SOURCE)
    lines.append(f"  {'NVMe':<6}{'':>51}{'~' + format(LITERATURE_NVME_CROSSOVER_TOKENS, ','):>8}")
    lines += ["", f"{LITERATURE_SOURCE}: {LITERATURE_CLAIM}."]
    for profile in profiles:
        if profile.assumptions:
            lines.append(f"{profile.name}:")
            lines += [f"  - {assumption}" for assumption in profile.assumptions]
    sweep = ", ".join(
        f"{bandwidth / 1e9:g} GB/s: {_tokens(tokens)}"
        for bandwidth, tokens in bandwidth_sweep(reference, reference_tier, GPU_BANDWIDTH_SWEEP)
    )
    match = to_reach(reference, reference_tier, LITERATURE_NVME_CROSSOVER_TOKENS)
    cost = reference.read_costs[reference_tier]
    break_even = reference.bytes_per_token / reference.prefill_seconds_per_token
    lines += [
        f"{reference.name}, {reference_tier} crossover by bandwidth at {_seconds(cost.latency_seconds)} latency: "
        f"{sweep} tokens (break-even {_rate(break_even)}: below it a fetch never wins).",
        f"To land on ~{LITERATURE_NVME_CROSSOVER_TOKENS:,} tokens this model needs {_seconds(match.latency_seconds)} "
        f"per fetch at {_rate(cost.bytes_per_second)}, or {_rate(match.bytes_per_second)} at "
        f"{_seconds(cost.latency_seconds)}: the reported figure implies far larger fixed costs per fetch than stated "
        f"here, or an effective bandwidth barely above break-even.",
    ]
    return [line.rstrip() for line in lines]


def report_json(profiles: Sequence[Profile], reference: Profile, reference_tier: str = "disk") -> dict:
    """The report as JSON-safe data (an infinite crossover is null)."""

    def finite(value):
        return None if isinstance(value, float) and math.isinf(value) else value

    return {
        "reference_prefix_tokens": REFERENCE_PREFIX_TOKENS,
        "profiles": [
            {
                "name": profile.name,
                "block_size": profile.block_size,
                "block_bytes": profile.block_bytes,
                "prefill_seconds_per_token": profile.prefill_seconds_per_token,
                "assumptions": list(profile.assumptions),
                "crossovers": [
                    {key: finite(value) for key, value in row._asdict().items() if key != "profile"}
                    for row in crossovers(profile)
                ],
            }
            for profile in profiles
        ],
        "literature": {
            "source": LITERATURE_SOURCE,
            "claim": LITERATURE_CLAIM,
            "nvme_crossover_tokens": LITERATURE_NVME_CROSSOVER_TOKENS,
        },
        "reference": {
            "profile": reference.name,
            "tier": reference_tier,
            "bandwidth_sweep": [
                {"bytes_per_second": bandwidth, "crossover_tokens": finite(tokens)}
                for bandwidth, tokens in bandwidth_sweep(reference, reference_tier, GPU_BANDWIDTH_SWEEP)
            ],
            "to_reach_literature": {
                key: finite(value)
                for key, value in to_reach(reference, reference_tier, LITERATURE_NVME_CROSSOVER_TOKENS)
                ._asdict()
                .items()
            },
        },
    }


def _seconds(value: float) -> str:
    if math.isinf(value):
        return "never"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value * 1e9:.3g} ns"


def _rate(bytes_per_second: float) -> str:
    return "inf" if math.isinf(bytes_per_second) else f"{bytes_per_second / 1e9:.3g} GB/s"


def _bytes(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.3g} MiB" if num_bytes >= 2**20 else f"{num_bytes / 1024:.3g} KiB"


def _tokens(tokens: float) -> str:
    if math.isinf(tokens):
        return "never"
    return f"{tokens:,.0f}" if tokens >= 100 else f"{tokens:.2g}"
