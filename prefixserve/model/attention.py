"""Paged attention: K/V live in fixed-size blocks; a block table maps a sequence to its blocks.

Cache layout per layer (k_cache and v_cache alike)::

    [num_blocks, block_size, num_kv_heads, head_dim]      flat slot = block_id * block_size + offset

    sequence i, block_table [7, 2, 9], block_size 4, seq_len 10:
        positions 0..3 -> block 7 (slots 28..31), 4..7 -> block 2 (slots 8..11), 8..9 -> block 9 (36, 37)

One step's input is a flat list of tokens: rows query_start_loc[i]:query_start_loc[i+1] belong to
sequence i and are the LAST query_len positions of its context::

    context of sequence i:  [ cached by earlier steps .......... | this step's tokens ]
    position:                 0                     seq_len-query_len          seq_len-1

Each query attends causally to keys 0..its own position. K/V of this step are written into the
cache first, so attention reads every key from the cache and needs no separate "new K/V" path.

Decodes (query_len 1) of all sequences run as ONE padded, masked SDPA call; each prefill chunk
runs as its own SDPA call (a per-sequence loop, never a per-token one). The gather indices are
built once per step (lazily, on the first layer) and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class _StepIndices:
    """Gather indices derived from the metadata, shared by all layers of one step."""

    decode_seq_ids: list[int]
    decode_rows: torch.Tensor | None         # int64 [num_decodes]: rows of the flat input
    decode_slots: torch.Tensor | None        # int64 [num_decodes, max_len]: key slots, padded
    decode_mask: torch.Tensor | None         # bool [num_decodes, 1, 1, max_len]: True = attend
    prefill_seq_ids: list[int]
    prefill_rows: list[int]                  # first row of each prefill chunk in the flat input
    prefill_slots: list[torch.Tensor]        # int64 [seq_len] per prefill chunk
    prefill_masks: list[torch.Tensor | None]  # bool [query_len, seq_len], None when fully causal


@dataclass
class AttentionMetadata:
    """Where one step's tokens come from and where their K/V go (see the module docstring)."""

    slot_mapping: torch.Tensor     # int64 [num_tokens]: slot each input token's K/V is written to
    query_start_loc: torch.Tensor  # int64 [num_seqs + 1]: row offsets of each sequence
    seq_lens: torch.Tensor         # int64 [num_seqs]: context length AFTER this step
    block_tables: torch.Tensor     # int64 [num_seqs, max_blocks]: block ids in order, padded
    query_lens: list[int]          # python copies, so the host never syncs on the device
    seq_lens_list: list[int]
    _indices: _StepIndices | None = field(default=None, repr=False, compare=False)
    _indices_block_size: int = field(default=0, repr=False, compare=False)

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
        """Build the metadata from Python lists; computes the slot mapping from the block tables."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        slots: list[int] = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
            if len(table) * block_size < seq_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {seq_len} tokens")
            for position in range(seq_len - query_len, seq_len):
                slots.append(table[position // block_size] * block_size + position % block_size)
        max_blocks = max((len(table) for table in block_tables), default=0)
        padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)

        def as_tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            slot_mapping=as_tensor(slots),
            query_start_loc=as_tensor(starts),
            seq_lens=as_tensor(list(seq_lens)),
            block_tables=as_tensor(padded).reshape(len(block_tables), max_blocks),
            query_lens=list(query_lens),
            seq_lens_list=list(seq_lens),
        )

    def step_indices(self, block_size: int) -> _StepIndices:
        if self._indices is None or self._indices_block_size != block_size:
            self._indices = _build_indices(self, block_size)
            self._indices_block_size = block_size
        return self._indices


def _build_indices(meta: AttentionMetadata, block_size: int) -> _StepIndices:
    device = meta.block_tables.device
    starts = [0]
    for query_len in meta.query_lens:
        starts.append(starts[-1] + query_len)
    decode_ids = [i for i, query_len in enumerate(meta.query_lens) if query_len == 1]
    prefill_ids = [i for i, query_len in enumerate(meta.query_lens) if query_len > 1]

    decode_rows = decode_slots = decode_mask = None
    if decode_ids:
        max_len = max(meta.seq_lens_list[i] for i in decode_ids)
        ids = torch.tensor(decode_ids, dtype=torch.int64, device=device)
        decode_rows = torch.tensor([starts[i] for i in decode_ids], dtype=torch.int64, device=device)
        positions = torch.arange(max_len, device=device)
        tables = meta.block_tables.index_select(0, ids)[:, : (max_len + block_size - 1) // block_size]
        slots = tables[:, positions // block_size] * block_size + positions % block_size
        valid = positions[None, :] < meta.seq_lens.index_select(0, ids)[:, None]
        # Padded positions may point at padding block ids (any value). Redirect them to the
        # sequence's own position 0, which is always written: the gather stays in bounds, and
        # never reads uninitialised memory, whose NaNs would survive the mask (0 * NaN = NaN).
        decode_slots = torch.where(valid, slots, slots[:, :1])
        decode_mask = valid[:, None, None, :]

    prefill_slots: list[torch.Tensor] = []
    prefill_masks: list[torch.Tensor | None] = []
    for i in prefill_ids:
        seq_len, query_len = meta.seq_lens_list[i], meta.query_lens[i]
        num_blocks = (seq_len + block_size - 1) // block_size
        offsets = torch.arange(block_size, device=device)
        slots = (meta.block_tables[i, :num_blocks, None] * block_size + offsets).reshape(-1)[:seq_len]
        prefill_slots.append(slots)
        if query_len == seq_len:
            prefill_masks.append(None)  # nothing cached: plain is_causal
        else:
            # Query row r sits at position seq_len - query_len + r and sees keys <= that position.
            query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
            prefill_masks.append(torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None])
    return _StepIndices(decode_ids, decode_rows, decode_slots, decode_mask, prefill_ids,
                        [starts[i] for i in prefill_ids], prefill_slots, prefill_masks)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into their slots of the paged cache."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of q [num_tokens, num_heads, head_dim] over the paged cache; returns q's shape.

    Grouped-query attention: num_heads must be a multiple of the cache's num_kv_heads.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    group = num_heads // num_kv_heads
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    indices = meta.step_indices(block_size)
    out = torch.empty_like(q)

    if indices.decode_seq_ids:
        num_decodes, max_len = indices.decode_slots.shape
        gathered = (num_decodes, max_len, num_kv_heads, head_dim)
        keys = flat_k.index_select(0, indices.decode_slots.reshape(-1)).view(gathered)
        values = flat_v.index_select(0, indices.decode_slots.reshape(-1)).view(gathered)
        # One query per sequence: fold the query heads of a KV group into the query-length axis,
        # [D, kv_heads, group, d], so K/V are never repeated per query head.
        query = q.index_select(0, indices.decode_rows).view(num_decodes, num_kv_heads, group, head_dim)
        attended = F.scaled_dot_product_attention(
            query, keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=indices.decode_mask, scale=scale)
        out.index_copy_(0, indices.decode_rows, attended.reshape(num_decodes, num_heads, head_dim))

    for seq_id, row, slots, mask in zip(indices.prefill_seq_ids, indices.prefill_rows,
                                        indices.prefill_slots, indices.prefill_masks):
        query_len = meta.query_lens[seq_id]
        query = q[row:row + query_len].transpose(0, 1).unsqueeze(0)          # [1, heads, q_len, d]
        keys = flat_k.index_select(0, slots).transpose(0, 1).unsqueeze(0)    # [1, kv_heads, seq_len, d]
        values = flat_v.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=group > 1)
        out[row:row + query_len] = attended[0].transpose(0, 1)
    return out
