"""How big the KV pool is, and so how long a sequence the engine serves: sized once at start-up.

    budget (kv_cache_memory_bytes; CPU: 2 GiB; CUDA: measured free memory x gpu_memory_utilization)
      / (KV bytes per token x block_size)                 -> blocks (at least 2)
    max_model_len: the operator's, or the model's context, cut to what the pool holds, so one
    request of max_model_len tokens always fits the pool alone and is never preempted forever
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from ..model import kernels
from .device import cpu_has_fast_bfloat16, measure_cuda_kv_budget
from .runner import kv_bytes_per_token


class PoolSize(NamedTuple):
    num_blocks: int
    bytes_per_token: int
    max_model_len: int
    note: str  # for the start-up summary: how max_model_len was capped, or ""


def size_kv_pool(config: EngineConfig, loaded, device: torch.device, dtype: torch.dtype) -> PoolSize:
    """The pool for the configured or measured budget; ValueError names the option to change."""
    max_model_len = resolve_max_model_len(config, loaded.config.max_context_len)
    block_size = config.block_size
    bytes_per_token = kv_bytes_per_token(loaded.config, dtype)
    budget = kv_budget(config, loaded, device, dtype, max_model_len)
    num_blocks = budget // (bytes_per_token * block_size)
    if num_blocks < 2:
        raise ValueError(
            f"a KV budget of {budget} bytes holds {num_blocks} blocks of {block_size} tokens "
            f"({bytes_per_token} bytes a token); raise kv_cache_memory_bytes"
        )
    pool_tokens = num_blocks * block_size
    if max_model_len <= pool_tokens:
        return PoolSize(num_blocks, bytes_per_token, max_model_len, "")
    if config.max_model_len is not None:
        needed = -(-max_model_len // block_size) * block_size * bytes_per_token
        raise ValueError(
            f"max_model_len={max_model_len} does not fit the KV pool: a budget of {budget} bytes "
            f"(kv_cache_memory_bytes) holds {pool_tokens} tokens; raise kv_cache_memory_bytes to at "
            f"least {needed} or use max_model_len <= {pool_tokens}"
        )
    return PoolSize(num_blocks, bytes_per_token, pool_tokens,
                    f" (capped from the model's {max_model_len} to what the KV pool holds)")


def resolve_max_model_len(config: EngineConfig, limit: int) -> int:
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds what the model supports ({limit}); "
            f"use max_model_len <= {limit}"
        )
    return config.max_model_len


def kv_budget(config: EngineConfig, loaded, device: torch.device, dtype: torch.dtype, max_model_len: int) -> int:
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    return measure_cuda_kv_budget(loaded, config, device, dtype, max_model_len)


def startup_summary(engine, pool: PoolSize) -> str:
    """The start-up line: model, dtype, device, weights, KV pool, max_model_len."""
    config, version = engine.config, engine.version
    block_size, num_blocks = config.block_size, pool.num_blocks
    weight_bytes = sum(p.numel() * p.element_size() for p in version.model.parameters())
    summary = (
        f"model {version.name} ({version.config.architecture}), {engine.dtype} on {engine.device}; "
        f"weights {weight_bytes / 2**20:.0f} MiB; KV {pool.bytes_per_token} bytes/token; "
        f"{num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens fit "
        f"({num_blocks * block_size * pool.bytes_per_token / 2**20:.0f} MiB); "
        f"max_model_len {version.max_model_len}{pool.note}; "
        f"prefix caching {'on' if config.enable_prefix_caching else 'off'}; numerics {engine.numerics}"
    )
    if engine.device.type == "cpu":
        summary += "; " + kernels.describe()
    if engine.dtype == torch.float32 and engine.device.type == "cpu" and cpu_has_fast_bfloat16():
        summary += (
            "; this CPU has bf16 instructions: dtype bfloat16 runs the workload suite 1.25-1.6x faster, and cache "
            "hits never change its greedy outputs either (batch-invariant; the default on such CPUs)")
    return summary
