"""Paged attention: K/V live in fixed-size blocks; a block table maps a sequence to its blocks.

Cache layout per layer (k_cache and v_cache alike)::

    [num_blocks, block_size, num_kv_heads, head_dim]      flat slot = block_id * block_size + offset

    sequence i, block_table [7, 2, 9], block_size 4, seq_len 10:
        positions 0..3 -> block 7 (slots 28..31), 4..7 -> block 2 (slots 8..11), 8..9 -> block 9 (36, 37)

One step's input is a flat list of tokens: rows query_start_loc[i]:query_start_loc[i+1] belong to
sequence i and are the LAST query_len positions of its context. K/V of this step are written into
the cache first. Each query sees its sequence's whole PAST (positions before this step's first
token: no mask needed) and, causally, this step's own tokens::

    context of sequence i:  [ shared prefix | body ......... | rest | this step's tokens ]
    read as:                  once per group  in place (view)  gathered  causal, fresh K/V
    position:                 0             P               B      past              seq_len

Softmax attention over a key set is the log-sum-exp merge of attention over its parts, and does
not depend on key order, so each part is read the cheapest way and the parts are merged:

  * shared prefix (cascade, as Hydragen): sequences whose block tables start with the same block
    ids (a prefix-cache hit) read those K/V ONCE for all their query rows;
  * body: a run of blocks whose ids form a consecutive range is one slice of the cache: no copy;
  * rest: the few remaining slots are gathered (decodes as one padded batch, with their own token).

A sequence with nothing to share and no long run takes a single call and no merge. The plan is
built once per step (on the first layer) and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Optional

import torch
import torch.nn.functional as F

# When a separate attention call (plus the log-sum-exp merge, about 100-250 us on a CPU) pays for
# itself: gathering a key costs about 90 ns in float32 and 28 ns in bfloat16 per K or V row here.
# Keyed by the cache's element size.
MIN_SHARED_SAVED_TOKENS = {4: 512, 2: 2048}  # (members - 1) x shared prefix tokens, to read it once
MIN_VIEW_TOKENS = {4: 640, 2: 4096}          # a consecutive run read in place instead of gathered
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class AttentionMetadata:
    """Where one step's tokens come from and where their K/V go (see the module docstring)."""

    slot_mapping: torch.Tensor     # int64 [num_tokens]: slot each input token's K/V is written to
    query_start_loc: torch.Tensor  # int64 [num_seqs + 1]: row offsets of each sequence
    seq_lens: torch.Tensor         # int64 [num_seqs]: context length AFTER this step
    block_tables: torch.Tensor     # int64 [num_seqs, max_blocks]: block ids in order, padded
    query_lens: list[int]          # python copies, so the host never syncs on the device
    seq_lens_list: list[int]
    block_table_lists: list[list[int]]  # the unpadded lists given to build: sharing and runs are found here
    positions: Optional[torch.Tensor] = None  # int64 [num_tokens]: position of each row (for rotary)
    first_slot: Optional[int] = None    # set when the slot mapping is first_slot, first_slot + 1, ...
    _plan: Optional["_StepPlan"] = field(default=None, repr=False, compare=False)

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
        query = torch.tensor(query_lens, dtype=torch.int64)
        # Row r of sequence i sits at position (seq_len_i - query_len_i) + (r - start_i).
        if sum(query_lens) == num_seqs:  # decodes only: one row per sequence
            seq_of_row, positions = torch.arange(num_seqs), lens - 1
        else:
            seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), query)
            positions = torch.arange(int(starts[-1])) + (lens - query - starts[:-1]).index_select(0, seq_of_row)
        block_ids = tables[seq_of_row, positions // block_size]
        slots = block_ids * block_size + positions % block_size
        first_slot = None
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


# ---- the per-step plan ---------------------------------------------------------------------------

@dataclass
class _Keys:
    """A set of key slots: `length` slots from `start` when contiguous, else an index tensor."""

    start: int = 0
    length: int = 0
    slots: Optional[torch.Tensor] = None

    def read(self, flat_cache: torch.Tensor) -> torch.Tensor:
        if self.slots is None:
            return flat_cache[self.start:self.start + self.length]
        return flat_cache.index_select(0, self.slots)


@dataclass
class _Part:
    """Non-causal attention of some query rows over a key set; merged into `merge_ids`."""

    rows: torch.Tensor | slice     # rows of q
    keys: _Keys
    merge_ids: torch.Tensor | slice  # where the result lands among the merged rows


@dataclass
class _Chunk:
    """A prefill chunk (query_len > 1) answered by one call: its own tokens attend causally to
    each other, after its whole past when `past` is set (then with `mask`)."""

    rows: slice
    own_slots: torch.Tensor              # slots of its own tokens (read back when k/v are not given)
    past: Optional[_Keys] = None         # past + own keys together
    mask: Optional[torch.Tensor] = None  # bool [query_len, seq_len]


@dataclass
class _OwnBatch:
    """The own tokens of split prefill chunks of one length, causal within each: one call."""

    query_len: int
    rows: torch.Tensor       # int64 [num_chunks * query_len], chunk by chunk
    own_slots: torch.Tensor  # int64, the same order
    merge_ids: torch.Tensor


@dataclass
class _Decodes:
    """Every decode of the step as one padded batch over its gathered slots (own token included)."""

    rows: torch.Tensor       # int64 [num_decodes]
    slots: torch.Tensor      # int64 [num_decodes, max_len]
    valid: torch.Tensor      # bool [num_decodes, 1, 1, max_len]
    merge_ids: Optional[torch.Tensor]  # None: no decode has another part


@dataclass
class _StepPlan:
    parts: list[_Part]
    chunks: list[_Chunk]
    own_batches: list[_OwnBatch]
    decodes: Optional[_Decodes]
    merged_rows: Optional[torch.Tensor]  # int64 [num_merged]: rows of q assembled from parts
    merge_index: Optional[torch.Tensor] = None  # int64: merged id of each contribution, in order
    masks: dict = field(default_factory=dict)   # additive decode masks per dtype


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
        if table[start:start + middle] == list(range(first, first + middle)):
            low = middle
        else:
            high = middle
    return low


def _shared_prefixes(meta: AttentionMetadata, past_lens: list[int], block_size: int,
                     min_saved_tokens: int) -> list[tuple[list[int], int]]:
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


def _build_plan(meta: AttentionMetadata, block_size: int, element_size: int) -> _StepPlan:
    device = meta.block_tables.device
    starts = [0, *accumulate(meta.query_lens)]
    past_lens = [seq_len - query_len for seq_len, query_len in zip(meta.seq_lens_list, meta.query_lens)]
    num_seqs = len(past_lens)
    covered = [0] * num_seqs  # leading past tokens served by a shared prefix or a body view
    is_split = [False] * num_seqs  # assembled from several parts

    def as_tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    shared = []
    min_saved = MIN_SHARED_SAVED_TOKENS.get(element_size, MIN_SHARED_SAVED_TOKENS[2])
    min_view_blocks = -(-MIN_VIEW_TOKENS.get(element_size, MIN_VIEW_TOKENS[2]) // block_size)
    for members, num_common in _shared_prefixes(meta, past_lens, block_size, min_saved):
        table = meta.block_table_lists[members[0]]
        first = table[0]
        contiguous = table[:num_common] == list(range(first, first + num_common))
        for i in members:
            covered[i] = num_common * block_size
            is_split[i] = True
        shared.append((members, num_common, contiguous))
    bodies = {}
    for i, table in enumerate(meta.block_table_lists):
        first_block = covered[i] // block_size
        run = _ascending_run(table, first_block, past_lens[i] // block_size)
        if run >= min_view_blocks:
            bodies[i] = (table[first_block] * block_size, run * block_size)
            covered[i] += run * block_size
            is_split[i] = True
    decode_ids = [i for i in range(num_seqs) if meta.query_lens[i] == 1]
    # Merged ids: every row of a split sequence, and every decode row if any decode is split.
    split_decodes = any(is_split[i] for i in decode_ids)
    merge_start = {}
    num_merged = 0
    for i in range(num_seqs):
        if is_split[i] or (split_decodes and meta.query_lens[i] == 1):
            merge_start[i] = num_merged
            num_merged += meta.query_lens[i]

    def merge_slice(i: int) -> slice:
        return slice(merge_start[i], merge_start[i] + meta.query_lens[i])

    parts = []
    for members, num_common, contiguous in shared:
        rows = as_tensor([r for i in members for r in range(starts[i], starts[i + 1])])
        merge_ids = as_tensor([m for i in members for m in range(merge_start[i], merge_start[i] + meta.query_lens[i])])
        if contiguous:
            keys = _Keys(meta.block_table_lists[members[0]][0] * block_size, num_common * block_size)
        else:
            table = meta.block_tables[members[0], :num_common]
            keys = _Keys(slots=(table[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1))
        parts.append(_Part(rows, keys, merge_ids))
    for i, (start_slot, length) in bodies.items():
        parts.append(_Part(slice(starts[i], starts[i + 1]), _Keys(start_slot, length), merge_slice(i)))

    def slots_of(i: int, first: int, last: int) -> torch.Tensor:
        positions = torch.arange(first, last, device=device)
        return meta.block_tables[i].index_select(0, positions // block_size) * block_size + positions % block_size

    chunks = []
    split_by_len: dict[int, list[int]] = {}
    for i in range(num_seqs):
        query_len, seq_len, past = meta.query_lens[i], meta.seq_lens_list[i], past_lens[i]
        if query_len == 1:
            continue
        rows = slice(starts[i], starts[i + 1])
        if not is_split[i]:
            if past == 0:
                chunks.append(_Chunk(rows, meta.slot_mapping[rows]))
            else:  # one call over past + own keys, causal within the chunk
                mask = torch.arange(seq_len, device=device)[None, :] <= torch.arange(past, seq_len, device=device)[:, None]
                chunks.append(_Chunk(rows, meta.slot_mapping[rows], _Keys(slots=slots_of(i, 0, seq_len)), mask))
            continue
        split_by_len.setdefault(query_len, []).append(i)
        if covered[i] < past:  # the rest of the past: gathered, unmasked
            parts.append(_Part(rows, _Keys(slots=slots_of(i, covered[i], past)), merge_slice(i)))
    own_batches = []
    for query_len, members in split_by_len.items():
        rows = as_tensor([r for i in members for r in range(starts[i], starts[i + 1])])
        merge_ids = as_tensor([m for i in members for m in range(merge_start[i], merge_start[i] + query_len)])
        own_batches.append(_OwnBatch(query_len, rows, meta.slot_mapping.index_select(0, rows), merge_ids))

    decodes = None
    if decode_ids:
        ids = as_tensor(decode_ids)
        first = as_tensor([covered[i] for i in decode_ids])
        last = meta.seq_lens.index_select(0, ids)  # exclusive: the own token is the last key
        max_len = max(meta.seq_lens_list[i] - covered[i] for i in decode_ids)
        positions = first[:, None] + torch.arange(max_len, device=device)
        valid = positions < last[:, None]
        # Padding reads the sequence's own newest slot, which is written: never uninitialised
        # memory, whose NaNs would survive the mask (0 * NaN = NaN).
        positions = torch.where(valid, positions, last[:, None] - 1)
        tables = meta.block_tables.index_select(0, ids)
        slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        merge_ids = as_tensor([merge_start[i] for i in decode_ids]) if split_decodes else None
        decodes = _Decodes(as_tensor([starts[i] for i in decode_ids]), slots, valid[:, None, None, :], merge_ids)

    merged_rows = None
    if num_merged:
        merged_rows = as_tensor([r for i in sorted(merge_start) for r in range(starts[i], starts[i + 1])])
    return _StepPlan(parts, chunks, own_batches, decodes, merged_rows)


# ---- attention calls -----------------------------------------------------------------------------

def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool = False,
            mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Q, d], float32 log-sum-exp [B, H, Q]) of q [B, H, Q, d] over k, v [B, KH, K, d].

    KH may divide H (grouped-query); `mask` is additive, in q's dtype, broadcastable to [B, 1, Q, K].
    """
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        return _CPU_FLASH(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
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


def _attend_rows(q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                 mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked (or `mask`ed per sequence) attention of q_rows [R, H, d] over [L, KH, d] keys.

    The query heads of a KV group are folded into the query axis, [KH, R * group, d], so every
    key is read once per KV head rather than once per query head. Returns [R, H, d], [R, H].
    """
    num_rows, num_heads, head_dim = q_rows.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    folded = q_rows.view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)
    folded = folded.reshape(1, num_kv_heads, num_rows * group, head_dim)
    out, lse = _attend(folded, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), scale,
                       mask=mask)
    out = out.view(num_kv_heads, num_rows, group, head_dim).transpose(0, 1).reshape(num_rows, num_heads, head_dim)
    lse = lse.view(num_kv_heads, num_rows, group).transpose(0, 1).reshape(num_rows, num_heads)
    return out, lse


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, first_slot: Optional[int] = None) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into their slots of the paged cache.

    `first_slot`, when the slots are consecutive from it, turns the scatter into a slice copy.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    if first_slot is not None:
        flat_k[first_slot:first_slot + len(k)] = k
        flat_v[first_slot:first_slot + len(v)] = v
        return
    flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k: Optional[torch.Tensor] = None,
                    v: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of q [num_tokens, num_heads, head_dim] over the paged cache; returns q's shape.

    `k`, `v` [num_tokens, num_kv_heads, head_dim] are this step's own keys and values, already
    written to the cache; given, a prefill chunk reads them directly instead of from the cache.
    Grouped-query attention: num_heads must be a multiple of the cache's num_kv_heads.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    group = num_heads // num_kv_heads
    if meta._plan is None:
        meta._plan = _build_plan(meta, block_size, k_cache.element_size())
    plan = meta._plan
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (out, lse) in plan.merge_index order
    merge_ids: list = []

    for part in plan.parts:
        pieces.append(_attend_rows(q[part.rows], part.keys.read(flat_k), part.keys.read(flat_v), scale))
        merge_ids.append(part.merge_ids)

    for chunk in plan.chunks:
        query = q[chunk.rows].transpose(0, 1).unsqueeze(0)                   # [1, heads, q_len, d]
        if chunk.past is not None:
            keys, values = chunk.past.read(flat_k), chunk.past.read(flat_v)
        elif k is not None:
            keys, values = k[chunk.rows], v[chunk.rows]
        else:
            keys, values = flat_k.index_select(0, chunk.own_slots), flat_v.index_select(0, chunk.own_slots)
        attended = F.scaled_dot_product_attention(
            query, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=group > 1)
        out[chunk.rows] = attended[0].transpose(0, 1)

    for batch in plan.own_batches:
        shape = (-1, batch.query_len, num_kv_heads, head_dim)
        if k is not None:
            keys, values = k.index_select(0, batch.rows), v.index_select(0, batch.rows)
        else:
            keys, values = flat_k.index_select(0, batch.own_slots), flat_v.index_select(0, batch.own_slots)
        query = q.index_select(0, batch.rows).view(-1, batch.query_len, num_heads, head_dim).transpose(1, 2)
        attended, lse = _attend(query, keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2), scale,
                                is_causal=True)
        pieces.append((attended.transpose(1, 2), lse.transpose(1, 2)))
        merge_ids.append(batch.merge_ids)

    decodes = plan.decodes
    if decodes is not None:
        num_decodes, max_len = decodes.slots.shape
        gathered = (num_decodes, max_len, num_kv_heads, head_dim)
        keys = flat_k.index_select(0, decodes.slots.reshape(-1)).view(gathered).transpose(1, 2)
        values = flat_v.index_select(0, decodes.slots.reshape(-1)).view(gathered).transpose(1, 2)
        # One query per sequence: fold the query heads of a KV group into the query-length axis,
        # [D, kv_heads, group, d], so K/V are never repeated per query head.
        query = q.index_select(0, decodes.rows).view(num_decodes, num_kv_heads, group, head_dim)
        mask = plan.masks.get(q.dtype)
        if mask is None:
            mask = plan.masks[q.dtype] = torch.zeros(decodes.valid.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~decodes.valid, float("-inf"))
        attended, lse = _attend(query, keys, values, scale, mask=mask)
        attended = attended.reshape(num_decodes, num_heads, head_dim)
        if decodes.merge_ids is None:
            out.index_copy_(0, decodes.rows, attended)
        else:
            pieces.append((attended, lse.reshape(num_decodes, num_heads)))
            merge_ids.append(decodes.merge_ids)

    if pieces:
        _merge_into(out, plan, pieces, merge_ids)
    return out


def _merge_into(out: torch.Tensor, plan: _StepPlan, pieces: list[tuple[torch.Tensor, torch.Tensor]],
                merge_ids: list) -> None:
    """out[merged rows] = the log-sum-exp weighted average of each row's pieces (float32)."""
    if plan.merge_index is None:
        device = out.device
        plan.merge_index = torch.cat([
            ids if isinstance(ids, torch.Tensor) else torch.arange(ids.start, ids.stop, device=device)
            for ids in merge_ids])
    index = plan.merge_index
    num_merged, num_heads, head_dim = len(plan.merged_rows), out.shape[1], out.shape[2]
    values = torch.cat([piece_out.reshape(-1, num_heads, head_dim) for piece_out, _ in pieces]).float()
    lses = torch.cat([piece_lse.reshape(-1, num_heads) for _, piece_lse in pieces])
    expanded = index[:, None].expand(-1, num_heads)
    top = torch.full((num_merged, num_heads), float("-inf"), device=out.device)
    top.scatter_reduce_(0, expanded, lses, "amax")
    weights = (lses - top.index_select(0, index)).exp_()
    total = torch.zeros((num_merged, num_heads), device=out.device).index_add_(0, index, weights)
    merged = torch.zeros((num_merged, num_heads, head_dim), device=out.device)
    merged.index_add_(0, index, values.mul_(weights[..., None]))
    out.index_copy_(0, plan.merged_rows, merged.div_(total[..., None]).to(out.dtype))
