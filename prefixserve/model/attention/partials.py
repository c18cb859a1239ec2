"""Attention over one key set with its log-sum-exp: the partial result every pure-PyTorch path merges.

Softmax attention over a key set is the log-sum-exp merge of attention over its parts, so the cascade
(cascade.py) and the batch-invariant path (invariant.py) compute parts here and merge them. On the CPU
PyTorch's flash kernel returns the log-sum-exp itself; elsewhere plain matmuls in float32 do.
"""

from __future__ import annotations

from typing import Optional

import torch

CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Q, d], float32 log-sum-exp [B, H, Q]) of q [B, H, Q, d] over k, v [B, KH, K, d].

    KH may divide H (grouped-query); `mask` is additive, in q's dtype, broadcastable to [B, 1, Q, K].
    """
    if q.device.type == "cpu" and CPU_FLASH is not None:
        return CPU_FLASH(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.matmul((scores - lse[..., None]).exp(), v.float()).to(q.dtype)
    return out, lse
