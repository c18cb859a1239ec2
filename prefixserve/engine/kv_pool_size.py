"""How big the KV pool is, and so how long a sequence the engine serves: sized once at start-up.

    budget (kv_cache_memory_bytes; CPU: 2 GiB; CUDA: measured free memory x gpu_memory_utilization)
      / (KV bytes per token x block_size)                 -> blocks (at least 2)
    max_model_len: the operator's, or the model's context, cut to what the pool holds, so one
    request of max_model_len tokens always fits the pool alone and is never preempted forever

A model with sliding-window layers shorter than its context keeps their K/V in a pool of its own
(cache/window_slots.py) of `share` x blocks, share = 2 x (window + a step's tokens) / max_model_len (at most
1): each running request needs its window and a chunk there, and as much again keeps recent windows for
hits. The budget is split so both fit: blocks = budget / (block bytes of the full layers + share x those of
the window layers); more blocks than one pool for all layers would have.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..cache.window_slots import WindowSlots
from ..config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from ..model import kernels
from ..model.weights.quantized_model import weight_memory
from .device import cpu_has_fast_bfloat16, measure_cuda_kv_budget
from .runner import kv_bytes_per_token


class PoolSize(NamedTuple):
    num_blocks: int
    bytes_per_token: int
    max_model_len: int
    note: str  # for the start-up summary: how max_model_len was capped, or ""
    block_size: int = 16
    num_window_slots: int = 0  # blocks of the window layers' own pool; 0: they hold every block
    window_bytes_per_token: int = 0  # the window layers' part of bytes_per_token

    @property
    def num_bytes(self) -> int:
        """The KV pool's memory: every block's full layers, and the window layers' slots."""
        full_bytes = self.bytes_per_token - (self.window_bytes_per_token if self.num_window_slots else 0)
        return self.block_size * (self.num_blocks * full_bytes + self.num_window_slots * self.window_bytes_per_token)


def size_kv_pool(config: EngineConfig, loaded, device: torch.device, dtype: torch.dtype) -> PoolSize:
    """The pool for the configured or measured budget; ValueError names the option to change."""
    max_model_len = resolve_max_model_len(config, loaded.config.max_context_len)
    block_size = config.block_size
    bytes_per_token = kv_bytes_per_token(loaded.config, dtype)
    budget = kv_budget(config, loaded, device, dtype, max_model_len)
    num_blocks, num_slots, window_bytes = _split(config, loaded.config, dtype, budget, max_model_len)
    if num_blocks < 2:
        raise ValueError(
            f"a KV budget of {budget} bytes holds {num_blocks} blocks of {block_size} tokens "
            f"({bytes_per_token} bytes a token); raise kv_cache_memory_bytes"
        )
    sized = PoolSize(num_blocks, bytes_per_token, max_model_len, "", block_size, num_slots, window_bytes)
    pool_tokens = num_blocks * block_size
    if max_model_len <= pool_tokens:
        return sized
    if config.max_model_len is not None:
        needed = -(-max_model_len // block_size) * block_size * bytes_per_token
        raise ValueError(
            f"max_model_len={max_model_len} does not fit the KV pool: a budget of {budget} bytes "
            f"(kv_cache_memory_bytes) holds {pool_tokens} tokens; raise kv_cache_memory_bytes to at "
            f"least {needed} or use max_model_len <= {pool_tokens}"
        )
    return sized._replace(
        max_model_len=pool_tokens, note=f" (capped from the model's {max_model_len} to what the KV pool holds)"
    )


def window_slot_need(window: int, config: EngineConfig) -> int:
    """Slots one running request can hold at once: its window and a step's chunk, both ends mid-block."""
    return -(-(window - 1 + config.max_num_batched_tokens) // config.block_size) + 2


def _split(config: EngineConfig, model_config, dtype: torch.dtype, budget: int, max_model_len: int):
    """(blocks, window layers' slots (0: none of their own), the window layers' bytes a token)."""
    block_size = config.block_size
    per_layer = kv_bytes_per_token(model_config, dtype) // model_config.num_hidden_layers * block_size
    windows = [model_config.window_of(i) for i in range(model_config.num_hidden_layers)]
    num_window = sum(window is not None for window in windows)
    window = model_config.sliding_window
    if not config.window_kv_release or not num_window or window >= max_model_len:
        return budget // (per_layer * model_config.num_hidden_layers), 0, 0
    need = window_slot_need(window, config)
    share = min(1.0, 2 * need * block_size / max_model_len)
    num_full = model_config.num_hidden_layers - num_window
    num_blocks = int(budget // (per_layer * (num_full + share * num_window)))
    num_slots = min(num_blocks, max(2 * need, int(share * num_blocks)))
    if num_full and num_slots * per_layer * num_window + num_blocks * per_layer * num_full > budget:
        num_blocks = (budget - num_slots * per_layer * num_window) // (per_layer * num_full)
    window_bytes = per_layer // block_size * num_window
    if num_slots >= num_blocks:  # no smaller: one pool for every layer
        return budget // (per_layer * model_config.num_hidden_layers), 0, 0
    return num_blocks, num_slots, window_bytes


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


def window_slots_for(cache, pool: PoolSize, model_config) -> Optional[WindowSlots]:
    """The window layers' own pool where the size gives them one, following the radix cache's blocks."""
    if not pool.num_window_slots:
        return None
    slots = WindowSlots(pool.num_blocks, pool.num_window_slots, model_config.sliding_window, pool.block_size)
    cache.pool.on_free = lambda block: slots.drop(block.block_id)
    cache.on_merge = lambda duplicate, kept: slots.merge(duplicate.block_id, kept.block_id)
    return slots


def _window_note(pool: PoolSize) -> str:
    if not pool.num_window_slots:
        return ""
    return f", the sliding-window layers' K/V in {pool.num_window_slots} blocks of their own"


def startup_summary(
    config, version, dtype: torch.dtype, device: torch.device, numerics: str, pool: PoolSize, attention: str
) -> str:
    """The start-up line: model, dtype, device, weights, KV pool, max_model_len, the attention backend."""
    block_size, num_blocks = config.block_size, pool.num_blocks
    memory = weight_memory(version.model)
    quantized = version.weights != "float"  # float32 activations by design (model/weights/quantized_linear.py)
    summary = (
        f"model {version.name} ({version.config.architecture}), {dtype} on {device}; "
        f"{memory.describe()}; KV {pool.bytes_per_token} bytes/token; "
        f"{num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens fit "
        f"({pool.num_bytes / 2**20:.0f} MiB{_window_note(pool)}); "
        f"max_model_len {version.max_model_len}{pool.note}; "
        f"prefix caching {'on' if config.enable_prefix_caching else 'off'}; numerics {numerics}; attention {attention}"
    )
    if device.type == "cpu":
        summary += "; " + kernels.describe()
    if dtype == torch.float32 and device.type == "cpu" and cpu_has_fast_bfloat16() and not quantized:
        summary += (
            "; this CPU has bf16 instructions: dtype bfloat16 runs the workload suite 1.25-1.6x faster, and cache "
            "hits never change its greedy outputs either (batch-invariant; the default on such CPUs)"
        )
    return summary
