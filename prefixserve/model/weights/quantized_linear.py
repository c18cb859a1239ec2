"""The layers whose weights stay quantized (quantized.py): a linear layer and an embedding.

* QuantizedLinear multiplies float activations by the quantized weight with the compiled kernel
  (csrc/quantized_matmul.cpp: each row's bits its own, whatever else is in the call), in float32 and
  rounded to the activations' dtype. A fused projection whose parts came in different layouts (a
  GGUF mixing Q4_K and Q6_K) keeps one weight per layout and lays their outputs side by side.
* Without the compiled kernels (or off the CPU) the reference runs: the weight decoded in PyTorch,
  a slice of rows at a time, and a float32 matmul, sized by the row calls row_calls.py measures
  (as linear.py's are) so that rows stay independent of their batch there too. It reads 4-8x the
  bytes of the kernel: a fallback, never the fast path.
* QuantizedEmbedding decodes only the rows it looks up.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..row_calls import RowCalls, probe_once
from .quantized import QuantizedWeight, stack_rows

_DECODE_ROWS = 4096  # weight rows the reference decodes at a time (a 4096 x 4096 slice is 64 MiB)


def _compiled_for(x: torch.Tensor):
    return kernels.compiled if x.device.type == "cpu" else None


def _decode(weight: QuantizedWeight, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 rows of the weight (all, or those indexed), decoded as the kernel decodes them where it runs."""
    if rows is not None:
        weight = weight.select_rows(rows)
    compiled = kernels.compiled
    return weight.dequantize() if compiled is None else compiled.dequantize(*weight.kernel_arguments())


def merge_layouts(parts: Sequence[QuantizedWeight]) -> list[QuantizedWeight]:
    """Consecutive parts of one layout stacked into one weight (one kernel call instead of several)."""
    merged: list[list[QuantizedWeight]] = []
    for part in parts:
        if merged and merged[-1][0].layout() == part.layout():
            merged[-1].append(part)
        else:
            merged.append([part])
    return [group[0] if len(group) == 1 else stack_rows(group) for group in merged]


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W kept quantized, as one or more row blocks of W (`parts`, in order)."""

    def __init__(self, parts: Sequence[QuantizedWeight], bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.parts = merge_layouts(parts)
        self.in_features = self.parts[0].in_features
        self.out_features = sum(part.out_features for part in self.parts)
        if any(part.in_features != self.in_features for part in self.parts):
            raise ValueError("the parts of a quantized projection must share their input features")
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.row_calls = RowCalls.ALL
        self._arguments: Optional[tuple] = None  # the one part's kernel arguments, made on first use

    @property
    def weight_bytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def kinds(self) -> list[str]:
        return [part.kind for part in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if self._one_call is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous():
            # One weight, no bias, the kernel at hand: matmul()'s one call, without its steps (a decode
            # token makes 121 of these calls, each a few microseconds of Python otherwise).
            return kernels.compiled.quantized_matmul(x, *self._one_call, None)
        return self.row_calls.run(self.matmul, x)

    __call__ = forward  # no hooks on a layer this hot: nn.Module's call machinery costs a decode step ~0.3 ms

    @property
    def _one_call(self) -> Optional[tuple]:
        """The kernel's weight arguments where one call computes every row (else None)."""
        if len(self.parts) != 1 or self.bias is not None or kernels.compiled is None:
            return None
        if self._arguments is None:
            self._arguments = self.parts[0].kernel_arguments()
        return self._arguments

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """One call over all of x's rows, in float32, rounded to x's dtype."""
        x32 = x.float().contiguous()
        compiled = _compiled_for(x32)
        outputs = [self._multiply(compiled, x32, part) for part in self.parts]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        if self.bias is not None:
            out = out + self.bias
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def _multiply(compiled, x: torch.Tensor, part: QuantizedWeight) -> torch.Tensor:
        if compiled is not None:
            return compiled.quantized_matmul(x, *part.kernel_arguments(), None)
        slices = []
        for first in range(0, part.out_features, _DECODE_ROWS):
            rows = torch.arange(first, min(first + _DECODE_ROWS, part.out_features))
            slices.append(F.linear(x, part.select_rows(rows).dequantize().to(x.device)))
        return slices[0] if len(slices) == 1 else torch.cat(slices, dim=1)

    def plan_rows(self, batch_invariant: bool, max_rows: int) -> None:
        """The compiled kernel keeps rows independent by construction; the reference's matmul is probed."""
        if not batch_invariant or kernels.compiled is not None:
            self.row_calls = RowCalls.ALL
            return
        key = ("quantized", self.bias is not None) + tuple(part.layout() for part in self.parts)
        self.row_calls = probe_once(
            key, self.matmul, self.in_features, self.out_features, torch.float32, torch.device("cpu"), max_rows
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kinds={self.kinds}"


class QuantizedEmbedding(nn.Module):
    """Token embeddings kept quantized; a lookup decodes its rows into `dtype`."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    @property
    def weight_bytes(self) -> int:
        return self.weight.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = _decode(self.weight, flat).to(device=input_ids.device, dtype=self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.weight.kind}"
