"""Batch-invariant paged attention for bfloat16 on CPU: a token's output is bit-identical whatever
else is in the step and however its sequence was split into prefill chunks (issue 15).

PyTorch's CPU flash kernel rounds differently with the shape of a call: 64 or more query rows may
switch it to packed oneDNN micro-kernels, 2 or 3 query rows to another gemm than 4 to 63, `is_causal`
trims each query block's keys, and the length of the last key block (keys mod 512) changes the
order of its sums, masked keys included; the plan's log-sum-exp merges (shared prefix, in-place
bodies) also round each part to bf16. Measured (benchmarks/batch_invariance.py and the kernel
alone), a row comes out the same whenever its call has this shape:

  * an ENTRY is rows of one sequence with their KV group's query heads folded into the query
    axis, 4 to 32 query rows (never packed; 2 or 3 take another gemm): with 2 heads a group,
    2 to 16 rows, a decode's row twice;
  * a row at position p reads exactly the keys [0, ceil64(p + 1)) of its sequence, masked
    causally: the key count is a function of p alone, so rows of one 64-position span share a call:

    chunk rows at positions 100..229    calls: 100..127 over keys [0, 128)   (2 entries of 14)
                                               128..191 over keys [0, 192)   (4 entries of 16)
                                               192..229 over keys [0, 256)   (3 entries of 13)
    a decode at position 300            keys [0, 320), with the decodes of 256..319

A chunk's keys are gathered once and each call reads a prefix of them; decodes are grouped by
key count. The price: up to KEY_MULTIPLE - 1 masked keys a row, a call per 64 positions, and
each decode computed twice with 2 heads a group (benchmarks/bf16_step_time.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KEY_MULTIPLE = 64     # a row at position p reads ceil(p + 1) keys to this multiple: fewer calls vs fewer masked keys
MIN_FOLDED_ROWS = 4   # query rows per entry: 2 or 3 take another gemm (measured with 1, 2 and 3 heads a group)
MAX_FOLDED_ROWS = 32  # query rows per entry: under the 64 at which the kernel may pack


@dataclass
class InvariantCall:
    """Entries of `rows_per_entry` query rows attending over the first `num_keys` of gathered key slots."""

    rows: torch.Tensor     # int64 [entries * rows_per_entry]: row of q of each query row (padding repeats)
    keep: torch.Tensor     # int64: which of those are real (first occurrence), in the order of `targets`
    targets: torch.Tensor  # int64: the q rows they answer
    slots: torch.Tensor    # int64 [>= num_keys] shared by a chunk's calls, or [entries, num_keys] (decodes)
    visible: torch.Tensor  # bool [entries * rows_per_entry, num_keys]
    rows_per_entry: int
    num_keys: int


def _ceil(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def invariant_calls(meta, block_size: int, group: int) -> list[InvariantCall]:
    """The step's calls: a chunk's rows by 64-position span, the decodes by key count."""
    device = meta.block_tables.device
    min_rows = -(-MIN_FOLDED_ROWS // group)  # rows (each `group` query rows) an entry needs
    max_rows = max(min_rows, MAX_FOLDED_ROWS // group)
    calls, decodes_by_keys = [], {}
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
        first_row, past = start, seq_len - query_len
        start += query_len
        if query_len == 1:
            decodes_by_keys.setdefault(_ceil(seq_len, KEY_MULTIPLE), []).append(i)
            continue
        chunk_keys = torch.arange(_ceil(seq_len, KEY_MULTIPLE), device=device)
        slots = _slots(meta, i, chunk_keys.clamp(max=seq_len - 1), block_size)  # padding reads a written slot
        position = past
        while position < seq_len:
            span_end = min(_ceil(position + 1, KEY_MULTIPLE), seq_len)  # positions sharing a key count
            calls.append(_chunk_call(position, span_end, first_row - past, slots, min_rows, max_rows, device))
            position = span_end
    for num_keys, ids in decodes_by_keys.items():
        calls.append(_decode_call(meta, ids, num_keys, block_size, min_rows, device))
    return calls


def _chunk_call(first: int, end: int, row_of_position_0: int, slots: torch.Tensor, min_rows: int, max_rows: int,
                device) -> InvariantCall:
    """Rows at positions first..end-1 (one span), in equal entries of min_rows to max_rows rows."""
    count = end - first
    num_entries = -(-count // max_rows)
    per_entry = max(min_rows, -(-count // num_entries))
    positions = []
    for entry_start in range(first, end, per_entry):
        entry = list(range(entry_start, min(entry_start + per_entry, end)))
        positions += entry + [entry[-1]] * (per_entry - len(entry))  # padding repeats the last row
    real = [index for index, p in enumerate(positions) if index == 0 or p != positions[index - 1]]
    position_tensor = torch.tensor(positions, dtype=torch.int64, device=device)
    num_keys = _ceil(first + 1, KEY_MULTIPLE)
    keys = torch.arange(num_keys, device=device)
    rows = position_tensor + row_of_position_0
    return InvariantCall(rows=rows, keep=torch.tensor(real, dtype=torch.int64, device=device), targets=rows[real],
                         slots=slots, visible=keys[None, :] <= position_tensor[:, None], rows_per_entry=per_entry,
                         num_keys=num_keys)


def _decode_call(meta, decode_ids: list[int], num_keys: int, block_size: int, min_rows: int,
                 device) -> InvariantCall:
    """Decodes of one key count, each an entry of its row repeated min_rows times (with 2 heads a
    group, twice: 2 query rows would take another gemm than 4; with 4 or more, once)."""
    ids = torch.tensor(decode_ids, dtype=torch.int64, device=device)
    lens = meta.seq_lens.index_select(0, ids)
    keys = torch.arange(num_keys, device=device)
    visible = keys[None, :] < lens[:, None]
    positions = torch.where(visible, keys, lens[:, None] - 1)  # padding reads the own, written, slot
    tables = meta.block_tables.index_select(0, ids)
    slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
    rows = meta.query_start_loc.index_select(0, ids)
    keep = torch.arange(0, min_rows * len(ids), min_rows, device=device)
    return InvariantCall(rows=rows.repeat_interleave(min_rows), keep=keep, targets=rows, slots=slots,
                         visible=visible.repeat_interleave(min_rows, dim=0), rows_per_entry=min_rows,
                         num_keys=num_keys)


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
    gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a chunk's keys, read once per layer
    for index, call in enumerate(calls):
        per_entry, num_keys = call.rows_per_entry, call.num_keys
        num_entries = len(call.rows) // per_entry
        mask = masks.get(("invariant", index, q.dtype))
        if mask is None:  # additive, [entries, 1, rows x group, keys]: built once per step, shared by the layers
            additive = torch.zeros(call.visible.shape, dtype=q.dtype).masked_fill(~call.visible, float("-inf"))
            mask = additive.view(num_entries, per_entry, 1, num_keys).expand(-1, -1, group, -1)
            mask = masks[("invariant", index, q.dtype)] = mask.reshape(num_entries, 1, per_entry * group, num_keys)
        query = q.index_select(0, call.rows).view(num_entries, per_entry, num_kv_heads, group, head_dim)
        query = query.transpose(1, 2).reshape(num_entries, num_kv_heads, per_entry * group, head_dim)
        if call.slots.dim() == 1:  # a prefix of one chunk's keys, read by each of the call's entries
            if id(call.slots) not in gathered:
                gathered[id(call.slots)] = (flat_k.index_select(0, call.slots).transpose(0, 1).unsqueeze(0),
                                            flat_v.index_select(0, call.slots).transpose(0, 1).unsqueeze(0))
            chunk_keys, chunk_values = gathered[id(call.slots)]
            keys = chunk_keys[:, :, :num_keys].expand(num_entries, -1, -1, -1)
            values = chunk_values[:, :, :num_keys].expand(num_entries, -1, -1, -1)
        else:
            shape = (num_entries, num_keys, num_kv_heads, head_dim)
            keys = flat_k.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
            values = flat_v.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
        attended, _ = attend(query, keys, values, scale, mask=mask)
        attended = attended.view(num_entries, num_kv_heads, per_entry, group, head_dim).transpose(1, 2)
        attended = attended.reshape(num_entries * per_entry, num_heads, head_dim)
        out.index_copy_(0, call.targets, attended.index_select(0, call.keep))
    return out
