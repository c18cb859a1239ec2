"""The linear layer of every model here: float32 weights read in place by our compiled kernel, oneDNN's
packed weights for the rest on CPU, bf16 on CPUs without bf16 matmuls, and calls sized so that a row's
result never depends on its batch.

  * float32 weights on a CPU with our AVX2 or AVX-512 kernels (`use_kernel`): the quantized matmul's
    tiles (csrc/quantized_matmul.cpp, a float32 weight as "bits 32") read the weight where it lies,
    every row in the same order whatever the call's row count: no probe, no padding, no second copy.
    A batch-1 decode streams the weight once with prefetching; oneDNN pads a lone row to two (its
    float32 kernels sum a lone row in another order) and re-blocks small calls. SmolLM2's shapes on an
    AVX-512 EPYC, 2 threads: 1-8 rows 0.45-0.9x oneDNN's time, 16-64 rows 0.8-1.05x, 512 rows 1.0-1.15x;
    the avx2 variant against oneDNN capped at AVX2 likewise, 1.1-1.2x at 512 (benchmarks/quantized_matmul.py).
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

from . import kernels
from .cpu_caps import cpu_features, onednn_allows
from .row_calls import RowCalls, probe_once
from .weights.quantized import float32_kernel_arguments

KERNEL_BACKENDS = ("avx512", "avx2")  # where our float32 tiles were measured against oneDNN's


def float_kernel():
    """The compiled kernels that multiply float32 weights here, or None (oneDNN's packed matmul then)."""
    compiled = kernels.compiled
    return compiled if compiled is not None and compiled.backend in KERNEL_BACKENDS else None


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
    """nn.Linear that multiplies with our compiled kernel once `use_kernel` has run, or a prepacked oneDNN
    weight once `pack` has (CPU only)."""

    packed: Optional[torch.Tensor] = None
    packed_bias: Optional[torch.Tensor] = None
    kernel_weight: Optional[tuple] = None  # the compiled kernel's arguments for this float32 weight (use_kernel)
    kernel_bias: Optional[torch.Tensor] = None
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
        self.kernel_weight = self.kernel_bias = None
        self.row_calls = RowCalls.ALL

    def can_use_kernel(self) -> bool:
        """Whether our compiled kernel can multiply this weight in place: float32 on the CPU, contiguous,
        its rows whole groups of 32 values."""
        weight = self.weight
        return (
            float_kernel() is not None
            and weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and self.in_features % 32 == 0
            and (self.bias is None or self.bias.dtype == torch.float32)
        )

    def use_kernel(self) -> None:
        """Multiply with our compiled kernel, reading the weight where it lies (a view of its bytes, so
        an in-place update of the weight is seen; call again after replacing the parameter)."""
        if not self.can_use_kernel():
            raise ValueError(
                "our float32 kernel takes a contiguous float32 CPU weight whose rows are a multiple "
                f"of 32 values (this one: {self.weight.dtype}, {self.in_features} values) on a CPU "
                f"with the {' or '.join(KERNEL_BACKENDS)} kernels; call pack() instead"
            )
        self.kernel_weight = float32_kernel_arguments(self.weight.detach())
        self.kernel_bias = None if self.bias is None else self.bias.detach().contiguous()
        self.packed = self.packed_bias = None
        self.emulated = False
        self.row_calls = RowCalls.ALL

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """One call of the library, whatever x's row count."""
        out = self._sums(x)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _sums(self, x: torch.Tensor) -> torch.Tensor:
        """The matmul's result before any rounding of ours: float32 where bf16 is multiplied in float32."""
        compiled = kernels.compiled
        if self.kernel_weight is not None and compiled is not None and x.device.type == "cpu":
            x32 = x.reshape(-1, self.in_features).float()
            x32 = x32 if x32.stride(1) == 1 else x32.contiguous()
            out = compiled.quantized_matmul(x32, *self.kernel_weight, self.kernel_bias)
            return out.view(*x.shape[:-1], self.out_features)
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
        if not batch_invariant or self.kernel_weight is not None:  # our kernel: every row its own by construction
            self.row_calls = RowCalls.ALL
            return
        layout = ("packed", self.batch_size_hint, self.emulated) if self.packed is not None else ("plain",)
        key = ("linear", self.bias is not None) + layout
        # Probed before our rounding to bf16, which would hide most differences (row_calls.py).
        self.row_calls = probe_once(
            key, self._sums, self.in_features, self.out_features, self.weight.dtype, self.weight.device, max_rows
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        return self.row_calls.run(self.matmul, x)


PACKED_WEIGHTS_MAX_BYTES = 2 << 30  # packing keeps a second copy of each weight; larger models skip it


def pack_linears(model: nn.Module, weight: torch.Tensor, batch_size_hint: int) -> bool:
    """Prepare every Linear of `model` for the CPU: a float32 weight read in place by our compiled kernel
    where it can be (float_kernel(), Linear.can_use_kernel), the others prepacked for oneDNN (CPU,
    float32 or bfloat16); True when every Linear is done.

    `weight` is one of the model's float weights (its dtype and device: a quantized embedding has none).
    Skipped (False) off the CPU, without oneDNN (these are the ops torch.compile's CPU backend uses
    for frozen linears), or when the copies would exceed PACKED_WEIGHTS_MAX_BYTES (bf16 on a CPU
    without bf16 matmuls packs float32 copies: twice the bytes).
    `batch_size_hint` is the typical number of rows per matmul.
    """
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    kernel_linears = [module for module in linears if module.can_use_kernel()]
    for module in kernel_linears:
        module.use_kernel()
    linears = [module for module in linears if module.kernel_weight is None]
    if kernel_linears and not linears:  # nothing left for oneDNN
        return True
    element_size = 4 if weight.dtype == torch.bfloat16 and not native_bfloat16_matmul() else weight.element_size()
    packed_bytes = sum(module.weight.numel() for module in linears) * element_size
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_linear_pointwise")
        or packed_bytes > PACKED_WEIGHTS_MAX_BYTES
    ):
        return False
    with torch.no_grad():
        for module in linears:
            module.pack(batch_size_hint)
    return True
