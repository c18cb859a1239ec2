"""Weights kept quantized in memory: the layout the compiled matmul reads (csrc/quantized.h), made from
a GGUF tensor's blocks or by quantizing a float weight.

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
    IQ4_NL  GGUF IQ4_NL          4     IQ4_LEVELS[0..15]          float16, -         0.5625
    IQ4_XS  GGUF IQ4_XS          4     IQ4_LEVELS[0..15]          8-bit (****)       0.539

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
d * scale, its offset -(dmin * min), formed in float32 (exact). IQ4_NL's and IQ4_XS's codes (Q4_0's
nibbles) stand for one of 16 non-uniform levels (`levels`, llama.cpp's kvalues_iq4nl), w = scale *
levels[code]; (****) IQ4_XS's scale is a 6-bit sub-block scale less 32 as an int8 times its super-block's
float16 d (138 bytes per 256 values for the file's 136), the products exact in float32. A GGUF tensor of a
type without a layout here (IQ3_*, IQ2_*, IQ1_*) is decoded by the format's reference reader and quantized
again to int8 (Q8_0's layout): finer than its source, so close to it, and said at start-up.

`--quantize int8|int4` quantizes a float checkpoint the same way as llama.cpp's Q8_0 and Q4_1
(round to nearest; a group's scale from its largest magnitude, or its range).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import torch

GROUP_SIZE = 32
KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
SUPER_BLOCK = 256  # values per K-quant (and IQ4_XS) super-block
QUANTIZE_CHOICES = ("int8", "int4")
# The values IQ4_NL's and IQ4_XS's 4-bit codes stand for (ggml's kvalues_iq4nl), shared by every such weight.
IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8)
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
        return replace(self, codes=self.codes[rows].contiguous(), scales=self.scales[rows].contiguous(),
                       offsets=offsets if offsets is None else offsets.contiguous())

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
            scales, offsets = (None if values is None else
                               values.view(rows, 2 * groups, 1).expand(-1, -1, 16).reshape(rows, groups, 32)
                               for values in (scales, offsets))
        else:
            scales, offsets = (None if values is None else values.unsqueeze(-1) for values in (scales, offsets))
        levels = (codes - self.zero_point).float() if self.levels is None else self.levels.float()[codes]
        values = levels * scales
        if offsets is not None:
            values = values + offsets
        return values.view(rows, groups * self.group_size)


def stack_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """One weight of the parts' rows in order (a fused q/k/v or gate/up); the parts share a layout."""
    first = parts[0]
    assert all(part.layout() == first.layout() for part in parts), "stack only weights of one layout"
    offsets = None if first.offsets is None else torch.cat([part.offsets for part in parts])
    kinds = sorted({part.kind for part in parts})
    return replace(first, kind="+".join(kinds), codes=torch.cat([part.codes for part in parts]),
                   scales=torch.cat([part.scales for part in parts]), offsets=offsets)


def quantize(weight: torch.Tensor, bits: int) -> QuantizedWeight:
    """A float weight [out, in] quantized per group of 32: int8 as Q8_0 (scale = max |w| / 127), int4 as
    Q4_1 (scale = (max - min) / 15, offset = min), codes rounded to nearest under the float16 scale."""
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE:
        raise ValueError(f"cannot quantize a weight of {in_features} input features: it must be a multiple of "
                         f"{GROUP_SIZE}; serve this model without --quantize")
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


def from_gguf_blocks(kind: str, data: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [out, bytes per row]) in our layout, without decoding a value."""
    if in_features % (SUPER_BLOCK if kind.endswith(("_K", "_XS")) else GROUP_SIZE):
        raise ValueError(f"a {kind} tensor of {in_features} columns is not whole blocks; the file is corrupt")
    rows = np.ascontiguousarray(data, dtype=np.uint8).reshape(out_features, -1)
    if kind == "Q4_K":
        return _from_q4_k(rows, out_features, in_features)
    if kind == "Q6_K":
        return _from_q6_k(rows, out_features, in_features)
    if kind == "Q5_K":
        return _from_q5_k(rows, out_features, in_features)
    if kind == "Q3_K":
        return _from_q3_k(rows, out_features, in_features)
    if kind == "Q2_K":
        return _from_q2_k(rows, out_features, in_features)
    if kind == "IQ4_XS":
        return _from_iq4_xs(rows, out_features, in_features)
    if kind in ("Q5_0", "Q5_1"):
        return _from_q5(kind, rows, out_features, in_features)
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "IQ4_NL": 18}[kind]
    blocks = rows.reshape(out_features, in_features // GROUP_SIZE, block_bytes)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).reshape(out_features, -1))
    if kind == "Q8_0":
        codes = blocks[..., 2:].reshape(out_features, in_features)
        return QuantizedWeight(kind, torch.from_numpy(codes.copy()), scales, None, 8)
    if kind in ("Q4_0", "IQ4_NL"):  # float16 d, then Q4_0's nibbles
        codes = torch.from_numpy(blocks[..., 2:].reshape(out_features, in_features // 2).copy())
        if kind == "IQ4_NL":
            return QuantizedWeight(kind, codes, scales, None, 4, levels=IQ4_LEVELS)
        return QuantizedWeight(kind, codes, scales, None, 4, zero_point=8)
    offsets = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(out_features, -1))
    codes = blocks[..., 4:].reshape(out_features, in_features // 2)
    return QuantizedWeight(kind, torch.from_numpy(codes.copy()), scales, offsets, 4)


def _from_q4_k(rows: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """Q4_K's 144-byte super-blocks of 256 values: float16 d and dmin, twelve bytes of 6-bit scales and
    minimums for eight sub-blocks of 32, then 128 bytes where each 32 bytes hold two sub-blocks (low
    nibbles the first, high nibbles the second). Value = d * scale_s * code - dmin * min_s. Kept: the
    6-bit scales and minimums a byte each, then per row each super-block's d and dmin bytes as they are."""
    blocks = rows.reshape(out_features, in_features // 256, 144)
    scales, offsets = _k_scales(blocks, out_features)
    quads = blocks[..., 16:].reshape(out_features, in_features // 256, 4, 32)
    values = np.stack([quads & 0x0F, quads >> 4], axis=3)  # [.., chunk, sub-block, 32 values]
    values = values.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    codes = (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8).reshape(out_features, -1)
    return QuantizedWeight("Q4_K", torch.from_numpy(codes), scales, offsets, 4)


def _k_scales(blocks: np.ndarray, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's scales and minimums (blocks [out, super-blocks, bytes]: d, dmin, twelve bytes of
    6-bit values for eight sub-blocks of 32) as kept: (6-bit scales then the d and dmin bytes, 6-bit
    minimums), a byte per value."""
    packed = blocks[..., 4:16].astype(np.uint8)
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sub_scales = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    sub_mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    factors = blocks[..., 0:4].reshape(out_features, -1)  # d, dmin of each super-block: float16 bytes
    scales = np.concatenate([sub_scales.reshape(out_features, -1), factors], axis=1)
    return torch.from_numpy(np.ascontiguousarray(scales)), torch.from_numpy(sub_mins.reshape(out_features, -1).copy())


def _high_bit_bytes(bits: np.ndarray) -> np.ndarray:
    """Bits [.., groups, 32] (0 or 1) as 4 bytes a group, value e's at bit e (little-endian, as Q5_0's qh)."""
    grouped = bits.astype(np.uint8).reshape(*bits.shape[:-1], 4, 8)
    return np.bitwise_or.reduce(grouped << np.arange(8, dtype=np.uint8), axis=-1)


def _pair_bytes(pairs: np.ndarray) -> np.ndarray:
    """2-bit values [.., groups, 32] as 8 bytes a group: byte j holds values j, 8 + j, 16 + j, 24 + j at bits
    0-1, 2-3, 4-5, 6-7 (Q6_K's high pairs, Q3_K's low pairs)."""
    quarters = pairs.astype(np.uint8).reshape(*pairs.shape[:-1], 4, 8)
    return quarters[..., 0, :] | (quarters[..., 1, :] << 2) | (quarters[..., 2, :] << 4) | (quarters[..., 3, :] << 6)


def _five_bit_codes(values: np.ndarray) -> np.ndarray:
    """5-bit values [.., groups, 32] as kept: 16 bytes of low nibbles (Q4_1's order), then 4 bytes holding
    value e's high bit at bit e."""
    nibbles = (values[..., :16] & 0xF) | ((values[..., 16:] & 0xF) << 4)
    return np.concatenate([nibbles, _high_bit_bytes(values >> 4)], axis=-1).astype(np.uint8)


def _from_q5(kind: str, rows: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """Q5_0 (float16 d, 4 bytes of high bits, 16 of low nibbles: value = d * (code - 16)) and Q5_1 (d, m,
    then as Q5_0: value = d * code + m) blocks of 32: the bytes reordered, nothing decoded."""
    offset_bytes = 2 if kind == "Q5_1" else 0
    blocks = rows.reshape(out_features, in_features // GROUP_SIZE, 22 + offset_bytes)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).reshape(out_features, -1))
    offsets = (torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(out_features, -1))
               if offset_bytes else None)
    high, low = blocks[..., 2 + offset_bytes:6 + offset_bytes], blocks[..., 6 + offset_bytes:]
    codes = np.concatenate([low, high], axis=-1).reshape(out_features, -1)
    return QuantizedWeight(kind, torch.from_numpy(codes.copy()), scales, offsets, 5,
                           zero_point=0 if offset_bytes else 16)


def _from_q5_k(rows: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """Q5_K's 176-byte super-blocks: Q4_K's d, dmin and 6-bit scales and minimums, 32 bytes whose bit s
    of byte l is the high bit of value l of sub-block s, then Q4_K's 128 bytes of low nibbles."""
    blocks = rows.reshape(out_features, in_features // SUPER_BLOCK, 176)
    scales, offsets = _k_scales(blocks, out_features)
    quads = blocks[..., 48:].reshape(out_features, -1, 4, 1, 32)
    low = (quads >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0xF  # [.., pair, sub-block of it, 32]
    high = (blocks[..., 16:48].reshape(out_features, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    values = low.reshape(out_features, -1, 8, 32) | (high << 4)
    codes = _five_bit_codes(values.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE))
    return QuantizedWeight("Q5_K", torch.from_numpy(codes.reshape(out_features, -1)), scales, offsets, 5)


def _from_q6_k(rows: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """Q6_K's 210-byte super-blocks of 256 values: 128 bytes of low nibbles, 64 of high bit pairs, 16
    int8 scales (one per 16 values), float16 d. Value = d * scale * (code - 32). Kept: the 6-bit codes
    re-laid per group of 32 (16 bytes of low nibbles as Q4_1 lays them, then 8 bytes whose byte j holds
    the high pairs of values j, 8 + j, 16 + j, 24 + j), then per row the int8 scales and each d's bytes."""
    supers = in_features // SUPER_BLOCK
    blocks = rows.reshape(out_features, supers, 210)
    low = blocks[..., :128].reshape(out_features, supers, 2, 2, 32)  # [.., half, quarter pair, 32]
    high = blocks[..., 128:192].reshape(out_features, supers, 2, 1, 32)
    quarters = [(low[..., i % 2, :] >> (4 * (i // 2)) & 0xF) | ((high[..., 0, :] >> (2 * i) & 3) << 4)
                for i in range(4)]  # the file's value order within each half: quarters of 32
    values = np.stack(quarters, axis=3).reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    nibbles = (values[..., :16] & 0xF) | ((values[..., 16:] & 0xF) << 4)
    codes = np.concatenate([nibbles, _pair_bytes(values >> 4)], axis=-1).astype(np.uint8).reshape(out_features, -1)
    scales = np.concatenate([blocks[..., 192:208].reshape(out_features, -1), blocks[..., 208:210].reshape(out_features, -1)],
                            axis=1)
    return QuantizedWeight("Q6_K", torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scales)), None, 6,
                           zero_point=32)


def _from_q3_k(rows: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """Q3_K's 110-byte super-blocks of 256 values: 32 bytes of high bits (bit 4 h + j of byte l: value
    128 h + 32 j + l), 64 bytes of low pairs (bits 2 j of byte 32 h + l: the same value), twelve bytes of
    sixteen 6-bit scales (one per 16 values), float16 d. Value = d * (scale - 32) * (code - 4). Kept: the
    codes re-laid per group of 32 (8 bytes of low pairs, then 4 of high bits), then per row the scales less
    32 as int8 and each d's bytes, as Q6_K's."""
    supers = in_features // SUPER_BLOCK
    blocks = rows.reshape(out_features, supers, 110)
    high_mask = blocks[..., 0:32].reshape(out_features, supers, 1, 1, 32)
    low_pairs = blocks[..., 32:96].reshape(out_features, supers, 2, 1, 32)  # [.., half, 1, 32]
    low = (low_pairs >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [.., half, quarter, 32]
    high = (high_mask >> np.arange(8, dtype=np.uint8).reshape(2, 4, 1)) & 1
    values = (low | (high << 2)).reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    codes = np.concatenate([_pair_bytes(values & 3), _high_bit_bytes(values >> 2)], axis=-1)
    packed = blocks[..., 96:108]  # scale i: low nibble of byte i % 8 (high nibble from i = 8 on), then bits
    low_nibbles = np.concatenate([packed[..., :8] & 0xF, packed[..., :8] >> 4], axis=-1)  # 2 (i / 4) of byte 8 + i % 4
    high_pairs = np.concatenate([(packed[..., 8:] >> (2 * i)) & 3 for i in range(4)], axis=-1)
    sub_scales = (low_nibbles | (high_pairs << 4)).astype(np.int16) - 32
    scales = np.concatenate([sub_scales.astype(np.int8).view(np.uint8).reshape(out_features, -1),
                             blocks[..., 108:110].reshape(out_features, -1)], axis=1)
    return QuantizedWeight("Q3_K", torch.from_numpy(codes.astype(np.uint8).reshape(out_features, -1)),
                           torch.from_numpy(np.ascontiguousarray(scales)), None, 3, zero_point=4)


def _from_q2_k(rows: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """Q2_K's 84-byte super-blocks of 256 values: sixteen bytes of a 4-bit scale (low nibble) and minimum
    (high nibble) per 16 values, 64 bytes of pairs (bits 2 j of byte 32 h + l: value 128 h + 32 j + l),
    float16 d and dmin. Value = d * scale * code - dmin * min. Kept: the codes re-laid per group of 32 (8
    bytes, as Q3_K's low pairs), then per row the scale bytes as they are and each d and dmin's bytes."""
    supers = in_features // SUPER_BLOCK
    blocks = rows.reshape(out_features, supers, 84)
    pairs = blocks[..., 16:80].reshape(out_features, supers, 2, 1, 32)  # [.., half, 1, 32]
    values = (pairs >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [.., half, quarter, 32]
    codes = _pair_bytes(values.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE))
    scales = np.concatenate([blocks[..., :16].reshape(out_features, -1), blocks[..., 80:84].reshape(out_features, -1)],
                            axis=1)
    return QuantizedWeight("Q2_K", torch.from_numpy(codes.reshape(out_features, -1)),
                           torch.from_numpy(np.ascontiguousarray(scales)), None, 2)


def _from_iq4_xs(rows: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """IQ4_XS's 136-byte super-blocks of 256 values: float16 d, a uint16 of the eight sub-blocks' high scale
    bit pairs (bits 2 s), four bytes of their low scale nibbles (sub-block s: byte s / 2, high nibble for odd
    s), then 16 bytes of Q4_0's nibbles per sub-block of 32. Value = d * (scale - 32) * IQ4_LEVELS[code].
    Kept: the nibbles as they are, then per row the scales less 32 as int8 and each d's bytes."""
    supers = in_features // SUPER_BLOCK
    blocks = rows.reshape(out_features, supers, 136)
    high = blocks[..., 2:4].copy().view("<u2").astype(np.int16)  # [.., 1]
    low = blocks[..., 4:8]
    low_nibbles = np.stack([low & 0xF, low >> 4], axis=-1).reshape(out_features, supers, 8).astype(np.int16)
    high_pairs = (high >> (2 * np.arange(8, dtype=np.int16))) & 3
    sub_scales = (low_nibbles | (high_pairs << 4)) - 32
    scales = np.concatenate([sub_scales.astype(np.int8).view(np.uint8).reshape(out_features, -1),
                             blocks[..., 0:2].reshape(out_features, -1)], axis=1)
    codes = blocks[..., 8:].reshape(out_features, in_features // 2)
    return QuantizedWeight("IQ4_XS", torch.from_numpy(codes.copy()), torch.from_numpy(np.ascontiguousarray(scales)),
                           None, 4, levels=IQ4_LEVELS)
