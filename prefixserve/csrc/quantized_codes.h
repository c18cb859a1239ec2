// A quantized weight's group of 32 codes decoded to float32 lanes (quantized.h's layouts: 8, 6, 5, 4, 3
// and 2 bits), for quantized_matmul.cpp's two decode paths: W lanes a vector (simd.h), exact integer
// arithmetic, then one multiply-add per value with its scale and offset (quantized_scales.h).
#pragma once

#include "quantized_scales.h"
#include "simd.h"

#include <cstdint>
#include <cstring>

namespace prefixserve {
namespace {

using simd::vf;
using simd::W;

// The 32 high bits of a 5- or 3-bit group at p (quantized.h: value e's at bit e), after its 16 bytes of
// low nibbles (5 bits) or its 8 bytes of low pairs (3 bits).
template <int BITS>
inline uint32_t high_bits(const uint8_t* p) {
    static_assert(BITS == 5 || BITS == 3, "the widths with a high bit per value");
    uint32_t bits;
    std::memcpy(&bits, p + (BITS == 5 ? 16 : 8), sizeof(bits));
    return bits;
}

#if defined(PREFIXSERVE_SIMD_AVX512)
// The 16 values a 4-bit code stands for (quantized.h's levels: IQ4_NL, IQ4_XS) as float lanes, made once per call.
using Levels = __m512;
inline Levels levels_of(const QuantizedWeight& weight) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(weight.levels))));
}
// W int8 codes at p as float lanes (exact; 8-bit codes have zero_point 0, quantized.h).
inline vf int8_lanes(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// A 4-bit group at p whose code c stands for levels[c]: the 16 values a code can take decoded once per group
// (levels * scale + offset), then looked up by each code's nibble: the same multiply-add of the same operands
// as decoding each value, in one permute instead of three.
inline void nibble_table_lanes(const uint8_t* p, __m512 levels, vf scale, vf offset, vf* out) {
    const __m512 table = _mm512_fmadd_ps(levels, scale, offset);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    out[0] = _mm512_permutexvar_ps(bytes, table);  // reads each index's low 4 bits: the low nibble
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
// (int4 codes decode by a table lookup here: decode_group.)
inline __m512i zero_point_lanes(int32_t zero_point) { return _mm512_set1_epi32(zero_point); }
// Q6_K's group of 32 at p (quantized.h), less zero_point, as two vectors of float lanes: values 0 .. 15
// and 16 .. 31. Value e: low nibble of byte e % 16 (its high nibble from e = 16 on), high pair from
// byte 16 + e % 8 at bit 2 (e / 8).
inline void six_bit_lanes(const uint8_t* p, __m512i zero_point, __m512* out) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m128i pairs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16));
    const __m512i high = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(pairs, pairs)), 4);
    const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i nibble = _mm512_set1_epi32(0xF), pair = _mm512_set1_epi32(0x30);
    const __m512i first = _mm512_or_si512(_mm512_and_si512(bytes, nibble),
                                          _mm512_and_si512(_mm512_srlv_epi32(high, shifts), pair));
    const __m512i second = _mm512_or_si512(
        _mm512_srli_epi32(bytes, 4),
        _mm512_and_si512(_mm512_srlv_epi32(high, _mm512_add_epi32(shifts, _mm512_set1_epi32(4))), pair));
    out[0] = _mm512_cvtepi32_ps(_mm512_sub_epi32(first, zero_point));
    out[1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(second, zero_point));
}
// A Q3_K or Q2_K group of 32 at p (quantized.h), less zero_point, as two vectors of float lanes (values
// 0 .. 15 and 16 .. 31). Value e: low pair from byte e % 8 at bit 2 (e / 8); for 3 bits, its high bit (4)
// from bit e of the last 4 bytes.
template <int BITS>
inline void pair_code_lanes(const uint8_t* p, __m512i zero_point, __m512* out) {
    const __m128i pairs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(pairs, pairs));
    const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i three = _mm512_set1_epi32(3), four = _mm512_set1_epi32(4);
    __m512i first = _mm512_and_si512(_mm512_srlv_epi32(bytes, shifts), three);
    __m512i second = _mm512_and_si512(_mm512_srlv_epi32(bytes, _mm512_add_epi32(shifts, four)), three);
    if constexpr (BITS == 3) {
        const uint32_t high = high_bits<3>(p);
        first = _mm512_mask_or_epi32(first, static_cast<__mmask16>(high), first, four);
        second = _mm512_mask_or_epi32(second, static_cast<__mmask16>(high >> 16), second, four);
    }
    out[0] = _mm512_cvtepi32_ps(_mm512_sub_epi32(first, zero_point));
    out[1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(second, zero_point));
}
#elif defined(PREFIXSERVE_SIMD_AVX2)
struct Levels {
    __m256 low, high;  // the values of codes 0 .. 7 and 8 .. 15
};
inline Levels levels_of(const QuantizedWeight& weight) {
    auto eight = [](const int8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    return {eight(weight.levels), eight(weight.levels + 8)};
}
inline vf int8_lanes(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// The low (or high) nibbles of W bytes at p as integer lanes (a byte widened to 32 bits needs no mask for its
// high nibble). The compiler widens the 8 bytes once for both nibbles.
inline __m256i nibble_ints(const uint8_t* p, bool high) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return high ? _mm256_srli_epi32(wide, 4) : _mm256_and_si256(wide, _mm256_set1_epi32(0xF));
}
inline __m256i zero_point_lanes(int32_t zero_point) { return _mm256_set1_epi32(zero_point); }
// offset - zero_point * scale, for decoding scale * code + that instead of scale (code - zero_point) + offset: the
// same one rounding of the same exact value, since the binding gives a zero point only to a weight without
// offsets, and a power of two (so the product is exact). A subtraction per 8 values fewer, where the decode is
// what limits a 1-row matmul (an AVX2 EPYC, Zen 3: a 1-row Q4_1 matmul 0.85x the time). The one difference is
// the sign of a zero: with no zero point, an offset of -0 and a scale whose sign bit is set (negative or -0: no
// quantizer writes one), -(0 x scale) + -0 is +0, and a value that decoded to -0 decodes to +0, an equal value.
// Keeping the offset there (a blend) cost back about half of the gain.
inline vf folded_offset(__m256i zero_point, vf scale, vf offset) {
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(zero_point), scale, offset);
}
// A 5- or 3-bit group's high bits as four vectors of 0 or 2^(BITS - 1) (values 8 v .. 8 v + 7), the bit of
// value e at e.
template <int BITS>
inline void high_bit_lanes(const uint8_t* p, __m256i* out) {
    const uint32_t bits = high_bits<BITS>(p);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int v = 0; v < 4; ++v) {
        const __m256i shifted = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits >> (8 * v))), lane);
        out[v] = _mm256_slli_epi32(_mm256_and_si256(shifted, _mm256_set1_epi32(1)), BITS - 1);
    }
}
// Q6_K's group of 32 at p as four vectors (values 8 v .. 8 v + 7): low nibbles as nibble_ints reads them,
// the high pair of value 8 v + j from byte 16 + j at bit 2 v.
inline void six_bit_lanes(const uint8_t* p, __m256i zero_point, __m256* out) {
    const __m256i high = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16))), 4);
    for (int v = 0; v < 4; ++v) {
        const __m256i code = _mm256_or_si256(nibble_ints(p + 8 * (v % 2), v >= 2),
            _mm256_and_si256(_mm256_srl_epi32(high, _mm_cvtsi32_si128(2 * v)), _mm256_set1_epi32(0x30)));
        out[v] = _mm256_cvtepi32_ps(_mm256_sub_epi32(code, zero_point));
    }
}
// A Q3_K or Q2_K group of 32 at p as four vectors (values 8 v .. 8 v + 7): the low pair of value 8 v + j
// from byte j at bit 2 v; for 3 bits, its high bit as high_bit_lanes reads it.
template <int BITS>
inline void pair_code_lanes(const uint8_t* p, __m256i zero_point, __m256* out) {
    const __m256i pairs = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m256i highs[4];
    if constexpr (BITS == 3) high_bit_lanes<3>(p, highs);
    for (int v = 0; v < 4; ++v) {
        __m256i code = _mm256_and_si256(_mm256_srl_epi32(pairs, _mm_cvtsi32_si128(2 * v)), _mm256_set1_epi32(3));
        if constexpr (BITS == 3) code = _mm256_or_si256(code, highs[v]);
        out[v] = _mm256_cvtepi32_ps(_mm256_sub_epi32(code, zero_point));
    }
}
#else
// NEON and portable: the codes are widened one lane at a time (exact either way); the multiply-adds
// that dominate stay vector operations.
struct Levels {
    float values[16];
};
inline Levels levels_of(const QuantizedWeight& weight) {
    Levels levels;
    for (int code = 0; code < 16; ++code) levels.values[code] = static_cast<float>(weight.levels[code]);
    return levels;
}
inline vf from_lanes(const float* lanes) { return simd::load(lanes); }
inline vf int8_lanes(const uint8_t* p) {
    float lanes[W];
    for (int l = 0; l < W; ++l) lanes[l] = static_cast<float>(static_cast<int8_t>(p[l]));
    return from_lanes(lanes);
}
inline vf nibble_lanes(const uint8_t* p, bool high, int32_t zero_point) {
    float lanes[W];
    for (int l = 0; l < W; ++l) lanes[l] = static_cast<float>(((high ? p[l] >> 4 : p[l]) & 0xF) - zero_point);
    return from_lanes(lanes);
}
inline int32_t zero_point_lanes(int32_t zero_point) { return zero_point; }
// A 5-, 6-, 3- or 2-bit group at p as 32 / W vectors. 5 and 6 bits: value e's low nibble from byte e % 16
// (the high nibble from e = 16 on); its high bit from bit e of the last 4 bytes (5 bits), or its high pair
// from byte 16 + e % 8 at bit 2 (e / 8) (6 bits). 3 and 2 bits: its low pair from byte e % 8 at bit
// 2 (e / 8); for 3 bits, its high bit from bit e of the last 4 bytes.
template <int BITS>
inline void wide_code_lanes(const uint8_t* p, int32_t zero_point, vf* out) {
    for (int v = 0; v < 32 / W; ++v) {
        float lanes[W];
        for (int l = 0; l < W; ++l) {
            const int e = v * W + l;
            int code;
            if constexpr (BITS == 3) {
                code = ((p[e % 8] >> (2 * (e / 8))) & 3) | ((high_bits<3>(p) >> e) & 1) << 2;
            } else if constexpr (BITS == 2) {
                code = (p[e % 8] >> (2 * (e / 8))) & 3;
            } else {
                const int low = (p[e % 16] >> (e >= 16 ? 4 : 0)) & 0xF;
                const int high = BITS == 5 ? (high_bits<5>(p) >> e) & 1 : (p[16 + e % 8] >> (2 * (e / 8))) & 3;
                code = low | high << 4;
            }
            lanes[l] = static_cast<float>(code - zero_point);
        }
        out[v] = from_lanes(lanes);
    }
}
inline void six_bit_lanes(const uint8_t* p, int32_t zero_point, vf* out) { wide_code_lanes<6>(p, zero_point, out); }
template <int BITS>
inline void pair_code_lanes(const uint8_t* p, int32_t zero_point, vf* out) { wide_code_lanes<BITS>(p, zero_point, out); }
#endif


// A 4-bit group with levels (IQ4_NL, IQ4_XS): value e = scale * levels[code_e] + offset, one rounding each;
// codes laid out as bits 4 lays them out.
inline void decode_levels_group(const uint8_t* codes, vf scale, vf offset, const Levels& levels, vf* out) {
#if defined(PREFIXSERVE_SIMD_AVX512)
    nibble_table_lanes(codes, levels, scale, offset, out);
#elif defined(PREFIXSERVE_SIMD_AVX2)
    // Two tables of 8 looked up by a code's low 3 bits, the one its bit 3 names kept (moved to the sign bit).
    const __m256 low = _mm256_fmadd_ps(levels.low, scale, offset), high = _mm256_fmadd_ps(levels.high, scale, offset);
    for (int v = 0; v < 4; ++v) {
        const __m256i code = nibble_ints(codes + 8 * (v % 2), v >= 2);
        out[v] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, code), _mm256_permutevar8x32_ps(high, code),
                                  _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
    }
#else
    for (int v = 0; v < 32 / W; ++v) {
        float lanes[W];
        for (int l = 0; l < W; ++l) {
            const int e = v * W + l;
            lanes[l] = levels.values[(codes[e % 16] >> (e >= 16 ? 4 : 0)) & 0xF];
        }
        out[v] = simd::fmadd(from_lanes(lanes), scale, offset);
    }
#endif
}

// Group values decoded into out[GROUP / W] from the group's codes: scale (code - zero_point) + offset,
// one rounding each, for a weight of BITS bits (quantized.h's layouts). int4: 32 values in 16 bytes,
// value e in byte e % 16, its high nibble from e = 16 on. Q6_K, Q3_K and Q2_K (bits 6, 3 and 2): their last
// 16 values take high_scale and high_offset (the others scale and offset, as every value of the other
// formats). A template per width, so that a tile's loop over groups holds no branch on the format and keeps its
// constants in registers.
template <int BITS, typename ZeroPoint>
inline void decode_group(const uint8_t* codes, vf scale, vf high_scale, vf offset, vf high_offset, ZeroPoint zero_point,
                         vf* out) {
    static_assert(BITS == 2 || BITS == 3 || BITS == 4 || BITS == 5 || BITS == 6 || BITS == 8, "quantized.h's widths");
    if constexpr (half_group_scales(BITS)) {
        if constexpr (BITS == 6) {
            six_bit_lanes(codes, zero_point, out);
        } else {
            pair_code_lanes<BITS>(codes, zero_point, out);
        }
        for (int64_t v = 0; v < GROUP; v += W) {
            out[v / W] = simd::fmadd(out[v / W], v < 16 ? scale : high_scale, v < 16 ? offset : high_offset);
        }
    } else if constexpr (BITS == 5) {
#if defined(PREFIXSERVE_SIMD_AVX512)
        // As for 4 bits, a table of the 32 values a code can take, looked up by code (two tables of 16).
        const __m512i first_levels = _mm512_sub_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), zero_point);
        const __m512 low_table = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first_levels), scale, offset);
        const __m512 high_table = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_add_epi32(first_levels, _mm512_set1_epi32(16))), scale, offset);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
        const uint32_t high = high_bits<5>(codes);
        const __m512i sixteen = _mm512_set1_epi32(16);
        const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), upper = _mm512_srli_epi32(bytes, 4);
        const __m512i first = _mm512_mask_or_epi32(low, static_cast<__mmask16>(high), low, sixteen);
        const __m512i second = _mm512_mask_or_epi32(upper, static_cast<__mmask16>(high >> 16), upper, sixteen);
        out[0] = _mm512_permutex2var_ps(low_table, first, high_table);
        out[1] = _mm512_permutex2var_ps(low_table, second, high_table);
#elif defined(PREFIXSERVE_SIMD_AVX2)
        __m256i highs[4];
        high_bit_lanes<5>(codes, highs);
        const vf folded = folded_offset(zero_point, scale, offset);
        for (int v = 0; v < 4; ++v) {
            const __m256i code = _mm256_or_si256(nibble_ints(codes + 8 * (v % 2), v >= 2), highs[v]);
            out[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), scale, folded);
        }
#else
        wide_code_lanes<5>(codes, zero_point, out);
        for (int64_t v = 0; v < GROUP; v += W) out[v / W] = simd::fmadd(out[v / W], scale, offset);
#endif
    } else if constexpr (BITS == 8) {
        for (int64_t v = 0; v < GROUP; v += W) out[v / W] = simd::fmadd(int8_lanes(codes + v), scale, offset);
    } else {
#if defined(PREFIXSERVE_SIMD_AVX512)
        const __m512 levels = _mm512_cvtepi32_ps(_mm512_sub_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), zero_point));
        nibble_table_lanes(codes, levels, scale, offset, out);
#elif defined(PREFIXSERVE_SIMD_AVX2)
        const vf folded = folded_offset(zero_point, scale, offset);
        for (int v = 0; v < 4; ++v) {
            out[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(nibble_ints(codes + 8 * (v % 2), v >= 2)), scale, folded);
        }
#else
        for (int64_t v = 0; v < 32; v += W) {
            out[v / W] = simd::fmadd(nibble_lanes(codes + v % 16, v >= 16, zero_point), scale, offset);
        }
#endif
    }
}

// A group of either kind: codes standing for levels (LEVELS: 4-bit IQ4 codes) or code - zero_point (BITS
// wide). decode_row and fused_tile decode through here.
template <int BITS, bool LEVELS, typename ZeroPoint>
inline void decode_codes(const uint8_t* codes, vf scale, vf high_scale, vf offset, vf high_offset, ZeroPoint zero_point,
                         const Levels& levels, vf* out) {
    if constexpr (LEVELS) {
        static_assert(BITS == 4, "levels are for 4-bit codes");
        decode_levels_group(codes, scale, offset, levels, out);
    } else {
        decode_group<BITS>(codes, scale, high_scale, offset, high_offset, zero_point, out);
    }
}

}  // namespace
}  // namespace prefixserve
