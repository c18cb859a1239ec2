"""What a replica spends per request, in seconds: the cost model of the simulator and the router's load estimate."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..plan.tiers import GPU_DISK_COST, GPU_HOST_COST
from ..tiers.policy import TierCost
from .policy_options import PolicyOptions

TIER_NAMES = ("host", "disk", "remote")  # the order a fetch walks below the device pool

# A fleet-shared store (Mooncake-style, or Redis) one network hop away: 0.5 ms a round trip and
# 5 GB/s, i.e. a 100 Gb/s NIC (RDMA or a tuned TCP stack) at about 40% of line rate. Stated, not
# measured. Break-even for Llama-3-8B at the default prefill is 128 KiB / 60 us = 2.2 GB/s: a store
# slower than that (Redis over a 10-25 GbE TCP link reaches 1-3 GB/s) is never worth fetching from.
REMOTE_COST = TierCost(latency_seconds=5e-4, bytes_per_second=5e9)


@dataclass(frozen=True)
class CostModel:
    """Seconds a replica spends per request. Defaults: Llama-3-8B, bf16, one H100 (about 17k prefill tok/s).

    Fetching a prefix's KV from a tier below the pool costs latency + bytes / bandwidth
    (tiers/policy.TierCost). Host and disk default to `prefixserve plan tiers`' stated GPU
    profile (plan/tiers.py: pinned DRAM over PCIe 20 GB/s and 10 us, local NVMe 3 GB/s and
    100 us); the remote store to REMOTE_COST above.
    """

    prefill_seconds_per_token: float = 6e-5
    attention_seconds_per_token_pair: float = 1e-9  # each computed token attends to its whole context
    decode_seconds_per_token: float = 0.02  # time between output tokens inside the running batch
    decode_batch_size: float = 16.0  # typical sequences sharing a decode step (GPU share = 1 / this)
    overhead_seconds: float = 0.005  # per request: scheduling, first sampling step
    kv_bytes_per_token: float = 131072.0  # Llama-3-8B bf16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    host_latency_seconds: float = GPU_HOST_COST.latency_seconds
    host_bytes_per_second: float = GPU_HOST_COST.bytes_per_second
    disk_latency_seconds: float = GPU_DISK_COST.latency_seconds
    disk_bytes_per_second: float = GPU_DISK_COST.bytes_per_second
    remote_latency_seconds: float = REMOTE_COST.latency_seconds
    remote_bytes_per_second: float = REMOTE_COST.bytes_per_second
    # The step-level replay (`simulate --pd`, simulator/steps.py) runs decode steps: each costs decode_seconds_per_token
    # plus reading every running sequence's KV at decode_bytes_per_second (H100 HBM3, about 75% of 3.35 TB/s),
    # and a step that carries a chunk of prefill (chunked prefill, vLLM's and SGLang's default) also computes
    # prefill_chunk_tokens of it (8,192: both engines' default chunk on an 80 GB GPU).
    prefill_chunk_tokens: float = 8192.0
    decode_bytes_per_second: float = 2.5e12
    description: str = (
        "default: Llama-3-8B bf16 on one H100, host DRAM over PCIe, NVMe, a 5 GB/s remote store "
        "(estimated, not measured)"
    )

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name != "description" and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"CostModel.{item.name} must be a non-negative number, got {value!r}")
        if self.decode_batch_size < 1:
            raise ValueError(f"CostModel.decode_batch_size must be at least 1, got {self.decode_batch_size}")
        for name in (
            "kv_bytes_per_token",
            "prefill_chunk_tokens",
            "decode_bytes_per_second",
            *(f"{tier}_bytes_per_second" for tier in TIER_NAMES),
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostModel.{name} must be positive, got {getattr(self, name)!r}")

    def tier_costs(self) -> dict[str, TierCost]:
        """Read cost of each tier below the pool, in fetch order (host, disk, remote)."""
        return {
            tier: TierCost(getattr(self, f"{tier}_latency_seconds"), getattr(self, f"{tier}_bytes_per_second"))
            for tier in TIER_NAMES
        }

    def prefill_seconds(self, num_prompt_tokens: int, num_cached_tokens: int) -> float:
        computed = num_prompt_tokens - num_cached_tokens
        # Token p attends to p + 1 positions; sum that over the computed positions [cached, prompt).
        pairs = (num_prompt_tokens * (num_prompt_tokens + 1) - num_cached_tokens * (num_cached_tokens + 1)) / 2
        return (
            self.overhead_seconds
            + computed * self.prefill_seconds_per_token
            + pairs * self.attention_seconds_per_token_pair
        )

    def decode_seconds(self, num_output_tokens: int) -> float:
        return num_output_tokens * self.decode_seconds_per_token

    def decode_step_seconds(self, num_context_tokens: float) -> float:
        """One decode step of a batch whose sequences hold `num_context_tokens` in all (the step-level replay)."""
        return (
            self.decode_seconds_per_token + num_context_tokens * self.kv_bytes_per_token / self.decode_bytes_per_second
        )

    def decode_work_seconds(self, num_output_tokens: int) -> float:
        return num_output_tokens * self.decode_seconds_per_token / self.decode_batch_size

    def request_seconds(self, num_prompt_tokens: int, num_hit_tokens: int, num_output_tokens: int) -> float:
        """A routed request's estimated work on its replica (a router's load), its hit capped at its prompt."""
        return self.prefill_seconds(
            num_prompt_tokens, min(num_hit_tokens, num_prompt_tokens)
        ) + self.decode_work_seconds(num_output_tokens)

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"cost model file {path} does not exist; write one with a calibrate run") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error.msg}, line {error.lineno})") from None
        known = {item.name for item in fields(cls)}
        if not isinstance(body, dict):
            raise ValueError(f"{path}: a cost model is a JSON object of {sorted(known)}")
        if set(body) - known:
            raise ValueError(
                f"{path}: unknown cost model field(s) {sorted(set(body) - known)}; known fields are {sorted(known)}"
            )
        return cls(**body)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")


def policy_options_for(cost: CostModel, seed: int = 0) -> PolicyOptions:
    """kv_aware weights scaled to a cost model, so scaling every cost cannot change a routing decision.

    A missed prompt token is worth 3x its prefill time (recomputed blocks also
    duplicate KV cached elsewhere, and the session's later turns follow it);
    the balance slack is 4,096 tokens' worth of prefill (49,152 until the random
    sweep widened: a guard that waited that long let hot prefixes queue up to 3 s
    on short-prompt shapes, where every other policy's p99 was near 1 s). Fetches
    from the tiers below the pool are priced as the engine's planner prices them.
    """
    per_token = cost.prefill_seconds_per_token
    return PolicyOptions(
        seed=seed,
        miss_token_seconds=3 * per_token,
        balance_slack_seconds=4096 * per_token,
        prefill_seconds_per_token=per_token,
        kv_bytes_per_token=cost.kv_bytes_per_token,
        tier_costs=cost.tier_costs(),
    )
