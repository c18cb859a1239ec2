"""Batch-invariant paged attention for bfloat16 on CPU: a token's output is bit-identical whatever
else is in the step and however its sequence was split into prefill chunks (issue 15).

PyTorch's CPU flash kernel rounds differently with the shape of a call: 64 or more query rows may
switch it to packed oneDNN micro-kernels, 2 query rows to another gemm than 4 to 32, `is_causal`
trims each query block's keys, a partial last key block sums in another order; and the plan's
log-sum-exp merges (shared prefix, in-place bodies) round each part to bf16. Measured (see
benchmarks/batch_invariance.py), a row comes out the same only when every call has one shape:

  * an ENTRY is 2 to 32 / group rows of one sequence (decodes: the row and a copy of it), their
    KV group's query heads folded into the query axis: 4 to 32 query rows, never packed;
  * its keys are ALL of the sequence's from position 0, in whole blocks of KEY_SPLIT (the
    kernel's key split), masked causally; extra wholly masked blocks change nothing:

    entry of rows at positions p..p+15:  q [kv_heads, 16 x group, d]
                                         keys [0, ceil512(p + 16))   mask: key <= row position

A chunk's entries are grouped by key count (one call each, its keys gathered once and expanded
over the entries); decodes are grouped by key count too. The price: up to KEY_SPLIT - 1 masked keys per
row, and each decode computed twice (benchmarks/bf16_step_time.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KEY_SPLIT = 512       # the CPU flash kernel's key block for long contexts (kv_split_size)
MAX_FOLDED_ROWS = 32  # query rows per entry: under the 64 at which the kernel may pack


@dataclass
class InvariantCall:
    """Entries of `rows_per_entry` query rows attending over gathered key slots."""

    rows: torch.Tensor   # int64 [entries * rows_per_entry]: row of q of each query row (padding repeats)
    keep: torch.Tensor   # int64: which of those are real (first occurrence), in the order of `targets`
    targets: torch.Tensor  # int64: the q rows they answer
    slots: torch.Tensor  # int64 [num_keys] shared by every entry, or [entries, num_keys] per entry
    visible: torch.Tensor  # bool [entries * rows_per_entry, num_keys]
    rows_per_entry: int


def _ceil(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def invariant_calls(meta, block_size: int, group: int) -> list[InvariantCall]:
    """The step's calls: per prefill chunk one per key count, and one per key count for the decodes."""
    device = meta.block_tables.device
    max_rows_per_entry = max(2, MAX_FOLDED_ROWS // group)
    calls, decode_ids = [], []
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
        first_row, past = start, seq_len - query_len
        start += query_len
        if query_len == 1:
            decode_ids.append(i)
            continue
        # Equal entries, as few as fit: 20 rows are two entries of 10, not 16 + 4 padded to 16
        # (any 2 to max rows per entry round alike).
        num_entries = -(-query_len // max_rows_per_entry)
        rows_per_entry = -(-query_len // num_entries)
        by_num_keys: dict[int, list[int]] = {}  # key count -> offsets in the chunk of its entries' rows
        for entry_start in range(0, query_len, rows_per_entry):
            entry_end = min(entry_start + rows_per_entry, query_len)
            num_keys = _ceil(past + entry_end, KEY_SPLIT)
            offsets = list(range(entry_start, entry_end))
            offsets += [entry_end - 1] * (rows_per_entry - len(offsets))
            by_num_keys.setdefault(num_keys, []).extend(offsets)
        for num_keys, offsets in by_num_keys.items():
            offset_tensor = torch.tensor(offsets, dtype=torch.int64, device=device)
            keys = torch.arange(num_keys, device=device)
            real = [index for index, offset in enumerate(offsets) if index == 0 or offset != offsets[index - 1]]
            calls.append(InvariantCall(
                rows=offset_tensor + first_row,
                keep=torch.tensor(real, dtype=torch.int64, device=device),
                targets=offset_tensor[real] + first_row,
                slots=_slots(meta, i, keys.clamp(max=seq_len - 1), block_size),
                visible=keys[None, :] <= (offset_tensor + past)[:, None],
                rows_per_entry=rows_per_entry))
    by_num_keys = {}  # decodes grouped by key count: a short one never reads a long one's padding
    for i in decode_ids:
        by_num_keys.setdefault(_ceil(meta.seq_lens_list[i], KEY_SPLIT), []).append(i)
    calls += [_decode_call(meta, ids, block_size, device) for ids in by_num_keys.values()]
    return calls


def _decode_call(meta, decode_ids: list[int], block_size: int, device) -> InvariantCall:
    """Every decode as a two-row entry (its row twice: two query rows would take another gemm)."""
    ids = torch.tensor(decode_ids, dtype=torch.int64, device=device)
    lens = meta.seq_lens.index_select(0, ids)
    num_keys = _ceil(max(meta.seq_lens_list[i] for i in decode_ids), KEY_SPLIT)
    keys = torch.arange(num_keys, device=device)
    visible = keys[None, :] < lens[:, None]
    positions = torch.where(visible, keys, lens[:, None] - 1)  # padding reads the own, written, slot
    tables = meta.block_tables.index_select(0, ids)
    slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
    rows = meta.query_start_loc.index_select(0, ids)
    return InvariantCall(rows=rows.repeat_interleave(2), keep=torch.arange(0, 2 * len(ids), 2, device=device),
                         targets=rows, slots=slots, visible=visible.repeat_interleave(2, dim=0), rows_per_entry=2)


def _slots(meta, i: int, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = meta.block_tables[i]
    return table.index_select(0, positions // block_size) * block_size + positions % block_size


def invariant_attention(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, calls: list[InvariantCall],
                        masks: dict, scale: float, attend) -> torch.Tensor:
    """Attention of q [T, heads, d] over the flat caches [slots, kv_heads, d] by `calls`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = flat_k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for index, call in enumerate(calls):
        per_entry = call.rows_per_entry
        num_entries = len(call.rows) // per_entry
        num_keys = call.visible.shape[1]
        mask = masks.get(("invariant", index, q.dtype))
        if mask is None:  # additive, [entries, 1, rows x group, keys]: built once per step, shared by the layers
            additive = torch.zeros(call.visible.shape, dtype=q.dtype).masked_fill(~call.visible, float("-inf"))
            mask = additive.view(num_entries, per_entry, 1, num_keys).expand(-1, -1, group, -1)
            mask = masks[("invariant", index, q.dtype)] = mask.reshape(num_entries, 1, per_entry * group, num_keys)
        query = q.index_select(0, call.rows).view(num_entries, per_entry, num_kv_heads, group, head_dim)
        query = query.transpose(1, 2).reshape(num_entries, num_kv_heads, per_entry * group, head_dim)
        if call.slots.dim() == 1:  # one sequence's keys, read by each of its entries
            keys = flat_k.index_select(0, call.slots).transpose(0, 1).unsqueeze(0).expand(num_entries, -1, -1, -1)
            values = flat_v.index_select(0, call.slots).transpose(0, 1).unsqueeze(0).expand(num_entries, -1, -1, -1)
        else:
            shape = (num_entries, num_keys, num_kv_heads, head_dim)
            keys = flat_k.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
            values = flat_v.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
        attended, _ = attend(query, keys, values, scale, mask=mask)
        attended = attended.view(num_entries, num_kv_heads, per_entry, group, head_dim).transpose(1, 2)
        attended = attended.reshape(num_entries * per_entry, num_heads, head_dim)
        out.index_copy_(0, call.targets, attended.index_select(0, call.keep))
    return out
