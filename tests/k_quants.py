"""K-quant blocks written for the tests (gguf's Python writer quantizes to Q8_0, Q4_* and Q5_* only):
Q2_K to Q6_K and IQ4_XS as ggml lays out block_q2_K .. block_q6_K and block_iq4_xs, from float values by
round to nearest. Simpler
than llama.cpp's quantizer (no search for the best scales), so a little less accurate, but every byte
is what the format's reader (gguf.quants.dequantize) decodes: the tests check that round trip."""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256


def _half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _divide(values: np.ndarray, by: np.ndarray) -> np.ndarray:
    return values / np.where(by == 0, 1, by)


def _symmetric_sub_blocks(
    values: np.ndarray, bits: int, scale_bits: int, reach: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K's and Q3_K's quantization of values [.., 256 * n]: per sub-block of 16 a signed scale of scale_bits
    bits times the super-block's float16 d, such that the sub-block's largest magnitude is `reach` steps;
    codes of `bits` bits less 2^(bits - 1). (d float16 [super-blocks], scales int16 [super-blocks, 16], codes
    uint8 [super-blocks, half, quarter, 32])."""
    x = values.astype(np.float32).reshape(-1, 16, 16)  # [super-block, sub-block of 16, 16]
    zero, scale_max = 1 << (bits - 1), (1 << (scale_bits - 1)) - 1
    sub_scales = np.abs(x).max(-1) / reach
    d = _half(sub_scales.max(-1) / scale_max)
    scales = np.clip(np.round(_divide(sub_scales, d.astype(np.float32)[:, None])), -scale_max - 1, scale_max)
    step = (d.astype(np.float32)[:, None] * scales.astype(np.float32))[..., None]
    q = np.clip(np.round(_divide(x, step)) + zero, 0, 2 * zero - 1).astype(np.uint8).reshape(-1, 2, 4, 32)
    return d, scales.astype(np.int16), q


def encode_q6_k(values: np.ndarray) -> np.ndarray:
    """[rows, cols] float values (cols a multiple of 256) as Q6_K bytes [rows, cols / 256 * 210]."""
    rows, cols = values.shape
    d, sub_scales, q = _symmetric_sub_blocks(values, bits=6, scale_bits=8, reach=31)
    scales = sub_scales.astype(np.int8)
    low = np.concatenate(
        [q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], axis=-1
    )
    high = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    blocks = np.concatenate(
        [low.reshape(-1, 128), high.reshape(-1, 64), scales.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1
    )
    return blocks.reshape(rows, cols // SUPER_BLOCK * 210)


def encode_q4_k(values: np.ndarray, bits: int = 4) -> np.ndarray:
    """[rows, cols] float values (cols a multiple of 256) as Q4_K bytes [rows, cols / 256 * 144], or with
    bits=5 as Q5_K bytes [rows, cols / 256 * 176] (the same scales, and each code's fifth bit)."""
    rows, cols = values.shape
    levels = (1 << bits) - 1
    x = values.astype(np.float32).reshape(-1, 8, 32)  # [super-block, sub-block of 32, 32]
    low, high = np.minimum(x.min(-1), 0), x.max(-1)
    d, dmin = _half((high - low).max(-1) / levels / 63), _half((-low).max(-1) / 63)
    scales = np.clip(np.round(_divide((high - low) / levels, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    mins = np.clip(np.round(_divide(-low, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * scales)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * mins)[..., None]
    q = np.clip(np.round(_divide(x + offset, step)), 0, levels).astype(np.uint8)
    packed = np.stack(
        [
            scales[:, :4] | (scales[:, 4:] >> 4) << 6,
            mins[:, :4] | (mins[:, 4:] >> 4) << 6,
            scales[:, 4:] & 0xF | (mins[:, 4:] & 0xF) << 4,
        ],
        axis=1,
    ).reshape(-1, 12)
    codes = (q[:, 0::2] & 0xF | (q[:, 1::2] & 0xF) << 4).reshape(-1, 128)  # 32 bytes per pair of sub-blocks
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed]
    if bits == 5:  # bit s of byte l: the fifth bit of value l of sub-block s
        parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=1))
    blocks = np.concatenate(parts + [codes], axis=1)
    return blocks.reshape(rows, -1)


def encode_q3_k(values: np.ndarray) -> np.ndarray:
    """[rows, cols] float values (cols a multiple of 256) as Q3_K bytes [rows, cols / 256 * 110]."""
    rows, cols = values.shape
    d, scales, q = _symmetric_sub_blocks(values, bits=3, scale_bits=6, reach=4)
    low = (q & 3)[:, :, 0] | (q & 3)[:, :, 1] << 2 | (q & 3)[:, :, 2] << 4 | (q & 3)[:, :, 3] << 6  # [.., half, 32]
    high_bits = (q >> 2).reshape(-1, 8, 32)  # bit 4 h + j of byte l: value 128 h + 32 j + l
    high = np.bitwise_or.reduce(high_bits << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    six = (scales + 32).astype(np.uint8)  # sixteen 6-bit scales in twelve bytes
    packed = np.concatenate(
        [
            six[:, :8] & 0xF | (six[:, 8:] & 0xF) << 4,
            six[:, 0:4] >> 4 | (six[:, 4:8] >> 4) << 2 | (six[:, 8:12] >> 4) << 4 | (six[:, 12:16] >> 4) << 6,
        ],
        axis=1,
    )
    blocks = np.concatenate([high, low.reshape(-1, 64), packed, d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, cols // SUPER_BLOCK * 110)


def encode_q2_k(values: np.ndarray) -> np.ndarray:
    """[rows, cols] float values (cols a multiple of 256) as Q2_K bytes [rows, cols / 256 * 84]."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 16, 16)  # [super-block, sub-block of 16, 16]
    low, high = np.minimum(x.min(-1), 0), x.max(-1)
    d, dmin = _half((high - low).max(-1) / 3 / 15), _half((-low).max(-1) / 15)
    scales = np.clip(np.round(_divide((high - low) / 3, d.astype(np.float32)[:, None])), 0, 15).astype(np.uint8)
    mins = np.clip(np.round(_divide(-low, dmin.astype(np.float32)[:, None])), 0, 15).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * scales)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * mins)[..., None]
    q = np.clip(np.round(_divide(x + offset, step)), 0, 3).astype(np.uint8).reshape(-1, 2, 4, 32)  # [.., half, quarter]
    pairs = q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6  # bits 2 j of byte 32 h + l
    blocks = np.concatenate(
        [
            scales | mins << 4,
            pairs.reshape(-1, 64),
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    return blocks.reshape(rows, cols // SUPER_BLOCK * 84)


IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def encode_iq4_xs(values: np.ndarray) -> np.ndarray:
    """[rows, cols] float values (cols a multiple of 256) as IQ4_XS bytes [rows, cols / 256 * 136]: each value
    the nearest of its sub-block's 16 levels."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 8, 32)  # [super-block, sub-block of 32, 32]
    sub_scales = np.abs(x).max(-1) / 127
    d = _half(sub_scales.max(-1) / 31)
    scales = np.clip(np.round(_divide(sub_scales, d.astype(np.float32)[:, None])), -32, 31).astype(np.int16)
    step = (d.astype(np.float32)[:, None] * scales.astype(np.float32))[..., None, None]
    q = np.abs(x[..., None] - step * IQ4_LEVELS).argmin(-1).astype(np.uint8)  # [.., sub-block, 32]
    nibbles = (q[..., :16] | q[..., 16:] << 4).reshape(-1, 128)
    six = (scales + 32).astype(np.uint16)
    high = np.bitwise_or.reduce((six >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype("<u2")
    low = (six[:, 0::2] & 0xF | (six[:, 1::2] & 0xF) << 4).astype(np.uint8)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2), low, nibbles], axis=1)
    return blocks.reshape(rows, cols // SUPER_BLOCK * 136)
