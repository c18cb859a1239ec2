"""The metadata of one attention step: where each input token's K/V go and which rows are sampled.

Built once per step from the scheduler's Python lists (block tables, query and context lengths) and
handed to every layer; the attention backends (paged.py, whose docstring draws the cache layout and
the rows of a step, and backend.py) and their plans read it. OutputRows narrows a step to the rows
whose outputs are used, for the model's last layer.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    """Where one step's tokens come from and where their K/V go (see the module docstring)."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: slot each input token's K/V is written to
    query_start_loc: torch.Tensor  # int64 [num_seqs + 1]: row offsets of each sequence
    seq_lens: torch.Tensor  # int64 [num_seqs]: context length AFTER this step
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks]: block ids in order, padded
    query_lens: list[int]  # python copies, so the host never syncs on the device
    seq_lens_list: list[int]
    block_table_lists: list[list[int]]  # the unpadded lists given to build: sharing and runs are found here
    positions: Optional[torch.Tensor] = None  # int64 [num_tokens]: position of each row (for rotary)
    first_slot: Optional[int] = None  # set when the slot mapping is first_slot, first_slot + 1, ...

    def __post_init__(self) -> None:
        num_seqs = len(self.query_lens)
        assert len(self.seq_lens_list) == num_seqs, "query_lens and seq_lens_list differ in length"
        for query_len, seq_len in zip(self.query_lens, self.seq_lens_list):
            assert 1 <= query_len <= seq_len, f"need 1 <= query_len ({query_len}) <= seq_len ({seq_len})"

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build the metadata from Python lists (kept, not copied); slots and positions come from
        a handful of tensor ops, never a loop over tokens."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        for seq_len, table in zip(seq_lens, block_tables):
            if len(table) * block_size < seq_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {seq_len} tokens")
        num_seqs = len(query_lens)
        max_blocks = max((len(table) for table in block_tables), default=0)
        padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]
        tables = torch.tensor(padded, dtype=torch.int64).reshape(num_seqs, max_blocks)
        starts = torch.tensor([0, *accumulate(query_lens)], dtype=torch.int64)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        first_slot = None
        # Row r of sequence i sits at position (seq_len_i - query_len_i) + (r - start_i).
        if sum(query_lens) == num_seqs:
            # Decodes only, one row per sequence: a step of batch-1 decode spends more in tensor ops than in
            # arithmetic, so these few values come from the lists (the same values the general path gives).
            position_list = [seq_len - 1 for seq_len in seq_lens]
            slot_list = [
                table[p // block_size] * block_size + p % block_size for table, p in zip(block_tables, position_list)
            ]
            if slot_list and slot_list == list(range(slot_list[0], slot_list[0] + num_seqs)):
                first_slot = slot_list[0]
            positions = torch.tensor(position_list, dtype=torch.int64)
            slots = torch.tensor(slot_list, dtype=torch.int64)
        else:
            query = torch.tensor(query_lens, dtype=torch.int64)
            seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), query)
            positions = torch.arange(int(starts[-1])) + (lens - query - starts[:-1]).index_select(0, seq_of_row)
            block_ids = tables[seq_of_row, positions // block_size]
            slots = block_ids * block_size + positions % block_size
            if len(slots) and int(slots[-1] - slots[0]) == len(slots) - 1 and bool((slots.diff() == 1).all()):
                first_slot = int(slots[0])
        return cls(
            slot_mapping=slots.to(device),
            query_start_loc=starts.to(device),
            seq_lens=lens.to(device),
            block_tables=tables.to(device),
            query_lens=list(query_lens),
            seq_lens_list=list(seq_lens),
            block_table_lists=block_tables,
            positions=positions.to(device),
            first_slot=first_slot,
        )


@dataclass
class OutputRows:
    """The rows of a step whose outputs are used (those sampled). The model's last layer attends
    and runs its MLP for these rows only: no later layer reads the others, and every row's K/V is
    written before attention in any case (llama.LlamaForCausalLM.forward)."""

    index: torch.Tensor  # int64 [R]: the rows, in the order their outputs come back
    meta: Optional[AttentionMetadata]  # each row as a one-row query at its own position (None: R = 0)

    @classmethod
    def of(
        cls, meta: AttentionMetadata, rows: list[int], block_size: int, device: torch.device | str = "cpu"
    ) -> "OutputRows":
        starts = list(accumulate(meta.query_lens, initial=0))
        positions, tables = [], []
        for row in rows:
            if not 0 <= row < starts[-1]:
                raise ValueError(f"output row {row} is not a row of this step ({starts[-1]} rows)")
            sequence = bisect_right(starts, row) - 1
            # Row r of sequence i sits at position (seq_len_i - query_len_i) + (r - start_i).
            positions.append(meta.seq_lens_list[sequence] - meta.query_lens[sequence] + row - starts[sequence])
            tables.append(meta.block_table_lists[sequence])
        one_row = None
        if rows:
            one_row = AttentionMetadata.build([1] * len(rows), [p + 1 for p in positions], tables, block_size, device)
        return cls(index=torch.tensor(rows, dtype=torch.int64, device=device), meta=one_row)
