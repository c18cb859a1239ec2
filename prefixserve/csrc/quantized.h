// Weights kept quantized in memory (prefixserve/model/quantized.py lays them out) and their matmul
// (quantized_matmul.cpp), on raw pointers; module.cpp's binding checks the tensors first.
//
// A weight [rows, cols] (out_features x in_features) is cut along each row into groups of
// `group_size` = 32 values; value k of row n in group g = k / group_size is
//
//     w[n, k] = scale[n, g] * (code[n, k] - zero_point) + offset[n, g]      (offset 0 where absent)
//
// computed in float32 with one fused multiply-add where the variant has one. The codes:
//
//   bits 32  float32 values, four bytes each, no scales or offsets: w[n, k] = the value itself (a float32
//            weight multiplied by the same tiles, nothing decoded)                   (F32)
//   bits 8   int8, one byte per value: codes[n * cols + k], zero_point 0          (Q8_0)
//   bits 4   0 .. 15, two per byte, group_size 32: the 16 bytes of group g of row n hold
//            values 0 .. 15 of the group in their low nibbles and 16 .. 31 in their high nibbles,
//            as GGUF's Q4_0 and Q4_1 blocks do                       (Q4_0: zero_point 8; Q4_1, Q4_K)
//            With `levels` (IQ4_NL, IQ4_XS), a code stands for levels[code] instead of code - zero_point:
//            w = scale * levels[code] + offset, the 16 levels int8.
//
//       byte j of a group:   [ high nibble: value 16 + j | low nibble: value j ]
//
//   bits 5   0 .. 31, 20 bytes a group (Q5_0: zero_point 16; Q5_1, Q5_K): 16 bytes of low nibbles laid
//            out as bits 4 lays them, then 4 bytes holding value e's high bit at bit e (little-endian)
//
//   bits 6   0 .. 63, zero_point 32, 24 bytes a group (Q6_K): 16 bytes of low nibbles laid out as bits 4
//            lays them, then 8 bytes where byte j holds the high bit pairs of values j, 8 + j, 16 + j,
//            24 + j (bits 0-1, 2-3, 4-5, 6-7)
//
//   bits 3   0 .. 7, zero_point 4, 12 bytes a group (Q3_K): 8 bytes of low bit pairs laid out as bits 6
//            lays out its high pairs (byte j: values j, 8 + j, 16 + j, 24 + j), then 4 bytes holding
//            value e's high bit at bit e, as bits 5 holds them
//
//   bits 2   0 .. 3, 8 bytes a group (Q2_K): the 8 bytes of low pairs of bits 3
//
// Scales and offsets are float16 (exact for Q8_0 / Q4_0 / Q4_1, whose blocks store float16) or float32,
// [rows, groups]; or, for Q4_K and Q5_K (`k_scales`), as their super-blocks of 8 groups hold them: row n of
// `scales` is its groups' 6-bit scales (a byte each), then each super-block's float16 d and dmin
// ([rows, groups + groups / 2] bytes), and row n of `offsets` its groups' 6-bit minimums
// ([rows, groups] bytes). Then scale = d * scale_g and offset = -(dmin * min_g), both exact in float32.
// IQ4_XS (`int8_scales`, bits 4 with levels) has an int8 scale per group and no offsets: row n of `scales`
// is its groups' int8 scales, then each super-block's float16 d ([rows, groups + groups / 4] bytes); group g's
// scale is d * scale_g, exact in float32.
// Q6_K and Q3_K (bits 6 and 3) have a scale per 16 values and no offsets: row n of `scales` is its int8
// scales (a byte per 16 values), then each super-block's float16 d ([rows, cols / 16 + cols / 128] bytes);
// value k's scale is d * scale_{k / 16}, exact in float32. Q2_K (bits 2) has a scale and an offset per 16
// values and no `offsets` tensor: row n of `scales` is a byte per 16 values (the scale in its low nibble, the
// minimum in its high nibble), then each super-block's float16 d and dmin ([rows, cols / 16 + cols / 64]
// bytes); value k's scale is d * scale_{k / 16}, its offset -(dmin * min_{k / 16}), both exact in float32.
#pragma once

#include <cstdint>

namespace prefixserve {

struct QuantizedWeight {
    const uint8_t* codes;
    int32_t bits;         // 32 (float32 values), 8, 6, 5, 4, 3 or 2
    int32_t zero_point;   // subtracted from every code
    int64_t rows, cols, group_size;  // group_size: 32 (every GGUF block format we keep, and --quantize)
    const void* scales;   // [rows, cols / group_size]
    const void* offsets;  // the same, or null
    bool half_scales;     // float16 scales and offsets (else float32)
    bool k_scales = false;  // Q4_K's (Q5_K's) 6-bit scales and minimums with float16 super-block factors (above)
    const int8_t* levels = nullptr;  // the 16 values a 4-bit code stands for (IQ4_NL, IQ4_XS); null: code - zero_point
    bool int8_scales = false;        // IQ4_XS's int8 scale per group with a float16 d per 256 values (above)
};

// out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for m < num_rows (x [num_rows, cols] with row stride
// x_stride, out [num_rows, rows] with row stride out_stride). Each output element is one dot product
// in an order fixed by the weight alone (W running sums along k, then simd::sum_lanes), so a row's
// bits never depend on the other rows of the call.
void quantized_matmul(const QuantizedWeight& weight, const float* x, int64_t num_rows, int64_t x_stride,
                      const float* bias, float* out, int64_t out_stride);

// The float32 weight rows [first, first + count) as the kernel computes them, into out [count, cols].
void dequantize_rows(const QuantizedWeight& weight, int64_t first, int64_t count, float* out);

}  // namespace prefixserve
