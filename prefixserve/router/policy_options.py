"""The options of every routing policy, validated once: seeds, the hash ring, and kv_aware's prices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from prefixserve.tiers.policy import TierCost


@dataclass(frozen=True)
class PolicyOptions:
    seed: int = 0  # power_of_two's sampler
    hash_prefix_blocks: int = 4  # consistent_hash: the first k blocks name the ring position
    virtual_nodes: int = 64  # consistent_hash: ring points per replica
    # kv_aware: what one prompt token that misses is worth, in seconds of waiting. Its own prefill
    # time (6e-5 s on an H100 for an 8B model) undervalues it: the recomputed blocks duplicate KV
    # cached elsewhere, crowding this replica's cache, and the session's later turns follow it.
    miss_token_seconds: float = 1.8e-4  # 3x the prefill time
    balance_threshold: float = 1.5  # kv_aware: pass over replicas whose queue > mean queue x threshold + slack
    # About 48k tokens of prefill, more than an agent session's whole transcript: a guard that fires
    # below that moves sessions whose history costs more to recompute than the wait it saves (the
    # across-load test in tests/test_router_simulate_load.py lost hit rate to consistent hashing at
    # light load with 8k tokens).
    balance_slack_seconds: float = 3.0
    # kv_aware: a missing token on a replica whose pool running requests hold `usage` of costs
    # miss_token_seconds x (1 + kv_usage_weight x usage): what a full pool computes, it caches by evicting
    # prefixes others will want (or, quite full, caches nothing), so new prefixes go where room is. Read
    # from the view's `kv_cache_usage` (vLLM's kv_cache_usage_perc) where it has one. Without it, random
    # shapes with long answers lost 2-6 points of hit rate to llm-d's scorer, whose KV-utilisation term
    # steers by the same signal (benchmarks/trace_families.py).
    kv_usage_weight: float = 3.0
    # kv_aware's balance guard moves a request only where the wait it saves pays for its extra recompute
    # this many times over as well: a session moved recomputes its history now and leaves a copy behind.
    move_cost_factor: float = 0.5
    # kv_aware: each second of prefill routed to a replica lately (decayed by 1 / (4 x replicas) a
    # decision) adds this many seconds to its cost. A request brings its session's later turns along,
    # so a replica that took many new sessions a moment ago will be busy soon even while its queue is
    # empty; without this, sessions that start close together pile onto the replica holding their
    # system prompt and queue behind each other for their whole lives.
    recent_work_weight: float = 0.1
    # kv_aware prices a fetch from a tier below the pool as the engine's planner does (tiers/policy.py);
    # with no tier costs (or kv_bytes_per_token 0) a lower-tier run is ignored, as if recomputed.
    prefill_seconds_per_token: float = 6e-5
    kv_bytes_per_token: float = 0.0
    tier_costs: Mapping[str, TierCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hash_prefix_blocks < 1 or self.virtual_nodes < 1:
            raise ValueError("hash_prefix_blocks and virtual_nodes must be at least 1")
        if (
            self.miss_token_seconds < 0
            or self.balance_threshold < 1
            or self.balance_slack_seconds < 0
            or self.recent_work_weight < 0
            or self.kv_usage_weight < 0
            or self.move_cost_factor < 0
        ):
            raise ValueError(
                "kv_aware needs miss_token_seconds >= 0, balance_threshold >= 1, "
                "balance_slack_seconds >= 0, recent_work_weight >= 0, kv_usage_weight >= 0, "
                "move_cost_factor >= 0"
            )
        if self.prefill_seconds_per_token <= 0 or self.kv_bytes_per_token < 0:
            raise ValueError("kv_aware needs prefill_seconds_per_token > 0 and kv_bytes_per_token >= 0")
