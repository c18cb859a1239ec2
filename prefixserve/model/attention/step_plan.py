"""The cascade's per-step plan: which key slots each query group reads, and how (see cascade.py).

Built once per step from the metadata (block tables, lengths) and reused by every layer: shared
prefixes read once per group, consecutive block runs read in place, the rest gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .metadata import AttentionMetadata

# When a separate attention call (plus the log-sum-exp merge, about 100-250 us on a CPU) pays for
# itself: gathering a key costs about 90 ns in float32 and 28 ns in bfloat16 per K or V row.
# Measured on this project's 2-core AVX-512 CPU with benchmarks/profile_step.py; keyed by the
# cache's element size. They hold for CPUs only: on another device the plan reads every sequence
# in one call (UNMEASURED_DEVICE) until someone measures that device's costs.
MIN_SHARED_SAVED_TOKENS = {4: 512, 2: 2048}  # (members - 1) x shared prefix tokens, to read it once
MIN_VIEW_TOKENS = {4: 640, 2: 4096}  # a consecutive run read in place instead of gathered
UNMEASURED_DEVICE = 1 << 62  # a threshold no step reaches: no shortcut taken


def thresholds(device_type: str, element_size: int) -> tuple[int, int]:
    """(min shared saved tokens, min view tokens) for a cache on this device type."""
    if device_type != "cpu":
        return UNMEASURED_DEVICE, UNMEASURED_DEVICE
    return (
        MIN_SHARED_SAVED_TOKENS.get(element_size, MIN_SHARED_SAVED_TOKENS[2]),
        MIN_VIEW_TOKENS.get(element_size, MIN_VIEW_TOKENS[2]),
    )


@dataclass
class _Keys:
    """A set of key slots: `length` slots from `start` when contiguous, else an index tensor."""

    start: int = 0
    length: int = 0
    slots: Optional[torch.Tensor] = None

    def read(self, flat_cache: torch.Tensor) -> torch.Tensor:
        if self.slots is None:
            return flat_cache[self.start : self.start + self.length]
        return flat_cache.index_select(0, self.slots)


@dataclass
class _Part:
    """Non-causal attention of some query rows over a key set; merged into `merge_ids`."""

    rows: torch.Tensor | slice  # rows of q
    keys: _Keys
    merge_ids: torch.Tensor | slice  # where the result lands among the merged rows


@dataclass
class _Chunk:
    """A prefill chunk (query_len > 1) answered by one call: its own tokens attend causally to
    each other, after its whole past when `past` is set (then with `mask`)."""

    rows: slice
    past: Optional[_Keys] = None  # past + own keys together
    mask: Optional[torch.Tensor] = None  # bool [query_len, seq_len]


@dataclass
class _OwnBatch:
    """The own tokens of split prefill chunks of one length, causal within each: one call."""

    query_len: int
    rows: torch.Tensor  # int64 [num_chunks * query_len], chunk by chunk
    merge_ids: torch.Tensor


@dataclass
class _Decodes:
    """Every decode of the step as one padded batch over its gathered slots (own token included)."""

    rows: torch.Tensor  # int64 [num_decodes]
    slots: torch.Tensor  # int64 [num_decodes, max_len]
    valid: torch.Tensor  # bool [num_decodes, 1, 1, max_len]
    merge_ids: Optional[torch.Tensor]  # None: no decode has another part


@dataclass
class StepPlan:
    parts: list[_Part]
    chunks: list[_Chunk]
    own_batches: list[_OwnBatch]
    decodes: Optional[_Decodes]
    merged_rows: Optional[torch.Tensor]  # int64 [num_merged]: rows of q assembled from parts
    merge_index: Optional[torch.Tensor] = None  # int64: merged id of each contribution, in order
    masks: dict = field(default_factory=dict)  # additive decode masks per dtype


def _ascending_run(table: list[int], start: int, end: int) -> int:
    """Length of the run table[start:] with ids first, first+1, ... (capped at end - start)."""
    if start >= end:
        return 0
    first = table[start]
    if table[start:end] == list(range(first, first + end - start)):
        return end - start
    low, high = 1, end - start  # table[start:start+low] is a run, [start:start+high] is not
    while high - low > 1:
        middle = (low + high) // 2
        if table[start : start + middle] == list(range(first, first + middle)):
            low = middle
        else:
            high = middle
    return low


def _shared_prefixes(
    meta: AttentionMetadata, past_lens: list[int], block_size: int, min_saved_tokens: int
) -> list[tuple[list[int], int]]:
    """(members, number of common leading blocks) of each group worth reading once."""
    groups: dict[int, list[int]] = {}
    for i, table in enumerate(meta.block_table_lists):
        if past_lens[i] >= block_size:
            groups.setdefault(table[0], []).append(i)
    found = []
    for members in groups.values():
        if len(members) < 2:
            continue
        # Only blocks wholly in every member's past: all their query rows see them unmasked.
        limit = min(past_lens[i] for i in members) // block_size
        tables = meta.block_tables[members, :limit]
        differs = (tables != tables[:1]).any(0).nonzero()
        num_common = int(differs[0]) if len(differs) else limit
        if num_common and (len(members) - 1) * num_common * block_size >= min_saved_tokens:
            found.append((members, num_common))
    return found


def build_plan(meta: AttentionMetadata, block_size: int, element_size: int) -> StepPlan:
    return _PlanBuilder(meta, block_size, element_size).build()


class _PlanBuilder:
    """One step's plan in stages: shared prefixes, in-place bodies, merge ids, then the calls."""

    def __init__(self, meta: AttentionMetadata, block_size: int, element_size: int) -> None:
        self.meta, self.block_size = meta, block_size
        self.device = meta.block_tables.device
        self.starts = [0, *accumulate(meta.query_lens)]
        self.past_lens = [seq_len - query_len for seq_len, query_len in zip(meta.seq_lens_list, meta.query_lens)]
        self.num_seqs = len(self.past_lens)
        self.covered = [0] * self.num_seqs  # leading past tokens served by a shared prefix or a body view
        self.is_split = [False] * self.num_seqs  # assembled from several parts
        self.min_saved, min_view_tokens = thresholds(self.device.type, element_size)
        self.min_view_blocks = -(-min_view_tokens // block_size)
        self.merge_start: dict[int, int] = {}

    def as_tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def rows_of(self, i: int) -> slice:
        return slice(self.starts[i], self.starts[i + 1])

    def build(self) -> StepPlan:
        shared = self._find_shared()
        bodies = self._find_bodies()
        decode_ids = [i for i in range(self.num_seqs) if self.meta.query_lens[i] == 1]
        split_decodes = any(self.is_split[i] for i in decode_ids)
        num_merged = self._assign_merge_ids(split_decodes)
        parts = self._shared_parts(shared) + [
            _Part(self.rows_of(i), _Keys(start_slot, length), self._merge_slice(i))
            for i, (start_slot, length) in bodies.items()
        ]
        chunks, split_by_len = self._prefill_chunks(parts)
        own_batches = [self._own_batch(query_len, members) for query_len, members in split_by_len.items()]
        decodes = self._decodes(decode_ids, split_decodes) if decode_ids else None
        merged_rows = None
        if num_merged:
            merged_rows = self.as_tensor([r for i in sorted(self.merge_start) for r in range(*self._row_range(i))])
        return StepPlan(parts, chunks, own_batches, decodes, merged_rows)

    def _row_range(self, i: int) -> tuple[int, int]:
        return self.starts[i], self.starts[i + 1]

    def _find_shared(self) -> list[tuple[list[int], int, bool]]:
        """(members, common blocks, whether those blocks are one consecutive run) of each shared group."""
        meta, block_size = self.meta, self.block_size
        shared = []
        for members, num_common in _shared_prefixes(meta, self.past_lens, block_size, self.min_saved):
            table = meta.block_table_lists[members[0]]
            first = table[0]
            contiguous = table[:num_common] == list(range(first, first + num_common))
            for i in members:
                self.covered[i] = num_common * block_size
                self.is_split[i] = True
            shared.append((members, num_common, contiguous))
        return shared

    def _find_bodies(self) -> dict[int, tuple[int, int]]:
        """Sequence -> (first slot, length) of a long consecutive run after its shared prefix, read in place."""
        block_size = self.block_size
        bodies = {}
        for i, table in enumerate(self.meta.block_table_lists):
            first_block = self.covered[i] // block_size
            run = _ascending_run(table, first_block, self.past_lens[i] // block_size)
            if run >= self.min_view_blocks:
                bodies[i] = (table[first_block] * block_size, run * block_size)
                self.covered[i] += run * block_size
                self.is_split[i] = True
        return bodies

    def _assign_merge_ids(self, split_decodes: bool) -> int:
        """Merged ids: every row of a split sequence, and every decode row if any decode is split."""
        num_merged = 0
        for i in range(self.num_seqs):
            if self.is_split[i] or (split_decodes and self.meta.query_lens[i] == 1):
                self.merge_start[i] = num_merged
                num_merged += self.meta.query_lens[i]
        return num_merged

    def _merge_slice(self, i: int) -> slice:
        return slice(self.merge_start[i], self.merge_start[i] + self.meta.query_lens[i])

    def _merge_ids(self, members: list[int]) -> torch.Tensor:
        return self.as_tensor(
            [m for i in members for m in range(self.merge_start[i], self.merge_start[i] + self.meta.query_lens[i])]
        )

    def _shared_parts(self, shared) -> list[_Part]:
        meta, block_size = self.meta, self.block_size
        parts = []
        for members, num_common, contiguous in shared:
            rows = self.as_tensor([r for i in members for r in range(*self._row_range(i))])
            if contiguous:
                keys = _Keys(meta.block_table_lists[members[0]][0] * block_size, num_common * block_size)
            else:
                table = meta.block_tables[members[0], :num_common]
                offsets = torch.arange(block_size, device=self.device)
                keys = _Keys(slots=(table[:, None] * block_size + offsets).reshape(-1))
            parts.append(_Part(rows, keys, self._merge_ids(members)))
        return parts

    def _slots_of(self, i: int, first: int, last: int) -> torch.Tensor:
        positions = torch.arange(first, last, device=self.device)
        table = self.meta.block_tables[i]
        return table.index_select(0, positions // self.block_size) * self.block_size + positions % self.block_size

    def _prefill_chunks(self, parts: list[_Part]) -> tuple[list[_Chunk], dict[int, list[int]]]:
        """One call per unsplit chunk; split chunks are grouped by length (their own tokens batch
        together) and the rest of their past becomes a gathered part."""
        meta, device = self.meta, self.device
        chunks, split_by_len = [], {}
        for i in range(self.num_seqs):
            query_len, seq_len, past = meta.query_lens[i], meta.seq_lens_list[i], self.past_lens[i]
            if query_len == 1:
                continue
            rows = self.rows_of(i)
            if not self.is_split[i]:
                if past == 0:
                    chunks.append(_Chunk(rows))
                else:  # one call over past + own keys, causal within the chunk
                    mask = (
                        torch.arange(seq_len, device=device)[None, :]
                        <= torch.arange(past, seq_len, device=device)[:, None]
                    )
                    chunks.append(_Chunk(rows, _Keys(slots=self._slots_of(i, 0, seq_len)), mask))
                continue
            split_by_len.setdefault(query_len, []).append(i)
            if self.covered[i] < past:  # the rest of the past: gathered, unmasked
                parts.append(_Part(rows, _Keys(slots=self._slots_of(i, self.covered[i], past)), self._merge_slice(i)))
        return chunks, split_by_len

    def _own_batch(self, query_len: int, members: list[int]) -> _OwnBatch:
        rows = self.as_tensor([r for i in members for r in range(*self._row_range(i))])
        return _OwnBatch(query_len, rows, self._merge_ids(members))

    def _decodes(self, decode_ids: list[int], split_decodes: bool) -> _Decodes:
        meta, block_size = self.meta, self.block_size
        ids = self.as_tensor(decode_ids)
        first = self.as_tensor([self.covered[i] for i in decode_ids])
        last = meta.seq_lens.index_select(0, ids)  # exclusive: the own token is the last key
        max_len = max(meta.seq_lens_list[i] - self.covered[i] for i in decode_ids)
        positions = first[:, None] + torch.arange(max_len, device=self.device)
        valid = positions < last[:, None]
        # Padding reads the sequence's own newest slot, which is written: never uninitialised
        # memory, whose NaNs would survive the mask (0 * NaN = NaN).
        positions = torch.where(valid, positions, last[:, None] - 1)
        tables = meta.block_tables.index_select(0, ids)
        slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        merge_ids = self.as_tensor([self.merge_start[i] for i in decode_ids]) if split_decodes else None
        return _Decodes(self.as_tensor([self.starts[i] for i in decode_ids]), slots, valid[:, None, None, :], merge_ids)
