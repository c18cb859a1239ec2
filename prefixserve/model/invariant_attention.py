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

A chunk's keys are gathered once and each call reads a part of them; decodes are grouped by
key count. The price: up to KEY_MULTIPLE - 1 masked keys a row, a call per 64 positions, and
each decode computed twice with 2 heads a group (benchmarks/bf16_step_time.py measures it).

Invariant cascade: keys are cut into SEGMENT_KEYS-key segments at fixed positions. A row at p
reads its k = p // 256 whole segments without a mask and only its TAIL [256k, ceil64(p + 1))
as above, then merges the k + 1 partials (bf16 output, float32 log-sum-exp) in float32, segment
0, 1, ..., tail, one elementwise step a part. A segment held by several sequences (the same
block ids: a prefix-cache hit) is read once for all their rows, packed 4 to 32 query rows an
entry: the kernel rounds a row alike for any such entry, so sharing changes no bit:

    position:   0          256         512        p   ceil64(p + 1)
    row at p:   [segment 0 ][segment 1 ][tail .....|....)
                 shared by every sequence whose blocks hold it   own, causal, masked past p
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .cpu_caps import AVX512, aten_capability, cpu_features, mkl_allows_avx512, onednn_allows

KEY_MULTIPLE = 64     # a row at position p reads ceil(p + 1) keys to this multiple: fewer calls vs fewer masked keys
MIN_FOLDED_ROWS = 4   # query rows per entry: 2 or 3 take another gemm (measured with 1, 2 and 3 heads a group)
MAX_FOLDED_ROWS = 32  # query rows per entry: under the 64 at which the kernel may pack
MAX_GATHERED_ENTRIES = 4  # a segment read by more entries gets its own call, its keys gathered once
SEGMENT_KEYS = 256    # keys [0, 256), [256, 512), ... before a row's own segment: read once by all rows that share them


def measured_here() -> bool:
    """Whether this CPU runs the flash kernel's gemms that the shapes above were measured on: AVX-512
    in ATen, MKL and oneDNN (not capped below it). MKL's AVX2 sgemm rounds other shapes differently
    (measured: MKL_ENABLE_INSTRUCTIONS=AVX2 changes cache-hit outputs), so elsewhere bf16 without the
    compiled kernel is not known to be exact and the engine refuses it (engine/device.py)."""
    return (AVX512 <= cpu_features() and aten_capability() == "AVX512" and mkl_allows_avx512()
            and onednn_allows("AVX512_CORE"))


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
    key_start: int = 0     # the call reads keys [key_start, num_keys): its rows' whole segments come from SegmentCalls


@dataclass
class SegmentCall:
    """Entries of `rows_per_entry` query rows over SEGMENT_KEYS keys, all visible: one segment read
    by the rows of every sequence whose block table holds it (slots [1, S], expanded), or several
    segments of one entry each (slots [entries, S])."""

    rows: torch.Tensor     # int64 [entries * rows_per_entry]: row of q of each query row (padding repeats)
    keep: torch.Tensor     # int64: which of those are real
    targets: torch.Tensor  # int64: index in InvariantPlan.merged_rows of each kept row
    parts: torch.Tensor    # int64: the segment number of each kept row (its place in the merge)
    slots: torch.Tensor    # int64 [1 or entries, SEGMENT_KEYS]
    rows_per_entry: int


@dataclass
class InvariantPlan:
    """A step's calls. A row at position p with k = p // S > 0 merges k segment partials and its
    tail (keys [kS, ceil64(p + 1))) by log-sum-exp in float32, in that order, so its result is a
    function of p alone; a row with k = 0 is its tail call's output."""

    calls: list[InvariantCall]
    segment_calls: list[SegmentCall]
    merged_rows: torch.Tensor   # int64 [M]: q rows whose output is a merge, by k
    merge_index: list[Optional[torch.Tensor]]  # per call: index in merged_rows of its kept rows, None if k = 0
    merge_groups: list[tuple[int, int, int]]   # (k, first, end): merged_rows[first:end] merge k segments and a tail
    num_parts: int              # max k + 1 (the tail is the last part)


def _ceil(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def invariant_calls(meta, block_size: int, group: int) -> InvariantPlan:
    """The step's calls: a chunk's tails by 64-position span, the decodes' tails by key count, and
    each distinct whole segment once for every row that needs it (shared blocks: shared calls)."""
    assert SEGMENT_KEYS % KEY_MULTIPLE == 0 and SEGMENT_KEYS % block_size == 0
    device = meta.block_tables.device
    min_rows = -(-MIN_FOLDED_ROWS // group)  # rows (each `group` query rows) an entry needs
    max_rows = max(min_rows, MAX_FOLDED_ROWS // group)
    blocks_per_segment = SEGMENT_KEYS // block_size
    calls, decodes_by_keys = [], {}
    rows_by_segment: dict[tuple, list[tuple[int, int]]] = {}  # a segment's block ids -> (q row, segment number)
    merged: list[tuple[int, int]] = []  # (k, q row) of each row with k whole segments, k > 0
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
        first_row, past = start, seq_len - query_len
        start += query_len
        table = meta.block_table_lists[i]
        for segment in range((seq_len - 1) // SEGMENT_KEYS):  # rows at positions from (segment + 1) * S read it whole
            block_ids = tuple(table[segment * blocks_per_segment:(segment + 1) * blocks_per_segment])
            first = max(past, (segment + 1) * SEGMENT_KEYS)
            rows_by_segment.setdefault(block_ids, []).extend(
                (first_row + position - past, segment) for position in range(first, seq_len))
        merged.extend((position // SEGMENT_KEYS, first_row + position - past)
                      for position in range(max(past, SEGMENT_KEYS), seq_len))
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
    merged.sort()
    merged_rows = [row for _, row in merged]
    merged_index = {row: index for index, row in enumerate(merged_rows)}
    merge_groups, first = [], 0
    for index, (k, _) in enumerate(merged):
        if index + 1 == len(merged) or merged[index + 1][0] != k:
            merge_groups.append((k, first, index + 1))
            first = index + 1
    merge_index = [torch.tensor([merged_index[row] for row in call.targets.tolist()], dtype=torch.int64, device=device)
                   if call.key_start else None for call in calls]
    segment_calls = _segment_calls(rows_by_segment, merged_index, block_size, min_rows, max_rows, device)
    num_parts = max((call.key_start // SEGMENT_KEYS for call in calls), default=0) + 1
    return InvariantPlan(calls, segment_calls, torch.tensor(merged_rows, dtype=torch.int64, device=device),
                         merge_index, merge_groups, num_parts)


def _segment_calls(rows_by_segment: dict, merged_index: dict, block_size: int, min_rows: int, max_rows: int,
                   device) -> list[SegmentCall]:
    """A call per segment that many entries read (its keys gathered once, expanded), and one call for
    all the others, their keys gathered per entry, entries padded to the longest (any 4 to 32 query
    rows round alike, so neither the padding nor the call a segment lands in changes a row)."""
    offsets = torch.arange(block_size, device=device)

    def segment_slots(block_ids) -> torch.Tensor:
        return (torch.tensor(block_ids, dtype=torch.int64, device=device)[:, None] * block_size + offsets).reshape(-1)

    def build(entries: list[list[tuple[int, int]]], per_entry: int, slots: torch.Tensor) -> SegmentCall:
        rows, keep, targets, parts = [], [], [], []
        for entry in entries:
            for row, segment in entry:
                keep.append(len(rows))
                rows.append(row)
                targets.append(merged_index[row])
                parts.append(segment)
            rows += [entry[-1][0]] * (per_entry - len(entry))  # padding repeats the last row
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)
        return SegmentCall(as_tensor(rows), as_tensor(keep), as_tensor(targets), as_tensor(parts), slots, per_entry)

    calls, gathered_entries, gathered_slots = [], [], []
    for block_ids, readers in rows_by_segment.items():
        num_entries = -(-len(readers) // max_rows)
        per_entry = -(-len(readers) // num_entries)
        entries = [readers[index:index + per_entry] for index in range(0, len(readers), per_entry)]
        if num_entries > MAX_GATHERED_ENTRIES:
            calls.append(build(entries, max(min_rows, per_entry), segment_slots(block_ids)[None, :]))
        else:
            gathered_entries += entries
            gathered_slots += [segment_slots(block_ids)] * num_entries
    if gathered_entries:
        per_entry = max(min_rows, max(len(entry) for entry in gathered_entries))
        calls.append(build(gathered_entries, per_entry, torch.stack(gathered_slots)))
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
    key_start = first // SEGMENT_KEYS * SEGMENT_KEYS  # a span never crosses a segment boundary
    keys = torch.arange(key_start, num_keys, device=device)
    rows = position_tensor + row_of_position_0
    return InvariantCall(rows=rows, keep=torch.tensor(real, dtype=torch.int64, device=device), targets=rows[real],
                         slots=slots, visible=keys[None, :] <= position_tensor[:, None], rows_per_entry=per_entry,
                         num_keys=num_keys, key_start=key_start)


def _decode_call(meta, decode_ids: list[int], num_keys: int, block_size: int, min_rows: int,
                 device) -> InvariantCall:
    """Decodes of one key count, each an entry of its row repeated min_rows times (with 2 heads a
    group, twice: 2 query rows would take another gemm than 4; with 4 or more, once)."""
    ids = torch.tensor(decode_ids, dtype=torch.int64, device=device)
    lens = meta.seq_lens.index_select(0, ids)
    key_start = (num_keys - KEY_MULTIPLE) // SEGMENT_KEYS * SEGMENT_KEYS  # positions num_keys - 64 .. num_keys - 1
    keys = torch.arange(key_start, num_keys, device=device)
    visible = keys[None, :] < lens[:, None]
    positions = torch.where(visible, keys, lens[:, None] - 1)  # padding reads the own, written, slot
    tables = meta.block_tables.index_select(0, ids)
    slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
    rows = meta.query_start_loc.index_select(0, ids)
    keep = torch.arange(0, min_rows * len(ids), min_rows, device=device)
    return InvariantCall(rows=rows.repeat_interleave(min_rows), keep=keep, targets=rows, slots=slots,
                         visible=visible.repeat_interleave(min_rows, dim=0), rows_per_entry=min_rows,
                         num_keys=num_keys, key_start=key_start)


def _slots(meta, i: int, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = meta.block_tables[i]
    return table.index_select(0, positions // block_size) * block_size + positions % block_size


def invariant_attention(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, plan: InvariantPlan,
                        masks: dict, scale: float, attend) -> torch.Tensor:
    """Attention of q [T, heads, d] over the flat caches [slots, kv_heads, d] by `plan`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = flat_k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    num_merged, tail = len(plan.merged_rows), plan.num_parts - 1
    # float32 partials, part-major, tail last; a row's unused parts stay unwritten and are never read
    parts = torch.empty((plan.num_parts, num_merged, num_heads, head_dim))
    lses = torch.empty((plan.num_parts, num_merged, num_heads))

    def fold(call, num_entries):
        per_entry = call.rows_per_entry
        query = q.index_select(0, call.rows).view(num_entries, per_entry, num_kv_heads, group, head_dim)
        return query.transpose(1, 2).reshape(num_entries, num_kv_heads, per_entry * group, head_dim)

    def unfold(call, num_entries, attended, lse):
        per_entry = call.rows_per_entry
        attended = attended.view(num_entries, num_kv_heads, per_entry, group, head_dim).transpose(1, 2)
        attended = attended.reshape(num_entries * per_entry, num_heads, head_dim).index_select(0, call.keep)
        lse = lse.view(num_entries, num_kv_heads, per_entry, group).transpose(1, 2)
        return attended, lse.reshape(num_entries * per_entry, num_heads).index_select(0, call.keep)

    for call in plan.segment_calls:
        num_entries = len(call.rows) // call.rows_per_entry
        shape = (len(call.slots), SEGMENT_KEYS, num_kv_heads, head_dim)
        keys = flat_k.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
        values = flat_v.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
        if len(call.slots) == 1:  # one segment read by all the call's entries
            keys, values = keys.expand(num_entries, -1, -1, -1), values.expand(num_entries, -1, -1, -1)
        attended, lse = unfold(call, num_entries, *attend(fold(call, num_entries), keys, values, scale))
        parts[call.parts, call.targets] = attended.float()
        lses[call.parts, call.targets] = lse

    gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a chunk's keys, read once per layer
    for index, call in enumerate(plan.calls):
        per_entry, key_start, num_keys = call.rows_per_entry, call.key_start, call.num_keys
        num_entries = len(call.rows) // per_entry
        mask = masks.get(("invariant", index, q.dtype))
        if mask is None:  # additive, [entries, 1, rows x group, keys]: built once per step, shared by the layers
            additive = torch.zeros(call.visible.shape, dtype=q.dtype).masked_fill(~call.visible, float("-inf"))
            mask = additive.view(num_entries, per_entry, 1, num_keys - key_start).expand(-1, -1, group, -1)
            mask = masks[("invariant", index, q.dtype)] = mask.reshape(num_entries, 1, per_entry * group, -1)
        if call.slots.dim() == 1:  # a part of one chunk's keys, read by each of the call's entries
            if id(call.slots) not in gathered:
                gathered[id(call.slots)] = (flat_k.index_select(0, call.slots).transpose(0, 1).unsqueeze(0),
                                            flat_v.index_select(0, call.slots).transpose(0, 1).unsqueeze(0))
            chunk_keys, chunk_values = gathered[id(call.slots)]
            keys = chunk_keys[:, :, key_start:num_keys].expand(num_entries, -1, -1, -1)
            values = chunk_values[:, :, key_start:num_keys].expand(num_entries, -1, -1, -1)
        else:
            shape = (num_entries, num_keys - key_start, num_kv_heads, head_dim)
            keys = flat_k.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
            values = flat_v.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
        attended, lse = unfold(call, num_entries, *attend(fold(call, num_entries), keys, values, scale, mask=mask))
        merge_index = plan.merge_index[index]
        if merge_index is None:
            out.index_copy_(0, call.targets, attended)
        else:
            parts[tail, merge_index] = attended.float()
            lses[tail, merge_index] = lse

    if num_merged:
        merged = torch.empty((num_merged, num_heads, head_dim))
        for k, first, end in plan.merge_groups:
            order = [*range(k), tail]
            merged[first:end] = _merge([parts[part, first:end] for part in order], [lses[part, first:end] for part in order])
        out.index_copy_(0, plan.merged_rows, merged.to(q.dtype))
    return out


def _merge(parts: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Log-sum-exp average of parts [M, H, d] (float32) in list order, one elementwise step a part,
    so a row's result does not depend on the other rows."""
    top = lses[0]
    for lse in lses[1:]:
        top = torch.maximum(top, lse)
    total = merged = None
    for part, lse in zip(parts, lses):
        weight = (lse - top).exp_()
        total = weight if total is None else total + weight
        merged = part * weight[..., None] if merged is None else merged + part * weight[..., None]
    return merged / total[..., None]
