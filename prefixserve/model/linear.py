"""The linear layer of every model here: oneDNN's packed weights on CPU, bf16 on CPUs without bf16
matmuls, and calls sized so that a row's result never depends on its batch.

  * `pack` lays the weight out once in oneDNN's blocked format: a plain matmul re-packs its weight
    on every call, which dominates at decode batch sizes (about 2x). The packed weight serves every
    batch size (an empty batch takes F.linear). float32 results differ from MKL's sgemm in summation
    order only; bf16 results are the same oneDNN kernels'.
  * bfloat16 where the CPU has no bf16 instructions (AVX2, AVX-512 without BF16, or oneDNN capped
    below them): oneDNN cannot pack bf16 weights on AVX2 and is 4.5x slower than float32 without the
    bf16 instructions, so the weight is upcast once (exactly) and packed in float32, and each call
    takes the bf16 input in float32 and rounds its output to bf16. That is the bf16 matmul's
    own arithmetic (bf16 products are exact in float32, sums in float32), at float32's speed.
  * batch invariance (`batch_invariant`, the default): calls are made only with the row counts
    row_calls.py measured to give each row the reference's bits (ModelRunner probes each shape once).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_caps import cpu_features, onednn_allows
from .row_calls import RowCalls, probe_once


@functools.lru_cache(maxsize=None)
def native_bfloat16_matmul() -> bool:
    """Whether oneDNN multiplies bf16 with the CPU's bf16 instructions here (AVX-512 BF16 or AMX, not
    capped below them by ONEDNN_MAX_CPU_ISA). Elsewhere bf16 weights are multiplied in float32: below
    those instructions oneDNN converts and multiplies in float32 itself, 4.5x slower than a packed
    float32 matmul (benchmarks/cpu_variants.py), and on AVX2 it cannot pack bf16 at all."""
    if not torch.backends.mkldnn.is_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is None or not check():
        return False
    return bool({"avx512_bf16", "amx_bf16"} & cpu_features()) and onednn_allows("AVX512_CORE_BF16")


class Linear(nn.Linear):
    """nn.Linear that uses a prepacked oneDNN weight once `pack` has run (CPU only)."""

    packed: Optional[torch.Tensor] = None
    packed_bias: Optional[torch.Tensor] = None
    batch_size_hint: Optional[int] = None
    emulated = False  # bf16 weights multiplied in float32 (no bf16 matmul on this CPU)
    batch_invariant = True  # ModelRunner sets it per engine, with the row calls it measured
    row_calls = RowCalls.ALL

    def pack(self, batch_size_hint: int) -> None:
        """Lay the weight out for oneDNN; call again after the weight changes (then plan the rows again)."""
        weight = self.weight.detach()
        self.emulated = weight.dtype == torch.bfloat16 and not native_bfloat16_matmul()
        if self.emulated:
            weight = weight.float()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)
        self.packed_bias = None if self.bias is None else self.bias.detach().to(weight.dtype)
        self.batch_size_hint = batch_size_hint
        self.row_calls = RowCalls.ALL

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """One call of the library, whatever x's row count."""
        out = self._sums(x)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _sums(self, x: torch.Tensor) -> torch.Tensor:
        """The matmul's result before any rounding of ours: float32 where bf16 is multiplied in float32."""
        if self.packed is None:
            if self._computes_in_float32(x):
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias)  # as packed, unpacked
            return F.linear(x, self.weight, self.bias)
        if self.emulated:
            return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.packed_bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.packed_bias, "none", [], "")

    def _computes_in_float32(self, x: torch.Tensor) -> bool:
        if self.packed is not None:
            return self.emulated
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not native_bfloat16_matmul()

    def plan_rows(self, batch_invariant: bool, max_rows: int) -> None:
        """Batch invariance on (probe this shape's accepted row counts, once per process) or off."""
        self.batch_invariant = batch_invariant
        if not batch_invariant:
            self.row_calls = RowCalls.ALL
            return
        layout = ("packed", self.batch_size_hint, self.emulated) if self.packed is not None else ("plain",)
        key = ("linear", self.bias is not None) + layout
        # Probed before our rounding to bf16, which would hide most differences (row_calls.py).
        self.row_calls = probe_once(key, self._sums, self.in_features, self.out_features, self.weight.dtype,
                                    self.weight.device, max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        return self.row_calls.run(self.matmul, x)


PACKED_WEIGHTS_MAX_BYTES = 2 << 30  # packing keeps a second copy of each weight; larger models skip it


def pack_linears(model: nn.Module, weight: torch.Tensor, batch_size_hint: int) -> bool:
    """Prepack every Linear of `model` for oneDNN (CPU, float32 or bfloat16); True when done.

    `weight` is one of the model's float weights (its dtype and device: a quantized embedding has none).
    Skipped (False) off the CPU, without oneDNN (these are the ops torch.compile's CPU backend uses
    for frozen linears), or when the copies would exceed PACKED_WEIGHTS_MAX_BYTES (bf16 on a CPU
    without bf16 matmuls packs float32 copies: twice the bytes).
    `batch_size_hint` is the typical number of rows per matmul.
    """
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    element_size = 4 if weight.dtype == torch.bfloat16 and not native_bfloat16_matmul() else weight.element_size()
    packed_bytes = sum(module.weight.numel() for module in linears) * element_size
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise")
            or packed_bytes > PACKED_WEIGHTS_MAX_BYTES):
        return False
    with torch.no_grad():
        for module in linears:
            module.pack(batch_size_hint)
    return True
