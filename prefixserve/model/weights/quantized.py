"""Weights kept quantized in memory: the layout the compiled matmul reads (csrc/quantized.h), made from
a GGUF tensor's blocks (gguf_blocks.py) or by quantizing a float weight (here).

A weight [out_features, in_features] is cut along each row into groups; a value is

    w = scale * (code - zero_point) + offset          (per group of 32 values; offset absent: 0)

    kind    from                 bits  codes                      scale, offset      bytes per value
    Q8_0    GGUF Q8_0, int8      8     int8                       float16, -         1.0625
    Q4_0    GGUF Q4_0            4     0..15, zero_point 8        float16, -         0.5625
    Q4_1    GGUF Q4_1, int4      4     0..15                      float16, float16   0.625
    Q4_K    GGUF Q4_K            4     0..15                      6-bit, 6-bit (*)   0.578
    Q5_0    GGUF Q5_0            5     0..31, zero_point 16       float16, -         0.6875
    Q5_1    GGUF Q5_1            5     0..31                      float16, float16   0.75
    Q5_K    GGUF Q5_K            5     0..31                      6-bit, 6-bit (*)   0.703
    Q6_K    GGUF Q6_K            6     0..63, zero_point 32       8-bit per 16 (**)  0.820
    Q3_K    GGUF Q3_K            3     0..7, zero_point 4         8-bit per 16 (***) 0.445
    Q2_K    GGUF Q2_K            2     0..3                       4-bit, 4-bit per 16 0.328
    IQ4_NL  GGUF IQ4_NL          4     levels[0..15] (+)          float16, -         0.5625
    IQ4_XS  GGUF IQ4_XS          4     levels[0..15] (+)          8-bit (****)       0.539

GGUF's Q8_0, Q4_*, Q5_0 and Q5_1 blocks store float16 scales, kept as they are (the same bytes as the
file); 5-bit codes are 16 bytes of low nibbles as Q4_1's, then the group's 32 high bits (Q5_0's layout).
(*) Q4_K's (and Q5_K's) scale is a 6-bit sub-block scale times its super-block's float16 d, its offset minus a 6-bit
minimum times dmin: the kernel forms both in float32, where the products are exact, from the file's
6-bit values (a byte each here, 4 bytes more per 256 values than the file's 144 or 176) and d and dmin.
(**) Q6_K's scale is per 16 values: an int8 sub-block scale times the super-block's float16 d, formed
in float32 by the kernel (exact); its codes are re-laid 24 bytes per group of 32 (quantized.h), the
file's 210 bytes per 256 values exactly. (***) Q3_K's scale likewise: its 6-bit sub-block scale less 32
as an int8 times d; its codes are 12 bytes per group of 32 (8 of low bit pairs, laid out as Q6_K's high
pairs, then the group's 32 high bits, as 5 bits hold them): 114 bytes per 256 values for the file's 110.
Q2_K's codes are 8 bytes of pairs per group, as Q3_K's low pairs, and its scale and minimum per 16 values
the file's bytes (a nibble each), then d and dmin: the file's 84 bytes per 256 values exactly; its scale is
d * scale, its offset -(dmin * min), formed in float32 (exact). IQ4_NL's and IQ4_XS's codes (Q4_0's nibbles)
stand for one of 16 non-uniform levels ((+) `levels`, gguf_blocks.IQ4_LEVELS, llama.cpp's kvalues_iq4nl), w =
scale * levels[code]; (****) IQ4_XS's scale is a 6-bit sub-block scale less 32 as an int8 times its
super-block's float16 d (138 bytes per 256 values for the file's 136), the products exact in float32. A GGUF
tensor of a type without a layout here (IQ3_*, IQ2_*, IQ1_*) is decoded by the format's reference reader and
quantized again to int8 (Q8_0's layout): finer than its source, so close to it, and said at start-up.

`--quantize int8|int4` quantizes a float checkpoint the same way as llama.cpp's Q8_0 and Q4_1 (round to
nearest; a group's scale from its largest magnitude, or its range).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

GROUP_SIZE = 32
KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
SUPER_BLOCK = 256  # values per K-quant (and IQ4_XS) super-block
QUANTIZE_CHOICES = ("int8", "int4")
_NO_OFFSETS = torch.empty(0)
_NO_LEVELS = torch.empty(0, dtype=torch.int8)


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight in the compiled kernel's layout; `codes` uint8 [out, in * bits / 8] (int8 values at 8 bits)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor]
    bits: int
    zero_point: int = 0
    group_size: int = GROUP_SIZE
    levels: Optional[torch.Tensor] = None  # int8 [16]: what a 4-bit code stands for (IQ4_*); None: code - zero_point

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 8 // self.bits

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What holds the weight in memory: codes, scales and (where present) offsets (levels are shared)."""
        return (self.codes, self.scales) + ((self.offsets,) if self.offsets is not None else ())

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors())

    def kernel_arguments(self) -> tuple:
        """The compiled kernels' weight arguments (quantized_matmul's after x, dequantize's): an empty
        tensor stands for no offsets."""
        offsets = _NO_OFFSETS if self.offsets is None else self.offsets
        levels = _NO_LEVELS if self.levels is None else self.levels
        return (self.codes, self.scales, offsets, self.bits, self.group_size, self.zero_point, levels)

    def layout(self) -> tuple:
        """What two weights must share to be one weight (their rows stacked)."""
        levels = None if self.levels is None else tuple(self.levels.tolist())
        return (self.bits, self.zero_point, self.group_size, self.scales.dtype, self.offsets is not None, levels)

    def select_rows(self, rows: torch.Tensor) -> "QuantizedWeight":
        """The weight of these rows (an index tensor), in that order."""
        offsets = None if self.offsets is None else self.offsets[rows]
        return replace(
            self,
            codes=self.codes[rows].contiguous(),
            scales=self.scales[rows].contiguous(),
            offsets=offsets if offsets is None else offsets.contiguous(),
        )

    def group_values(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Each group's scale and offset (None: no offsets) in float32, [out, groups]; Q4_K's from its
        6-bit values and float16 super-block factors, as the kernel forms them (exact products); Q6_K's
        and Q3_K's per 16 values, [out, 2 * groups], from their int8 scales and float16 d, likewise; Q2_K's
        per 16 values from its nibbles and float16 d and dmin."""
        if self.bits == 2:
            subs = self.in_features // 16
            factors = self.scales[:, subs:].contiguous().view(torch.float16).float().view(-1, subs // 16, 2)
            d, dmin = (factor.repeat_interleave(16, dim=1) for factor in factors.unbind(-1))
            nibbles = self.scales[:, :subs]
            return d * (nibbles & 0xF).float(), -(dmin * (nibbles >> 4).float())
        if self.bits in (6, 3):
            subs = self.in_features // 16
            d = self.scales[:, subs:].contiguous().view(torch.float16).float()
            scales = self.scales[:, :subs].contiguous().view(torch.int8).float()
            return d.repeat_interleave(SUPER_BLOCK // 16, dim=1) * scales, None
        if self.scales.dtype != torch.uint8:
            return self.scales.float(), None if self.offsets is None else self.offsets.float()
        if self.levels is not None:  # IQ4_XS: int8 scales, then a float16 d per 8 groups
            groups = self.in_features // self.group_size
            d = self.scales[:, groups:].contiguous().view(torch.float16).float()
            scales = self.scales[:, :groups].view(torch.int8).float()
            return d.repeat_interleave(SUPER_BLOCK // self.group_size, dim=1) * scales, None
        groups = self.offsets.shape[1]
        factors = self.scales[:, groups:].contiguous().view(torch.float16).float().view(-1, groups // 8, 2)
        d, dmin = (factor.repeat_interleave(8, dim=1) for factor in factors.unbind(-1))
        return d * self.scales[:, :groups].float(), -(dmin * self.offsets.float())

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the reference decoding in PyTorch (two roundings where the kernel's
        multiply-add has one, so within one float32 ulp of what the kernel computes)."""
        scales, offsets = self.group_values()
        rows, groups = self.out_features, self.in_features // self.group_size
        if self.bits == 8:
            codes = self.codes.view(torch.int8).to(torch.int32).view(rows, groups, self.group_size)
        elif self.bits in (3, 2):  # 8 bytes: value 8 i + j's low pair at bits 2 i of byte j; 3 bits: 4 of high bits
            packed = self.codes.view(rows, groups, self.group_size * self.bits // 8).to(torch.int32)
            codes = torch.cat([(packed[..., :8] >> (2 * i)) & 3 for i in range(4)], dim=-1)
            if self.bits == 3:
                high = torch.stack([(packed[..., 8:] >> i) & 1 for i in range(8)], dim=-1).reshape(rows, groups, 32)
                codes = codes | (high << 2)
        else:  # 16 bytes of low nibbles (value e in byte e % 16), then 5 and 6 bits' high bits
            packed = self.codes.view(rows, groups, self.group_size * self.bits // 8).to(torch.int32)
            codes = torch.cat([packed[..., :16] & 0xF, packed[..., :16] >> 4], dim=-1)
        if self.bits == 5:  # 4 bytes: value 8 b + i's high bit at bit i of byte b
            high = torch.stack([(packed[..., 16:] >> i) & 1 for i in range(8)], dim=-1)
            codes = codes | (high.reshape(rows, groups, 32) << 4)
        elif self.bits == 6:  # 8 bytes: value 8 i + j's high pair at bits 2 i of byte j
            codes = codes | (torch.cat([(packed[..., 16:] >> (2 * i)) & 3 for i in range(4)], dim=-1) << 4)
        if self.bits in (6, 3, 2):  # a scale (and for Q2_K an offset) per 16 values
            scales, offsets = (
                None
                if values is None
                else values.view(rows, 2 * groups, 1).expand(-1, -1, 16).reshape(rows, groups, 32)
                for values in (scales, offsets)
            )
        else:
            scales, offsets = (None if values is None else values.unsqueeze(-1) for values in (scales, offsets))
        levels = (codes - self.zero_point).float() if self.levels is None else self.levels.float()[codes]
        values = levels * scales
        if offsets is not None:
            values = values + offsets
        return values.view(rows, groups * self.group_size)


def float32_kernel_arguments(weight: torch.Tensor) -> tuple:
    """The compiled kernels' weight arguments for a float32 weight [out, in] read in place (bits 32: a view
    of its bytes, no scales, offsets, levels or zero point; csrc/quantized.h)."""
    return (weight.view(torch.uint8), _NO_OFFSETS, _NO_OFFSETS, 32, GROUP_SIZE, 0, _NO_LEVELS)


def stack_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """One weight of the parts' rows in order (a fused q/k/v or gate/up); the parts share a layout."""
    first = parts[0]
    assert all(part.layout() == first.layout() for part in parts), "stack only weights of one layout"
    offsets = None if first.offsets is None else torch.cat([part.offsets for part in parts])
    kinds = sorted({part.kind for part in parts})
    return replace(
        first,
        kind="+".join(kinds),
        codes=torch.cat([part.codes for part in parts]),
        scales=torch.cat([part.scales for part in parts]),
        offsets=offsets,
    )


def quantize(weight: torch.Tensor, bits: int) -> QuantizedWeight:
    """A float weight [out, in] quantized per group of 32: int8 as Q8_0 (scale = max |w| / 127), int4 as
    Q4_1 (scale = (max - min) / 15, offset = min), codes rounded to nearest under the float16 scale."""
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE:
        raise ValueError(
            f"cannot quantize a weight of {in_features} input features: it must be a multiple of "
            f"{GROUP_SIZE}; serve this model without --quantize"
        )
    groups = weight.detach().float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    if bits == 8:
        scales = (groups.abs().amax(-1) / 127).half()
        divisor = torch.where(scales == 0, 1.0, scales.float()).unsqueeze(-1)
        codes = torch.round(groups / divisor).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        return QuantizedWeight("Q8_0", codes.reshape(out_features, in_features), scales, None, 8)
    low, high = groups.amin(-1), groups.amax(-1)
    scales, offsets = ((high - low) / 15).half(), low.half()
    divisor = torch.where(scales == 0, 1.0, scales.float()).unsqueeze(-1)
    codes = torch.round((groups - offsets.float().unsqueeze(-1)) / divisor).clamp(0, 15).to(torch.uint8)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return QuantizedWeight("Q4_1", packed.reshape(out_features, in_features // 2), scales, offsets, 4)
