"""Attention of masked or capped scores on the pure-PyTorch path: sliding windows, where a row at position p
reads keys (p - window, p], and Gemma 2's soft cap, where a score s becomes softcap * tanh(s / softcap).

Where the compiled kernel is built it computes both itself (csrc/paged_causal.cpp). Without it, a layer whose
step has a row that cannot see its whole context, or whose scores are capped, comes here: each sequence's rows
over the keys they may see, gathered from the block table from the lowest row's first key (keys below it are
never read), with a mask for each row's own range. Each row's result is the reference's; in bf16 its rounding
may depend on the chunk it is in (the compiled kernel's does not).

    sequence of 10 keys, window 4, this step's rows at positions 7..9:
        keys read  4 5 6 7 8 9        row 7: 4..7   row 8: 5..8   row 9: 6..9
"""

from __future__ import annotations

from typing import Optional

import torch

from .metadata import AttentionMetadata

MASKED_ROWS = "masked rows"  # the plan of a step the pure-PyTorch backends answer here


def needs_masked_rows(meta: AttentionMetadata, window: Optional[int], softcap: Optional[float]) -> bool:
    """Whether a step's layer with this window and cap comes here: capped scores, or a row that cannot see
    its whole context."""
    return softcap is not None or (window is not None and max(meta.seq_lens_list, default=0) > window)


def windowed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: Optional[int],
    softcap: Optional[float] = None,
) -> torch.Tensor:
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_list):
        start, end = starts[i], starts[i + 1]
        if start == end:
            continue
        positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        lowest = max(0, int(positions[0]) + 1 - window) if window is not None else 0
        key_positions = torch.arange(lowest, seq_len, device=q.device)
        table = meta.block_tables[i]
        slots = table.index_select(0, key_positions // block_size) * block_size + key_positions % block_size
        live = key_positions[None, :] <= positions[:, None]
        if window is not None:
            live &= key_positions[None, :] > positions[:, None] - window
        out[start:end] = _rows(
            q[start:end], flat_k.index_select(0, slots), flat_v.index_select(0, slots), live, scale, softcap
        )
    return out


def _rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    live: torch.Tensor,
    scale: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """q [R, H, d] over keys, values [L, KH, d] where live [R, L]; the scores in float32, as the eager reference."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, L, d]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1).float()
    scores = torch.matmul(q.transpose(0, 1).float(), keys.transpose(1, 2)) * scale  # [H, R, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~live[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, values).transpose(0, 1).to(q.dtype)
