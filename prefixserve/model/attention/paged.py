"""Paged attention: the KV pool's layout, writing a step's K/V into it, and the backend an engine reads it with.

Cache layout per layer (k_cache and v_cache alike)::

    [num_blocks, block_size, num_kv_heads, head_dim]      flat slot = block_id * block_size + offset

    sequence i, block_table [7, 2, 9], block_size 4, seq_len 10:
        positions 0..3 -> block 7 (slots 28..31), 4..7 -> block 2 (slots 8..11), 8..9 -> block 9 (36, 37)

One step's input is a flat list of tokens: rows query_start_loc[i]:query_start_loc[i+1] belong to
sequence i and are the LAST query_len positions of its context (metadata.py). K/V of this step are
written into the cache first (`write_kv`). Each query sees its sequence's whole PAST (positions before
this step's first token: no mask needed) and, causally, this step's own tokens.

How the cache is read is the backend's (backend.py), chosen once per engine by `choose_backend`: the
compiled kernel where it is built (compiled.py), else on the CPU in bf16 with batch invariance asked for
the invariant path (invariant.py), else the cascade (cascade.py). Batch invariance of a whole step also
needs the linear layers' measured row calls (row_calls.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import causal_kernel_for
from .backend import AttentionBackend
from .cascade import CascadeAttention
from .compiled import CompiledAttention
from .invariant import InvariantAttention
from .metadata import AttentionMetadata
from .partials import CPU_FLASH

# Dtypes whose CPU attention takes the batch-invariant path (invariant.py): in bfloat16 the cascade's
# rounding depends on the batch shape and a cache hit changes greedy tokens.
BATCH_INVARIANT_DTYPES = {torch.bfloat16}


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    first_slot: Optional[int] = None,
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into their slots of the paged cache.

    `first_slot`, when the slots are consecutive from it, turns the scatter into a slice copy.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    if first_slot is not None:
        flat_k[first_slot : first_slot + len(k)] = k
        flat_v[first_slot : first_slot + len(v)] = v
        return
    flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def choose_backend(k_cache: torch.Tensor, batch_invariant: bool = True) -> AttentionBackend:
    """The backend for a pool shaped like `k_cache` (its dtype and device): compiled where the kernel takes the
    cache; else invariant for bf16 on the CPU unless `batch_invariant` is off; else the cascade."""
    kernel = causal_kernel_for(k_cache)
    if kernel is not None:
        return CompiledAttention(kernel)
    cpu = k_cache.device.type == "cpu"
    if batch_invariant and k_cache.dtype in BATCH_INVARIANT_DTYPES and cpu and CPU_FLASH is not None:
        return InvariantAttention()
    return CascadeAttention()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    batch_invariant: bool = True,
) -> torch.Tensor:
    """One call of attention as an engine over this cache would make it (choose_backend, its plan, forward):
    for scripts and tests; a model's step plans once and hands the plan to every layer (backend.LayerStep)."""
    backend = choose_backend(k_cache, batch_invariant)
    return backend.forward(
        q, k_cache, v_cache, meta, scale, backend.plan(meta, k_cache, window, softcap), k, v, window, softcap
    )
