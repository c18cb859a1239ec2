"""The cascade: the pure-PyTorch reference backend, which reads each part of a context the cheapest way.

It exists for what the compiled kernel does not cover (no kernels built, another device) and as the reference
the kernel is tested against. Softmax attention over a key set is the log-sum-exp merge of attention over its
parts, and does not depend on key order, so each part is read the cheapest way and the parts are merged
(partials.py):

    context of sequence i:  [ shared prefix | body ......... | rest | this step's tokens ]
    read as:                  once per group  in place (view)  gathered  causal, fresh K/V
    position:                 0             P               B      past              seq_len

  * shared prefix (as Hydragen): sequences whose block tables start with the same block ids (a prefix-cache
    hit) read those K/V ONCE for all their query rows;
  * body: a run of blocks whose ids form a consecutive range is one slice of the cache: no copy;
  * rest: the few remaining slots are gathered (decodes as one padded batch, with their own token).

A sequence with nothing to share and no long run takes a single call and no merge. The plan (step_plan.py) is
built once per step and pool and handed to every layer. In bf16 its rounding depends on the batch: engines
that ask for batch invariance take invariant.py instead.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .backend import AttentionBackend
from .metadata import AttentionMetadata
from .partials import attend as _attend
from .step_plan import StepPlan, build_plan
from .windowed import MASKED_ROWS, needs_masked_rows, windowed_attention


class CascadeAttention(AttentionBackend):
    name = "cascade"

    def plan(
        self,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
    ) -> StepPlan | str:
        if needs_masked_rows(meta, window, softcap):  # no plan over keys a window released
            return MASKED_ROWS
        return build_plan(meta, k_cache.shape[1], k_cache.element_size())

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        plan: object = None,
        k: Optional[torch.Tensor] = None,
        v: Optional[torch.Tensor] = None,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
        group = num_heads // num_kv_heads
        if plan is None:
            plan = self.plan(meta, k_cache, window, softcap)
        if plan is MASKED_ROWS:
            return windowed_attention(q, k_cache, v_cache, meta, scale, window, softcap)
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        if k is None and (plan.chunks or plan.own_batches):  # the step's own keys, read back from their slots
            k, v = flat_k.index_select(0, meta.slot_mapping), flat_v.index_select(0, meta.slot_mapping)
        out = torch.empty_like(q)
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (out, lse) in plan.merge_index order
        merge_ids: list = []

        for part in plan.parts:
            pieces.append(_attend_rows(q[part.rows], part.keys.read(flat_k), part.keys.read(flat_v), scale))
            merge_ids.append(part.merge_ids)

        for chunk in plan.chunks:
            out[chunk.rows] = _attend_chunk(q, chunk, flat_k, flat_v, k, v, scale, group)
        for batch in plan.own_batches:
            pieces.append(_attend_own_batch(q, batch, k, v, scale))
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


def _attend_chunk(q, chunk, flat_k, flat_v, k, v, scale: float, group: int) -> torch.Tensor:
    """A prefill chunk in one call: causal over its own tokens, after its whole past when it has one."""
    query = q[chunk.rows].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
    if chunk.past is not None:
        keys, values = chunk.past.read(flat_k), chunk.past.read(flat_v)
    else:
        keys, values = k[chunk.rows], v[chunk.rows]
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


def _attend_own_batch(q, batch, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The own tokens of split chunks of one length, causal within each: (out, lse) to merge."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    shape = (-1, batch.query_len, k.shape[1], head_dim)
    keys, values = k.index_select(0, batch.rows), v.index_select(0, batch.rows)
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
