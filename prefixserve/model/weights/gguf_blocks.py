"""A GGUF tensor's raw blocks in the layout the compiled matmul reads (quantized.py's table), without decoding a
value: the bytes reordered, the K-quants' packed scales unpacked a byte each. Each layout is checked against the
format's reference reader in tests/test_model_quantized.py."""

from __future__ import annotations

import numpy as np
import torch

from .quantized import GROUP_SIZE, SUPER_BLOCK, QuantizedWeight

# The values IQ4_NL's and IQ4_XS's 4-bit codes stand for (ggml's kvalues_iq4nl), shared by every such weight.
IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8)


def from_gguf_blocks(kind: str, data: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [out, bytes per row]) in our layout, without decoding a value."""
    if in_features % (SUPER_BLOCK if kind in _SUPER_BLOCK_LAYOUTS else GROUP_SIZE):
        raise ValueError(f"a {kind} tensor of {in_features} columns is not whole blocks; the file is corrupt")
    rows = np.ascontiguousarray(data, dtype=np.uint8).reshape(out_features, -1)
    if kind in ("Q5_0", "Q5_1"):
        return _from_q5(kind, rows, out_features, in_features)
    if kind in _SUPER_BLOCK_LAYOUTS:
        return _SUPER_BLOCK_LAYOUTS[kind](rows, out_features, in_features)
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
    offsets = (
        torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(out_features, -1)) if offset_bytes else None
    )
    high, low = blocks[..., 2 + offset_bytes : 6 + offset_bytes], blocks[..., 6 + offset_bytes :]
    codes = np.concatenate([low, high], axis=-1).reshape(out_features, -1)
    return QuantizedWeight(
        kind, torch.from_numpy(codes.copy()), scales, offsets, 5, zero_point=0 if offset_bytes else 16
    )


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
    quarters = [
        (low[..., i % 2, :] >> (4 * (i // 2)) & 0xF) | ((high[..., 0, :] >> (2 * i) & 3) << 4) for i in range(4)
    ]  # the file's value order within each half: quarters of 32
    values = np.stack(quarters, axis=3).reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    nibbles = (values[..., :16] & 0xF) | ((values[..., 16:] & 0xF) << 4)
    codes = np.concatenate([nibbles, _pair_bytes(values >> 4)], axis=-1).astype(np.uint8).reshape(out_features, -1)
    scales = np.concatenate(
        [blocks[..., 192:208].reshape(out_features, -1), blocks[..., 208:210].reshape(out_features, -1)], axis=1
    )
    return QuantizedWeight(
        "Q6_K", torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scales)), None, 6, zero_point=32
    )


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
    scales = np.concatenate(
        [
            sub_scales.astype(np.int8).view(np.uint8).reshape(out_features, -1),
            blocks[..., 108:110].reshape(out_features, -1),
        ],
        axis=1,
    )
    return QuantizedWeight(
        "Q3_K",
        torch.from_numpy(codes.astype(np.uint8).reshape(out_features, -1)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        None,
        3,
        zero_point=4,
    )


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
    scales = np.concatenate(
        [blocks[..., :16].reshape(out_features, -1), blocks[..., 80:84].reshape(out_features, -1)], axis=1
    )
    return QuantizedWeight(
        "Q2_K",
        torch.from_numpy(codes.reshape(out_features, -1)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        None,
        2,
    )


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
    scales = np.concatenate(
        [
            sub_scales.astype(np.int8).view(np.uint8).reshape(out_features, -1),
            blocks[..., 0:2].reshape(out_features, -1),
        ],
        axis=1,
    )
    codes = blocks[..., 8:].reshape(out_features, in_features // 2)
    return QuantizedWeight(
        "IQ4_XS",
        torch.from_numpy(codes.copy()),
        torch.from_numpy(np.ascontiguousarray(scales)),
        None,
        4,
        levels=IQ4_LEVELS,
    )


# The formats of 256-value super-blocks, each re-laid by a function of its own (above).
_SUPER_BLOCK_LAYOUTS = {
    "Q2_K": _from_q2_k,
    "Q3_K": _from_q3_k,
    "Q4_K": _from_q4_k,
    "Q5_K": _from_q5_k,
    "Q6_K": _from_q6_k,
    "IQ4_XS": _from_iq4_xs,
}
