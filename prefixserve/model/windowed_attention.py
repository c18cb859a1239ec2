"""Sliding-window attention on the pure-PyTorch path: a row at position p reads keys (p - window, p].

Where the compiled kernel is built it computes windows itself (csrc/paged_causal.cpp). Without it, a
sliding-window layer whose step has a row that cannot see its whole context comes here: each sequence's rows
over the keys of their windows, gathered from the block table from the lowest row's first key (keys below it
are never read), with a mask for each row's own range. Each row's result is the reference's; in bf16 its
rounding may depend on the chunk it is in (the compiled kernel's does not).

    sequence of 10 keys, window 4, this step's rows at positions 7..9:
        keys read  4 5 6 7 8 9        row 7: 4..7   row 8: 5..8   row 9: 6..9
"""

from __future__ import annotations

import torch

from .attention_metadata import AttentionMetadata


def windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, window: int) -> torch.Tensor:
    from .attention import _attend_rows  # the row attention of the plan path, with a mask

    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_list):
        start, end = starts[i], starts[i + 1]
        if start == end:
            continue
        positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        lowest = max(0, int(positions[0]) + 1 - window)
        key_positions = torch.arange(lowest, seq_len, device=q.device)
        table = meta.block_tables[i]
        slots = table.index_select(0, key_positions // block_size) * block_size + key_positions % block_size
        live = (key_positions[None, :] <= positions[:, None]) & (key_positions[None, :] > positions[:, None] - window)
        mask = torch.zeros(live.shape, dtype=q.dtype, device=q.device).masked_fill_(~live, float("-inf"))
        # _attend_rows folds a KV group's query heads into the query axis, row by row: one mask row per head
        mask = mask.repeat_interleave(group, dim=0)[None, None]
        out[start:end] = _attend_rows(q[start:end], flat_k.index_select(0, slots), flat_v.index_select(0, slots),
                                      scale, mask=mask)[0]
    return out
