"""Compiled attention (csrc/paged_causal.cpp): exists because it is both the fastest path and exact by design.

Every row of the step goes to the kernel in one call, prefill chunks and decodes alike, read in place through
the block tables (no gather, no merge; decodes sharing a cached prefix share each transposed key tile). Each
row's sums run in an order of its own, so in either dtype a row's attention bits do not depend on the batch or
the chunking; sliding windows and Gemma 2's score cap are the kernel's own arguments. It needs no plan.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backend import AttentionBackend
from .metadata import AttentionMetadata


class CompiledAttention(AttentionBackend):
    name = "compiled"

    def __init__(self, kernel) -> None:
        self.kernel = kernel  # the loaded variant's paged_causal (kernels.causal_kernel_for)

    def plan(
        self,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
    ) -> None:
        return None

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        plan: object = None,
        k: Optional[torch.Tensor] = None,
        v: Optional[torch.Tensor] = None,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
        return self.kernel(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            window or 0,
            softcap or 0.0,
        )
