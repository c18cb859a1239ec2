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

A sequence with nothing to share and no long run takes a single call and no merge. The plan
(attention_plan.py) is built once per step by the model (`plan_step`) and handed to every layer,
with the step's metadata (attention_metadata.py: AttentionMetadata, OutputRows).

That is the pure-PyTorch path. Where the compiled kernel is built (kernels.py, csrc/paged_causal.cpp)
every row of the step goes to it in one call instead: it reads each row's keys in place through the
block table (no gather, no merge; decodes sharing a cached prefix share each transposed key tile),
and each row's sums run in an order of its own, so in either dtype a row's attention does not
depend on the batch or the chunking (batch invariance also needs the linear layers' measured row calls,
row_calls.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..kernels import causal_kernel_for
from .invariant import invariant_attention
from .invariant_plan import invariant_calls
from .metadata import AttentionMetadata
from .step_plan import StepPlan, build_plan
from .windowed import windowed_attention

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Dtypes whose CPU attention takes the batch-invariant path (invariant_attention.py): in bfloat16
# the fast path's rounding depends on the batch shape and a cache hit changes greedy tokens.
BATCH_INVARIANT_DTYPES = {torch.bfloat16}


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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


def _attend_rows(
    q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked (or `mask`ed per sequence) attention of q_rows [R, H, d] over [L, KH, d] keys.

    The query heads of a KV group are folded into the query axis, [KH, R * group, d], so every
    key is read once per KV head rather than once per query head. Returns [R, H, d], [R, H].
    """
    num_rows, num_heads, head_dim = q_rows.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    folded = q_rows.view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)
    folded = folded.reshape(1, num_kv_heads, num_rows * group, head_dim)
    out, lse = _attend(folded, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), scale, mask=mask)
    out = out.view(num_kv_heads, num_rows, group, head_dim).transpose(0, 1).reshape(num_rows, num_heads, head_dim)
    lse = lse.view(num_kv_heads, num_rows, group).transpose(0, 1).reshape(num_rows, num_heads)
    return out, lse


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    first_slot: Optional[int] = None,
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into their slots of the paged cache.

    `first_slot`, when the slots are consecutive from it, turns the scatter into a slice copy.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    if first_slot is not None:
        flat_k[first_slot : first_slot + len(k)] = k
        flat_v[first_slot : first_slot + len(v)] = v
        return
    flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def takes_invariant_path(meta: AttentionMetadata, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this step's attention runs invariant_attention.py (bf16 on CPU, unless opted out)."""
    return meta.batch_invariant and dtype in BATCH_INVARIANT_DTYPES and device.type == "cpu" and _CPU_FLASH is not None


def plan_step(meta: AttentionMetadata, k_cache: torch.Tensor) -> StepPlan:
    """The step's attention plan for caches shaped like `k_cache`: build once, pass to every layer.
    The compiled kernel needs none, and the invariant path plans its own calls (on first use), so the
    cascade's plan is built for neither."""
    if causal_kernel_for(k_cache) is not None or takes_invariant_path(meta, k_cache.dtype, k_cache.device):
        return StepPlan(parts=[], chunks=[], own_batches=[], decodes=None, merged_rows=None)
    return build_plan(meta, k_cache.shape[1], k_cache.element_size())


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    plan: Optional[StepPlan] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention of q [num_tokens, num_heads, head_dim] over the paged cache; returns q's shape.

    `k`, `v` [num_tokens, num_kv_heads, head_dim] are this step's own keys and values, already
    written to the cache; given, a prefill chunk reads them directly instead of from the cache.
    Grouped-query attention: num_heads must be a multiple of the cache's num_kv_heads. Without a
    `plan` (from `plan_step`) one is built for this call. With a sliding `window`, a row at position p
    reads only keys (p - window, p] (as transformers' sliding-window mask). With a `softcap` (Gemma 2), each
    score s is softcap * tanh(s / softcap) before the softmax.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    group = num_heads // num_kv_heads
    causal = causal_kernel_for(k_cache)
    if causal is not None:
        # Compiled (csrc/paged_causal.cpp): every row of the step in one call, prefill chunks and
        # decodes alike, read in place through the block tables; each row's sums in an order of its
        # own, so in either dtype a row's attention bits do not depend on the batch or the chunking.
        return causal(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            window or 0,
            softcap or 0.0,
        )
    if softcap is not None or (window is not None and max(meta.seq_lens_list, default=0) > window):
        # some row's window leaves keys out, or the scores are capped: rows over their keys, with a mask
        return windowed_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    if plan is None:
        plan = plan_step(meta, k_cache)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    if takes_invariant_path(meta, q.dtype, q.device):
        if plan.invariant_calls is None:
            plan.invariant_calls = invariant_calls(meta, k_cache.shape[1], group)
        return invariant_attention(q, flat_k, flat_v, plan.invariant_calls, plan.masks, scale, _attend)
    out = torch.empty_like(q)
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (out, lse) in plan.merge_index order
    merge_ids: list = []

    for part in plan.parts:
        pieces.append(_attend_rows(q[part.rows], part.keys.read(flat_k), part.keys.read(flat_v), scale))
        merge_ids.append(part.merge_ids)

    for chunk in plan.chunks:
        out[chunk.rows] = _attend_chunk(q, chunk, flat_k, flat_v, k, v, scale, group)
    for batch in plan.own_batches:
        pieces.append(_attend_own_batch(q, batch, flat_k, flat_v, k, v, scale))
        merge_ids.append(batch.merge_ids)
    if plan.decodes is not None:
        attended, lse = _attend_decodes(q, plan, flat_k, flat_v, scale, group)
        if plan.decodes.merge_ids is None:
            out.index_copy_(0, plan.decodes.rows, attended)
        else:
            pieces.append((attended, lse))
            merge_ids.append(plan.decodes.merge_ids)

    if pieces:
        _merge_into(out, plan, pieces, merge_ids)
    return out


def _attend_chunk(q, chunk, flat_k, flat_v, k, v, scale: float, group: int) -> torch.Tensor:
    """A prefill chunk in one call: causal over its own tokens, after its whole past when it has one."""
    query = q[chunk.rows].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
    if chunk.past is not None:
        keys, values = chunk.past.read(flat_k), chunk.past.read(flat_v)
    elif k is not None:
        keys, values = k[chunk.rows], v[chunk.rows]
    else:
        keys, values = flat_k.index_select(0, chunk.own_slots), flat_v.index_select(0, chunk.own_slots)
    attended = F.scaled_dot_product_attention(
        query,
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=group > 1,
    )
    return attended[0].transpose(0, 1)


def _attend_own_batch(q, batch, flat_k, flat_v, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The own tokens of split chunks of one length, causal within each: (out, lse) to merge."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = flat_k.shape[1]
    shape = (-1, batch.query_len, num_kv_heads, head_dim)
    if k is not None:
        keys, values = k.index_select(0, batch.rows), v.index_select(0, batch.rows)
    else:
        keys, values = flat_k.index_select(0, batch.own_slots), flat_v.index_select(0, batch.own_slots)
    query = q.index_select(0, batch.rows).view(-1, batch.query_len, num_heads, head_dim).transpose(1, 2)
    attended, lse = _attend(
        query, keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2), scale, is_causal=True
    )
    return attended.transpose(1, 2), lse.transpose(1, 2)


def _attend_decodes(q, plan: StepPlan, flat_k, flat_v, scale: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decode as one padded batch: (out [D, heads, d], lse [D, heads])."""
    decodes = plan.decodes
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = flat_k.shape[1]
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
            ~decodes.valid, float("-inf")
        )
    attended, lse = _attend(query, keys, values, scale, mask=mask)
    return attended.reshape(num_decodes, num_heads, head_dim), lse.reshape(num_decodes, num_heads)


def _merge_into(
    out: torch.Tensor, plan: StepPlan, pieces: list[tuple[torch.Tensor, torch.Tensor]], merge_ids: list
) -> None:
    """out[merged rows] = the log-sum-exp weighted average of each row's pieces (float32)."""
    if plan.merge_index is None:
        device = out.device
        plan.merge_index = torch.cat(
            [
                ids if isinstance(ids, torch.Tensor) else torch.arange(ids.start, ids.stop, device=device)
                for ids in merge_ids
            ]
        )
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
