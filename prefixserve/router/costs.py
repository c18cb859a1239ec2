"""What a replica spends per request, in seconds: the cost model of the simulator and the router's load estimate."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .policies import PolicyOptions


@dataclass(frozen=True)
class CostModel:
    """Seconds a replica spends per request. Defaults: Llama-3-8B, bf16, one H100 (about 17k prefill tok/s)."""

    prefill_seconds_per_token: float = 6e-5
    attention_seconds_per_token_pair: float = 1e-9  # each computed token attends to its whole context
    decode_seconds_per_token: float = 0.02  # time between output tokens inside the running batch
    decode_batch_size: float = 16.0  # typical sequences sharing a decode step (GPU share = 1 / this)
    overhead_seconds: float = 0.005  # per request: scheduling, first sampling step
    description: str = "default: Llama-3-8B bf16 on one H100 (estimated, not measured)"

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name != "description" and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"CostModel.{item.name} must be a non-negative number, got {value!r}")
        if self.decode_batch_size < 1:
            raise ValueError(f"CostModel.decode_batch_size must be at least 1, got {self.decode_batch_size}")

    def prefill_seconds(self, num_prompt_tokens: int, num_cached_tokens: int) -> float:
        computed = num_prompt_tokens - num_cached_tokens
        # Token p attends to p + 1 positions; sum that over the computed positions [cached, prompt).
        pairs = (num_prompt_tokens * (num_prompt_tokens + 1) - num_cached_tokens * (num_cached_tokens + 1)) / 2
        return (self.overhead_seconds + computed * self.prefill_seconds_per_token
                + pairs * self.attention_seconds_per_token_pair)

    def decode_seconds(self, num_output_tokens: int) -> float:
        return num_output_tokens * self.decode_seconds_per_token

    def decode_work_seconds(self, num_output_tokens: int) -> float:
        return num_output_tokens * self.decode_seconds_per_token / self.decode_batch_size

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
            raise ValueError(f"{path}: unknown cost model field(s) {sorted(set(body) - known)}; "
                             f"known fields are {sorted(known)}")
        return cls(**body)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")


def policy_options_for(cost: CostModel, seed: int = 0) -> PolicyOptions:
    """kv_aware weights scaled to a cost model, so scaling every cost cannot change a routing decision.

    A missed prompt token is worth 3x its prefill time (recomputed blocks also
    duplicate KV cached elsewhere, and the session's later turns follow it);
    the balance slack is 8,192 tokens' worth of prefill.
    """
    per_token = cost.prefill_seconds_per_token
    return PolicyOptions(seed=seed, miss_token_seconds=3 * per_token, balance_slack_seconds=8192 * per_token)
