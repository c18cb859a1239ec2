// A quantized weight's per-group scales and offsets as float32 (quantized.h's four formats: float16,
// float32, Q4_K's (Q5_K's) 6-bit values with float16 super-block factors, Q6_K's (Q3_K's) int8 scales per
// half group with a float16 d), for quantized_matmul.cpp's two decode paths. Every conversion here is exact (float16 to
// float32; Q4_K's products of an 11-bit significand and a 6-bit integer, Q6_K's and an 8-bit one), so a
// group decodes to the same bits whichever path converts it.
#pragma once

#include "quantized.h"

#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>

namespace prefixserve {
namespace {

inline float half_value(const uint16_t* half) {
#if defined(__F16C__)  // one instruction (x86 variants from AVX2 on); c10's exact conversion elsewhere
    return _cvtsh_ss(*half);
#else
    return static_cast<float>(*reinterpret_cast<const c10::Half*>(half));
#endif
}

constexpr int64_t GROUP = 32;  // values per group (quantized.h): a constant, so a group's values stay in registers
constexpr int64_t SUPER_GROUPS = 8;  // Q4_K, Q5_K: groups per super-block

// A group's scale and offset (those of its first 16 values, for Q6_K, Q3_K and Q2_K), and the scale and
// offset of its last 16 (those formats only).
enum class Part { scale, high_scale, offset, high_offset };

inline bool is_offset(Part part) { return part == Part::offset || part == Part::high_offset; }

// Whether codes of this width have a scale per 16 values: Q6_K's and Q3_K's int8 scales (no offsets), Q2_K's
// 4-bit scales and minimums (an offset per 16 values too).
constexpr bool half_group_scales(int32_t bits) { return bits == 6 || bits == 3 || bits == 2; }

// Group g of row n's scale or offset from Q4_K's bytes (quantized.h): d * scale_g or -(dmin * min_g),
// the products exact in float32, so the same bits as the float32 values they were stored as before.
inline float k_value(const QuantizedWeight& weight, Part part, int64_t n, int64_t g) {
    const int64_t groups = weight.cols / GROUP;
    const auto* row = static_cast<const uint8_t*>(weight.scales) + n * (groups + groups / 2);
    uint16_t factor;  // d or dmin, two bytes at an even offset of the row
    std::memcpy(&factor, row + groups + (g / SUPER_GROUPS) * 4 + (is_offset(part) ? 2 : 0), sizeof(factor));
    if (part == Part::scale) return half_value(&factor) * static_cast<float>(row[g]);
    const auto* mins = static_cast<const uint8_t*>(weight.offsets) + n * groups;
    return -(half_value(&factor) * static_cast<float>(mins[g]));
}

// Q6_K and Q3_K: half group s (values 16 s .. 16 s + 15 of row n) has scale d * scale_s, exact in float32.
inline float half_group_value(const QuantizedWeight& weight, int64_t n, int64_t s) {
    const int64_t subs = weight.cols / 16;
    const auto* row = static_cast<const uint8_t*>(weight.scales) + n * (subs + subs / 8);
    uint16_t d;  // two bytes per super-block of 16 half groups, after the row's scales
    std::memcpy(&d, row + subs + (s / 16) * 2, sizeof(d));
    return half_value(&d) * static_cast<float>(static_cast<int8_t>(row[s]));
}

// Q2_K (bits 2): half group s of row n has scale d * scale_s and offset -(dmin * min_s), the 4-bit scale and
// minimum the low and high nibble of byte s; exact in float32.
inline float q2_value(const QuantizedWeight& weight, Part part, int64_t n, int64_t s) {
    const int64_t subs = weight.cols / 16;
    const auto* row = static_cast<const uint8_t*>(weight.scales) + n * (subs + subs / 4);
    uint16_t factor;  // d, dmin: four bytes per super-block of 16 half groups, after the row's scale bytes
    std::memcpy(&factor, row + subs + (s / 16) * 4 + (is_offset(part) ? 2 : 0), sizeof(factor));
    if (!is_offset(part)) return half_value(&factor) * static_cast<float>(row[s] & 0xF);
    return -(half_value(&factor) * static_cast<float>(row[s] >> 4));
}

// IQ4_XS (int8_scales): group g of row n's scale d * scale_g, the int8 scale times its super-block's float16
// d, exact in float32.
inline float int8_scale_value(const QuantizedWeight& weight, int64_t n, int64_t g) {
    const int64_t groups = weight.cols / GROUP;
    const auto* row = static_cast<const uint8_t*>(weight.scales) + n * (groups + groups / 4);
    uint16_t d;  // two bytes per super-block of 8 groups, after the row's scales
    std::memcpy(&d, row + groups + (g / SUPER_GROUPS) * 2, sizeof(d));
    return half_value(&d) * static_cast<float>(static_cast<int8_t>(row[g]));
}

// Group g of row n's scale or offset as float32 (an offset of 0 where the weight has none). Part::high_scale
// and Part::high_offset: those of its last 16 values (for the other formats, the group's).
inline float group_value(const QuantizedWeight& weight, Part part, int64_t n, int64_t g) {
    if (half_group_scales(weight.bits)) {
        const int64_t s = 2 * g + (part == Part::high_scale || part == Part::high_offset);
        if (weight.bits == 2) return q2_value(weight, part, n, s);
        return is_offset(part) ? 0.f : half_group_value(weight, n, s);
    }
    if (part == Part::high_scale) part = Part::scale;
    if (part == Part::high_offset) part = Part::offset;
    if (weight.int8_scales) return part == Part::offset ? 0.f : int8_scale_value(weight, n, g);
    const void* values = part == Part::offset ? weight.offsets : weight.scales;
    if (values == nullptr) return 0.f;
    if (weight.k_scales) return k_value(weight, part, n, g);
    const int64_t index = n * (weight.cols / GROUP) + g;
    if (!weight.half_scales) return static_cast<const float*>(values)[index];
    return half_value(static_cast<const uint16_t*>(values) + index);
}

constexpr int64_t VALUE_CHUNK = 16;  // groups whose scales and offsets fused_tile converts at once

// Whether group_value gives any offset other than 0: Q4_1's and Q5_1's offsets, Q4_K's and Q5_K's minimums,
// Q2_K's. Where not (Q8_0, Q4_0, Q6_K, IQ4_XS, ...), the decode paths take a zero register instead of
// converting zeros for every row: the same operands, so the same bits.
inline bool has_offsets(const QuantizedWeight& weight) {
    if (weight.bits == 2) return true;
    if (weight.int8_scales || half_group_scales(weight.bits)) return false;
    return weight.offsets != nullptr;
}

// The vector paths below form small integers times a float16 super-block factor (d, or dmin for an offset,
// negated); every such product is exact in float32 and a negation flips only the sign, so they give the
// scalar functions' bits. These two helpers are what they share.
#if defined(__AVX512F__)
// Lanes 0-7: factor `which` (0: d, 1: dmin) of the super-block whose factors start at p; lanes 8-15: the next
// super-block's. Each super-block has `per_block` float16 factors (1: d; 2: d, dmin); nothing past the two
// super-blocks' is read.
inline __m512 two_super_block_factors(const uint8_t* p, int per_block, int which) {
    uint64_t bits = 0;
    std::memcpy(&bits, p, static_cast<size_t>(4 * per_block));
    const __m512 halves = _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_cvtsi64_si128(static_cast<long long>(bits))));
    const int a = which, b = per_block + which;
    return _mm512_permutexvar_ps(_mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b), halves);
}
// factor * small, or -(factor * small) for an offset.
inline __m512 factor_product(__m512 factor, __m512 small, bool negate) {
    const __m512 product = _mm512_mul_ps(factor, small);
    if (!negate) return product;
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(product), _mm512_set1_epi32(INT32_MIN)));
}
#elif defined(__F16C__)
// The float16 factor at p times small, or its negation for an offset.
inline __m256 factor_product(const uint8_t* p, __m256 small, bool negate) {
    uint16_t factor;
    std::memcpy(&factor, p, sizeof(factor));
    const __m256 product = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(factor)), small);
    return negate ? _mm256_xor_ps(product, _mm256_set1_ps(-0.f)) : product;
}
#endif

// Groups [g0, g0 + count) of row n's Q4_K scales or offsets as float32 into out (g0 a multiple of VALUE_CHUNK):
// k_value's products, a super-block (8 groups) or two at a time where the variant has F16C. Exact
// products either way, and a negation flips only the sign, so the same bits as k_value.
inline void convert_k_values(const QuantizedWeight& weight, Part part, int64_t n, int64_t g0, int64_t count,
                             float* out) {
    const int64_t groups = weight.cols / GROUP;
    const auto* row = static_cast<const uint8_t*>(weight.scales) + n * (groups + groups / 2);
    [[maybe_unused]] const uint8_t* bytes =
        part == Part::scale ? row : static_cast<const uint8_t*>(weight.offsets) + n * groups;
    [[maybe_unused]] const uint8_t* factors = row + groups;  // d, dmin (float16) per super-block
    int64_t i = 0;
#if defined(__AVX512F__)
    if (count == 2 * SUPER_GROUPS) {
        const __m512 small = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(bytes + g0))));
        const bool offset = part == Part::offset;
        const __m512 factor = two_super_block_factors(factors + g0 / SUPER_GROUPS * 4, 2, offset ? 1 : 0);
        _mm512_storeu_ps(out, factor_product(factor, small, offset));
        return;
    }
#elif defined(__F16C__)
    for (; i + SUPER_GROUPS <= count; i += SUPER_GROUPS) {
        const int64_t g = g0 + i;
        const __m256 small = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(bytes + g))));
        const bool offset = part == Part::offset;
        _mm256_storeu_ps(out + i, factor_product(factors + g / SUPER_GROUPS * 4 + (offset ? 2 : 0), small, offset));
    }
#endif
    for (; i < count; ++i) out[i] = k_value(weight, part, n, g0 + i);
}

// Groups [g0, g0 + count) of row n's Q6_K (Q3_K) scales (those of each group's first or last 16 values) as
// float32 into out (g0 a multiple of VALUE_CHUNK): half_group_value's products, two super-blocks at a time
// on AVX-512. Exact either way, so the same bits as half_group_value.
inline void convert_half_group_values(const QuantizedWeight& weight, Part part, int64_t n, int64_t g0, int64_t count,
                                      float* out) {
    const int64_t high = part == Part::high_scale ? 1 : 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    if (count == 2 * SUPER_GROUPS) {
        const int64_t subs = weight.cols / 16;
        const auto* row = static_cast<const uint8_t*>(weight.scales) + n * (subs + subs / 8);
        const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(row + 2 * g0))));
        const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(row + 2 * g0 + 16))));
        const __m512i every_other = _mm512_add_epi32(
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), _mm512_set1_epi32(high));
        const __m512 scales = _mm512_permutex2var_ps(first, every_other, second);
        _mm512_storeu_ps(out, factor_product(two_super_block_factors(row + subs + g0 / SUPER_GROUPS * 2, 1, 0), scales,
                                             false));
        return;
    }
#endif
    for (; i < count; ++i) out[i] = half_group_value(weight, n, 2 * (g0 + i) + high);
}

// Groups [g0, g0 + count) of row n's Q2_K scales or offsets (those of each group's first or last 16 values) as
// float32 into out (g0 a multiple of VALUE_CHUNK): q2_value's products, a super-block (8 groups) or two at a
// time where the variant has F16C. Exact either way, and a negation flips only the sign, so q2_value's bits.
inline void convert_q2_values(const QuantizedWeight& weight, Part part, int64_t n, int64_t g0, int64_t count,
                              float* out) {
    const int64_t subs = weight.cols / 16;
    [[maybe_unused]] const auto* row = static_cast<const uint8_t*>(weight.scales) + n * (subs + subs / 4);
    [[maybe_unused]] const bool high = part == Part::high_scale || part == Part::high_offset;
    [[maybe_unused]] const int nibble_shift = is_offset(part) ? 4 : 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    if (count == 2 * SUPER_GROUPS) {
        // lane i: the bytes of half groups 2 (g0 + i) and 2 (g0 + i) + 1; this part's byte, then its nibble
        const __m512i pairs = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * g0)));
        const __m512i bytes = _mm512_srli_epi32(pairs, high ? 8 : 0);
        const __m512 small = _mm512_cvtepi32_ps(
            _mm512_and_si512(_mm512_srli_epi32(bytes, nibble_shift), _mm512_set1_epi32(0xF)));
        const __m512 factor = two_super_block_factors(row + subs + g0 / SUPER_GROUPS * 4, 2, is_offset(part) ? 1 : 0);
        _mm512_storeu_ps(out, factor_product(factor, small, is_offset(part)));
        return;
    }
#elif defined(__F16C__)
    for (; i + SUPER_GROUPS <= count; i += SUPER_GROUPS) {
        const int64_t g = g0 + i;
        const __m256i pairs = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * g)));
        const __m256i bytes = _mm256_srli_epi32(pairs, high ? 8 : 0);
        const __m256 small = _mm256_cvtepi32_ps(
            _mm256_and_si256(_mm256_srli_epi32(bytes, nibble_shift), _mm256_set1_epi32(0xF)));
        const uint8_t* factor = row + subs + g / SUPER_GROUPS * 4 + (is_offset(part) ? 2 : 0);
        _mm256_storeu_ps(out + i, factor_product(factor, small, is_offset(part)));
    }
#endif
    for (; i < count; ++i) out[i] = group_value(weight, part, n, g0 + i);
}

// Groups [g0, g0 + count) of row n's IQ4_XS scales as float32 into out (g0 a multiple of VALUE_CHUNK):
// int8_scale_value's products, two super-blocks at a time on AVX-512. Exact either way.
inline void convert_int8_scale_values(const QuantizedWeight& weight, int64_t n, int64_t g0, int64_t count, float* out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (count == 2 * SUPER_GROUPS) {
        const int64_t groups = weight.cols / GROUP;
        const auto* row = static_cast<const uint8_t*>(weight.scales) + n * (groups + groups / 4);
        const __m512 scales = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(row + g0))));
        _mm512_storeu_ps(out, factor_product(two_super_block_factors(row + groups + g0 / SUPER_GROUPS * 2, 1, 0), scales,
                                             false));
        return;
    }
#endif
    for (; i < count; ++i) out[i] = int8_scale_value(weight, n, g0 + i);
}

// Groups [g0, g0 + count) of row n's scales or offsets as float32 into out (count <= VALUE_CHUNK; zeros
// where the weight has no offsets): 16 float16 values in one conversion where the variant has F16C.
// Exact either way (the bits group_value gives). Both decode paths convert through here, 16 groups at
// once, then broadcast each value from memory (a load) instead of converting it for every group. Always
// inlined: as a call per column and chunk (a vzeroupper, the tile's sums spilled around it) it held a hot 1-row
// Q8_0 matmul to 2.8 weights a cycle, inlined 4.2 (one thread, AVX-512 EPYC).
__attribute__((always_inline)) inline void convert_values(const QuantizedWeight& weight, Part part, int64_t n,
                                                         int64_t g0, int64_t count, float* out) {
    if (is_offset(part) && !has_offsets(weight)) {
        std::fill(out, out + count, 0.f);
        return;
    }
    if (weight.bits == 2) {
        convert_q2_values(weight, part, n, g0, count, out);
        return;
    }
    if (weight.int8_scales) {  // IQ4_XS: a scale per group (no offsets: above)
        convert_int8_scale_values(weight, n, g0, count, out);
        return;
    }
    if (half_group_scales(weight.bits)) {  // Q6_K, Q3_K: scales only (above)
        convert_half_group_values(weight, part, n, g0, count, out);
        return;
    }
    const void* values = part == Part::offset ? weight.offsets : weight.scales;
    if (weight.k_scales) {
        convert_k_values(weight, part, n, g0, count, out);
        return;
    }
    const int64_t first = n * (weight.cols / GROUP) + g0;
    if (!weight.half_scales) {  // float32 values: group_value's, as they lie
        std::memcpy(out, static_cast<const float*>(values) + first, static_cast<size_t>(count) * sizeof(float));
        return;
    }
    const auto* halves = static_cast<const uint16_t*>(values) + first;
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // a masked load reads nothing past the row's last group (and cannot fault there), so a chunk's tail (SmolLM2's
    // 576 columns: 18 groups, a chunk of 16 and one of 2) costs what a whole chunk does
    const auto mask = static_cast<__mmask16>(count >= VALUE_CHUNK ? 0xFFFF : (1u << count) - 1);
    _mm512_mask_storeu_ps(out, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, halves)));
    return;
#elif defined(__AVX512F__)
    if (count == VALUE_CHUNK) {
        _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves))));
        return;
    }
#endif
#if defined(__F16C__)
    for (; i + 8 <= count; i += 8) {
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + i))));
    }
    if (i < count) {  // a row's last groups (SmolLM2's 576 columns: 18 groups, a chunk of 16 and one of 2)
        uint16_t tail[8] = {};
        float converted[8];
        std::memcpy(tail, halves + i, static_cast<size_t>(count - i) * sizeof(uint16_t));
        _mm256_storeu_ps(converted, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail))));
        std::memcpy(out + i, converted, static_cast<size_t>(count - i) * sizeof(float));
        return;
    }
#endif
    for (; i < count; ++i) out[i] = half_value(halves + i);
}

}  // namespace
}  // namespace prefixserve
