"""The attention backend interface: what an engine chooses once, plans once a step and calls once a layer.

An engine picks one backend for its KV pool (paged.choose_backend, from the pool's dtype and device and the
engine's batch_invariant), as mini-sglang's BaseAttnBackend or vLLM's attention backends are picked:

    compiled.py   CompiledAttention   csrc/paged_causal.cpp: every row in one call, read in place; a row's
                                       bits are its own in either dtype (where the kernels are built)
    invariant.py  InvariantAttention  pure PyTorch, bf16 on CPU: calls shaped so a row's bits are its own
    cascade.py    CascadeAttention    pure PyTorch, the reference: shared prefixes read once, runs in place

Each step the model asks the backend for a plan per KV pool and sliding window (`plan`), and every layer
reading that pool hands the plan to `forward`. A plan is the backend's own business: the compiled kernel
needs none, the others say which key slots each call reads. The pure-PyTorch backends send a step whose
rows cannot all see their whole context, or whose scores are capped, to windowed.py's masked rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from .metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention of a step's query rows over a KV pool (the layout: paged.py)."""

    name: str  # "compiled", "invariant", "cascade": what /v1/server_info and the logs call it

    @abstractmethod
    def plan(
        self,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
    ) -> object:
        """The step's plan for layers reading `k_cache`'s pool with this window and score cap: built once,
        read by each of those layers."""

    @abstractmethod
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
        """Attention of q [num_tokens, num_heads, head_dim] over the paged cache; returns q's shape.

        `k`, `v` [num_tokens, num_kv_heads, head_dim] are this step's own keys and values, already written to
        the cache; a backend may read them directly. Without a `plan` one is built for this call. With a
        sliding `window` a row at position p reads only keys (p - window, p]; with a `softcap` (Gemma 2) each
        score s is softcap * tanh(s / softcap) before the softmax."""


@dataclass
class LayerStep:
    """What a layer needs of this step's attention: the backend, the metadata of the pool it reads, the plan."""

    backend: AttentionBackend
    meta: AttentionMetadata
    plan: object

    def attend(self, q, k_cache, v_cache, scale: float, k=None, v=None, window=None, softcap=None) -> torch.Tensor:
        return self.backend.forward(q, k_cache, v_cache, self.meta, scale, self.plan, k, v, window, softcap)
