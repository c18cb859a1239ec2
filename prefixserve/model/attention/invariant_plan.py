"""The calls of the batch-invariant attention path (invariant.py), planned once per step.

Which q rows each call folds into its entries, which key slots it reads and which of them are
visible, and which rows merge whole-segment partials with their tail: the shapes that keep a row's
bits its own whatever else is in the step are measured and explained in invariant.py's
docstring, and the constants here are those shapes. Planned on a step's first layer
(InvariantStep.calls_for) and kept in the step's plan for the other layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

KEY_MULTIPLE = 64  # a row at position p reads ceil(p + 1) keys to this multiple: fewer calls vs fewer masked keys
MIN_FOLDED_ROWS = 4  # query rows per entry: 2 or 3 take another gemm (measured with 1, 2 and 3 heads a group)
MAX_FOLDED_ROWS = 32  # query rows per entry: under the 64 at which the kernel may pack
MAX_GATHERED_ENTRIES = 4  # a segment read by more entries gets its own call, its keys gathered once
SEGMENT_KEYS = 256  # keys [0, 256), [256, 512), ... before a row's own segment: read once by all rows that share them


@dataclass
class InvariantCall:
    """Entries of `rows_per_entry` query rows attending over the first `num_keys` of gathered key slots."""

    rows: torch.Tensor  # int64 [entries * rows_per_entry]: row of q of each query row (padding repeats)
    keep: torch.Tensor  # int64: which of those are real (first occurrence), in the order of `targets`
    targets: torch.Tensor  # int64: the q rows they answer
    slots: torch.Tensor  # int64 [>= num_keys] shared by a chunk's calls, or [entries, num_keys] (decodes)
    visible: torch.Tensor  # bool [entries * rows_per_entry, num_keys]
    rows_per_entry: int
    num_keys: int
    key_start: int = 0  # the call reads keys [key_start, num_keys): its rows' whole segments come from SegmentCalls


@dataclass
class SegmentCall:
    """Entries of `rows_per_entry` query rows over SEGMENT_KEYS keys, all visible: one segment read
    by the rows of every sequence whose block table holds it (slots [1, S], expanded), or several
    segments of one entry each (slots [entries, S])."""

    rows: torch.Tensor  # int64 [entries * rows_per_entry]: row of q of each query row (padding repeats)
    keep: torch.Tensor  # int64: which of those are real
    targets: torch.Tensor  # int64: index in InvariantPlan.merged_rows of each kept row
    parts: torch.Tensor  # int64: the segment number of each kept row (its place in the merge)
    slots: torch.Tensor  # int64 [1 or entries, SEGMENT_KEYS]
    rows_per_entry: int


@dataclass
class InvariantPlan:
    """A step's calls. A row at position p with k = p // S > 0 merges k segment partials and its
    tail (keys [kS, ceil64(p + 1))) by log-sum-exp in float32, in that order, so its result is a
    function of p alone; a row with k = 0 is its tail call's output."""

    calls: list[InvariantCall]
    segment_calls: list[SegmentCall]
    merged_rows: torch.Tensor  # int64 [M]: q rows whose output is a merge, by k
    merge_index: list[Optional[torch.Tensor]]  # per call: index in merged_rows of its kept rows, None if k = 0
    merge_groups: list[tuple[int, int, int]]  # (k, first, end): merged_rows[first:end] merge k segments and a tail
    num_parts: int  # max k + 1 (the tail is the last part)


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
            block_ids = tuple(table[segment * blocks_per_segment : (segment + 1) * blocks_per_segment])
            first = max(past, (segment + 1) * SEGMENT_KEYS)
            rows_by_segment.setdefault(block_ids, []).extend(
                (first_row + position - past, segment) for position in range(first, seq_len)
            )
        merged.extend(
            (position // SEGMENT_KEYS, first_row + position - past)
            for position in range(max(past, SEGMENT_KEYS), seq_len)
        )
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
    merge_index = [
        torch.tensor([merged_index[row] for row in call.targets.tolist()], dtype=torch.int64, device=device)
        if call.key_start
        else None
        for call in calls
    ]
    segment_calls = _segment_calls(rows_by_segment, merged_index, block_size, min_rows, max_rows, device)
    num_parts = max((call.key_start // SEGMENT_KEYS for call in calls), default=0) + 1
    return InvariantPlan(
        calls,
        segment_calls,
        torch.tensor(merged_rows, dtype=torch.int64, device=device),
        merge_index,
        merge_groups,
        num_parts,
    )


def _segment_calls(
    rows_by_segment: dict, merged_index: dict, block_size: int, min_rows: int, max_rows: int, device
) -> list[SegmentCall]:
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

        def as_tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        return SegmentCall(as_tensor(rows), as_tensor(keep), as_tensor(targets), as_tensor(parts), slots, per_entry)

    calls, gathered_entries, gathered_slots = [], [], []
    for block_ids, readers in rows_by_segment.items():
        num_entries = -(-len(readers) // max_rows)
        per_entry = -(-len(readers) // num_entries)
        entries = [readers[index : index + per_entry] for index in range(0, len(readers), per_entry)]
        if num_entries > MAX_GATHERED_ENTRIES:
            calls.append(build(entries, max(min_rows, per_entry), segment_slots(block_ids)[None, :]))
        else:
            gathered_entries += entries
            gathered_slots += [segment_slots(block_ids)] * num_entries
    if gathered_entries:
        per_entry = max(min_rows, max(len(entry) for entry in gathered_entries))
        calls.append(build(gathered_entries, per_entry, torch.stack(gathered_slots)))
    return calls


def _chunk_call(
    first: int, end: int, row_of_position_0: int, slots: torch.Tensor, min_rows: int, max_rows: int, device
) -> InvariantCall:
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
    return InvariantCall(
        rows=rows,
        keep=torch.tensor(real, dtype=torch.int64, device=device),
        targets=rows[real],
        slots=slots,
        visible=keys[None, :] <= position_tensor[:, None],
        rows_per_entry=per_entry,
        num_keys=num_keys,
        key_start=key_start,
    )


def _decode_call(meta, decode_ids: list[int], num_keys: int, block_size: int, min_rows: int, device) -> InvariantCall:
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
    return InvariantCall(
        rows=rows.repeat_interleave(min_rows),
        keep=keep,
        targets=rows,
        slots=slots,
        visible=visible.repeat_interleave(min_rows, dim=0),
        rows_per_entry=min_rows,
        num_keys=num_keys,
        key_start=key_start,
    )


def _slots(meta, i: int, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = meta.block_tables[i]
    return table.index_select(0, positions // block_size) * block_size + positions % block_size
