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

The step's calls, their shapes and the constants named above (KEY_MULTIPLE, SEGMENT_KEYS, ...) are
planned in invariant_plan.py; this module runs them and merges the parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..cpu_caps import AVX512, aten_capability, cpu_features, mkl_allows_avx512, onednn_allows
from .backend import AttentionBackend
from .invariant_plan import SEGMENT_KEYS, InvariantCall, InvariantPlan, SegmentCall, invariant_calls
from .metadata import AttentionMetadata
from .partials import attend
from .windowed import MASKED_ROWS, needs_masked_rows, windowed_attention


def measured_here() -> bool:
    """Whether this CPU runs the flash kernel's gemms that the shapes above were measured on: AVX-512
    in ATen, MKL and oneDNN (not capped below it). MKL's AVX2 sgemm rounds other shapes differently
    (measured: MKL_ENABLE_INSTRUCTIONS=AVX2 changes cache-hit outputs), so elsewhere bf16 without the
    compiled kernel is not known to be exact and the engine refuses it (engine/device.py)."""
    return (
        AVX512 <= cpu_features()
        and aten_capability() == "AVX512"
        and mkl_allows_avx512()
        and onednn_allows("AVX512_CORE")
    )


@dataclass
class InvariantStep:
    """A step's plan for one pool: its calls, planned by the first layer (which knows the heads a KV group has),
    and their additive masks per dtype, both read by every later layer."""

    meta: AttentionMetadata
    block_size: int
    calls: Optional[InvariantPlan] = None
    masks: dict = field(default_factory=dict)

    def calls_for(self, group: int) -> InvariantPlan:
        if self.calls is None:
            self.calls = invariant_calls(self.meta, self.block_size, group)
        return self.calls


class InvariantAttention(AttentionBackend):
    """bf16 on the CPU without the compiled kernel, where the engine asks for batch invariance (the default):
    exists because the cascade's rounding depends on the batch, and then a cache hit changes greedy tokens."""

    name = "invariant"

    def plan(
        self,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
    ) -> InvariantStep | str:
        if needs_masked_rows(meta, window, softcap):
            return MASKED_ROWS
        return InvariantStep(meta, k_cache.shape[1])

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
        num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], k_cache.shape[3]
        assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
        if plan is None:
            plan = self.plan(meta, k_cache, window, softcap)
        if plan is MASKED_ROWS:
            return windowed_attention(q, k_cache, v_cache, meta, scale, window, softcap)
        flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
        return invariant_attention(q, flat_k, flat_v, plan.calls_for(num_heads // num_kv_heads), plan.masks, scale)


def invariant_attention(
    q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, plan: InvariantPlan, masks: dict, scale: float
) -> torch.Tensor:
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
        keys, values = _segment_keys(flat_k, flat_v, call, num_entries)
        attended, lse = unfold(call, num_entries, *attend(fold(call, num_entries), keys, values, scale))
        parts[call.parts, call.targets] = attended.float()
        lses[call.parts, call.targets] = lse

    gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a chunk's keys, read once per layer
    for index, call in enumerate(plan.calls):
        num_entries = len(call.rows) // call.rows_per_entry
        mask = _tail_mask(masks, index, call, num_entries, q.dtype, group)
        keys, values = _tail_keys(flat_k, flat_v, call, num_entries, gathered)
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
            merged[first:end] = _merge(
                [parts[part, first:end] for part in order], [lses[part, first:end] for part in order]
            )
        out.index_copy_(0, plan.merged_rows, merged.to(q.dtype))
    return out


def _segment_keys(
    flat_k: torch.Tensor, flat_v: torch.Tensor, call: SegmentCall, num_entries: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [entries, kv_heads, SEGMENT_KEYS, d] of a segment call, gathered once a segment."""
    num_kv_heads, head_dim = flat_k.shape[1], flat_k.shape[2]
    shape = (len(call.slots), SEGMENT_KEYS, num_kv_heads, head_dim)
    keys = flat_k.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
    values = flat_v.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
    if len(call.slots) == 1:  # one segment read by all the call's entries
        keys, values = keys.expand(num_entries, -1, -1, -1), values.expand(num_entries, -1, -1, -1)
    return keys, values


def _tail_mask(
    masks: dict, index: int, call: InvariantCall, num_entries: int, dtype: torch.dtype, group: int
) -> torch.Tensor:
    """The additive mask of the step's tail call `index`, cached in `masks` (the step plan's)."""
    per_entry, key_start, num_keys = call.rows_per_entry, call.key_start, call.num_keys
    mask = masks.get(("invariant", index, dtype))
    if mask is None:  # additive, [entries, 1, rows x group, keys]: built once per step, shared by the layers
        additive = torch.zeros(call.visible.shape, dtype=dtype).masked_fill(~call.visible, float("-inf"))
        mask = additive.view(num_entries, per_entry, 1, num_keys - key_start).expand(-1, -1, group, -1)
        mask = masks[("invariant", index, dtype)] = mask.reshape(num_entries, 1, per_entry * group, -1)
    return mask


def _tail_keys(
    flat_k: torch.Tensor, flat_v: torch.Tensor, call: InvariantCall, num_entries: int, gathered: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [entries, kv_heads, keys, d] of a tail call, keys [key_start, num_keys)."""
    key_start, num_keys = call.key_start, call.num_keys
    num_kv_heads, head_dim = flat_k.shape[1], flat_k.shape[2]
    if call.slots.dim() == 1:  # a part of one chunk's keys, read by each of the call's entries
        if id(call.slots) not in gathered:
            gathered[id(call.slots)] = (
                flat_k.index_select(0, call.slots).transpose(0, 1).unsqueeze(0),
                flat_v.index_select(0, call.slots).transpose(0, 1).unsqueeze(0),
            )
        chunk_keys, chunk_values = gathered[id(call.slots)]
        keys = chunk_keys[:, :, key_start:num_keys].expand(num_entries, -1, -1, -1)
        values = chunk_values[:, :, key_start:num_keys].expand(num_entries, -1, -1, -1)
    else:
        shape = (num_entries, num_keys - key_start, num_kv_heads, head_dim)
        keys = flat_k.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
        values = flat_v.index_select(0, call.slots.reshape(-1)).view(shape).transpose(1, 2)
    return keys, values


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
