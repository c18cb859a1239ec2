// One vector of float32 lanes and the operations the kernels use, for the instruction set this
// translation unit is compiled for (setup.py builds every kernel source once per variant):
//
//   variant's backend   vector            W   multiply-add
//   avx512              __m512            16  fused
//   avx2                __m256            8   fused
//   neon                float32x4_t       4   fused
//   portable            generic vector    4   a product and a sum (GCC/Clang vector extensions)
//
// Every operation is a fixed sequence of IEEE operations, so a kernel built on these computes the
// same bits for the same inputs whatever else is in its batch. Variants may differ from each other
// (a fused multiply-add where the hardware has one, two roundings where it has not); each variant
// is consistent with itself, and the cache scope names the variant (engine/numerics.py).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

// setup.py names the backend of each variant (-DPREFIXSERVE_SIMD_<NAME>); the instruction set must
// be enabled by that variant's flags too.
#if defined(PREFIXSERVE_SIMD_AVX512)
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512DQ__) || !defined(__AVX512VL__)
#error "the avx512 backend needs -mavx512f -mavx512bw -mavx512dq -mavx512vl"
#endif
#include <immintrin.h>
#elif defined(PREFIXSERVE_SIMD_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the avx2 backend needs -mavx2 -mfma"
#endif
#include <immintrin.h>
#elif defined(PREFIXSERVE_SIMD_NEON)
#if !defined(__ARM_NEON) || !defined(__aarch64__)
#error "the neon backend needs an aarch64 target"
#endif
#include <arm_neon.h>
#elif !defined(PREFIXSERVE_SIMD_PORTABLE)
#error "name the SIMD backend: -DPREFIXSERVE_SIMD_AVX512, _AVX2, _NEON or _PORTABLE"
#endif

namespace prefixserve {
namespace simd {

inline float load_scalar(const float* p, int64_t j) { return p[j]; }

inline float load_scalar(const at::BFloat16* p, int64_t j) {
    const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[j]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

// e^x = 2^n e^r with n = round(x / ln2), |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error under 2e-7). x is clamped to [-87, 89]: below, e^x would be subnormal (the kernels
// only take e^x of scores minus their max, and mask what they discard); above, it overflows to inf.
constexpr float EXP_LOW = -87.f, EXP_HIGH = 89.f, LOG2E = 1.44269504f;
constexpr float LN2_HIGH = 0.693145752f, LN2_LOW = 1.42860677e-6f;
constexpr float EXP_POLY[7] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

#if defined(PREFIXSERVE_SIMD_AVX512)
constexpr int W = 16;
#define PREFIXSERVE_SIMD_FUSED 1  // fmadd and fnmadd round once
constexpr const char* BACKEND = "avx512";
using vf = __m512;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const at::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store(float* p, vf x) { _mm512_storeu_ps(p, x); }
// Rounded to bf16, nearest even (NaN stays NaN).
inline void store(at::BFloat16* p, vf x) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#endif
}
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c, one rounding
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, one rounding
inline vf round_nearest(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_by_power_of_two(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p 2^n, one rounding
// Lanes where x < bound take `yes`, the others `no`.
inline vf blend_below(vf x, vf bound, vf yes, vf no) {
    return _mm512_mask_mov_ps(no, _mm512_cmp_ps_mask(x, bound, _CMP_LT_OQ), yes);
}
// Lanes [0, n) of x, `fill` in the others.
inline vf keep_first(vf x, int64_t n, vf fill) {
    const __mmask16 live = static_cast<__mmask16>(n >= 16 ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u);
    return _mm512_mask_mov_ps(fill, live, x);
}
// The sum of the lanes in a fixed tree: (l, l + 8), then (l, l + 4), (l, l + 2), (0, 1).
inline float sum_lanes(vf a) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
// Lane i: sum_lanes(a[i]), bit for bit (the same additions of the same pairs: the tree of each sum is
// sum_lanes', only 16 of them run side by side), for the 16 sums that end a tile of running sums.
// Each level adds the halves the next level of the tree pairs: 256-bit halves, 128-bit quarters, then
// lanes (l, l + 2) and (0, 1) within each quarter; afterwards lane 4j + t holds a[4t + j]'s sum.
__attribute__((always_inline)) inline vf lane_sums(const vf a[16]) {
    vf halves[8], quarters[4], pairs[2];
    for (int i = 0; i < 8; ++i) {  // [a's 8 sums (l, l + 8), b's 8]
        const vf x = a[2 * i], y = a[2 * i + 1];
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int i = 0; i < 4; ++i) {  // quarter j: a[4i + j]'s 4 sums (l, l + 4)
        const vf x = halves[2 * i], y = halves[2 * i + 1];
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    }
    for (int i = 0; i < 2; ++i) {  // quarter j: a[8i + j]'s 2 sums (l, l + 2), then a[8i + 4 + j]'s
        const vf x = quarters[2 * i], y = quarters[2 * i + 1];
        pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
    }
    const vf sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                                  _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}
inline float max_lanes(vf a) { return _mm512_reduce_max_ps(a); }
inline float first_lane(vf a) { return _mm512_cvtss_f32(a); }
// W registers of W lanes transposed in place: afterwards r[j] lane k = before r[k] lane j.
inline void transpose(vf r[16]) {
    __m512 t[16], u[16];
    for (int m = 0; m < 8; ++m) {
        t[2 * m] = _mm512_unpacklo_ps(r[2 * m], r[2 * m + 1]);
        t[2 * m + 1] = _mm512_unpackhi_ps(r[2 * m], r[2 * m + 1]);
    }
    for (int m = 0; m < 4; ++m) {  // u[4m + e], 128-bit lane L: rows 4m .. 4m + 3 at element 4L + e
        const __m512d a = _mm512_castps_pd(t[4 * m]), b = _mm512_castps_pd(t[4 * m + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * m + 1]), d = _mm512_castps_pd(t[4 * m + 3]);
        u[4 * m] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * m + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * m + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * m + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int e = 0; e < 4; ++e) {
        const __m512 x0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), x1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);
        const __m512 y0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
        const __m512 y1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
        r[e] = _mm512_shuffle_f32x4(x0, y0, 0x88);
        r[8 + e] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
        r[4 + e] = _mm512_shuffle_f32x4(x1, y1, 0x88);
        r[12 + e] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
    }
}

#elif defined(PREFIXSERVE_SIMD_AVX2)
constexpr int W = 8;
#define PREFIXSERVE_SIMD_FUSED 1
constexpr const char* BACKEND = "avx2";
using vf = __m256;

inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const at::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
// Rounded to bf16, nearest even (NaN stays NaN).
inline void store(at::BFloat16* p, vf x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0),
                                 _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf round_nearest(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p 2^n for integral n in [-126, 128], as two exact multiplications by powers of two (n split in
// halves, each a normal number), so the product is rounded once, as AVX-512's scalef rounds it.
inline vf scale_by_power_of_two(vf p, vf n) {
    const __m256i whole = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(whole, 1);
    const __m256i rest = _mm256_sub_epi32(whole, half);
    const __m256i bias = _mm256_set1_epi32(127);
    const vf first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const vf second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, first), second);
}
inline vf blend_below(vf x, vf bound, vf yes, vf no) {
    return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(x, bound, _CMP_LT_OQ));
}
inline vf keep_first(vf x, int64_t n, vf fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 0 ? 0 : n > 8 ? 8 : n)), lane);
    return _mm256_blendv_ps(fill, x, _mm256_castsi256_ps(live));
}
// (l, l + 4), then (l, l + 2), (0, 1).
inline float sum_lanes(vf a) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
// Lane i: sum_lanes(a[i]), bit for bit, as the avx512 backend's: 128-bit halves, then lanes (l, l + 2)
// and (0, 1) within each half; afterwards lane 4h + t holds a[2t + h]'s sum.
__attribute__((always_inline)) inline vf lane_sums(const vf a[8]) {
    vf halves[4], pairs[2];
    for (int i = 0; i < 4; ++i) {  // [a's 4 sums (l, l + 4), b's 4]
        const vf x = a[2 * i], y = a[2 * i + 1];
        halves[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    }
    for (int i = 0; i < 2; ++i) {  // half h: a[4i + h]'s 2 sums (l, l + 2), then a[4i + 2 + h]'s
        const vf x = halves[2 * i], y = halves[2 * i + 1];
        pairs[i] = _mm256_add_ps(_mm256_shuffle_ps(x, y, 0x44), _mm256_shuffle_ps(x, y, 0xEE));
    }
    const vf sums = _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], 0x88),
                                  _mm256_shuffle_ps(pairs[0], pairs[1], 0xDD));
    return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline float max_lanes(vf a) {
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}
inline float first_lane(vf a) { return _mm256_cvtss_f32(a); }
inline void transpose(vf r[8]) {
    __m256 t[8], u[8];
    for (int m = 0; m < 4; ++m) {
        t[2 * m] = _mm256_unpacklo_ps(r[2 * m], r[2 * m + 1]);
        t[2 * m + 1] = _mm256_unpackhi_ps(r[2 * m], r[2 * m + 1]);
    }
    for (int m = 0; m < 2; ++m) {  // u[4m + e], 128-bit lane L: rows 4m .. 4m + 3 at element 4L + e
        u[4 * m] = _mm256_shuffle_ps(t[4 * m], t[4 * m + 2], 0x44);
        u[4 * m + 1] = _mm256_shuffle_ps(t[4 * m], t[4 * m + 2], 0xEE);
        u[4 * m + 2] = _mm256_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0x44);
        u[4 * m + 3] = _mm256_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0xEE);
    }
    for (int e = 0; e < 4; ++e) {
        r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
        r[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
    }
}

#elif defined(PREFIXSERVE_SIMD_NEON)
constexpr int W = 4;
#define PREFIXSERVE_SIMD_FUSED 1
constexpr const char* BACKEND = "neon";
using vf = float32x4_t;

inline vf zero() { return vdupq_n_f32(0.f); }
inline vf set1(float x) { return vdupq_n_f32(x); }
inline vf load(const float* p) { return vld1q_f32(p); }
inline vf load(const at::BFloat16* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}
inline void store(float* p, vf x) { vst1q_f32(p, x); }
// Rounded to bf16, nearest even (NaN stays NaN).
inline void store(at::BFloat16* p, vf x) {
    const uint32x4_t bits = vreinterpretq_u32_f32(x);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    uint32x4_t rounded = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7FFF))), 16);
    rounded = vbslq_u32(vceqq_f32(x, x), rounded, vdupq_n_u32(0x7FC0));
    vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(rounded));
}
inline vf add(vf a, vf b) { return vaddq_f32(a, b); }
inline vf sub(vf a, vf b) { return vsubq_f32(a, b); }
inline vf mul(vf a, vf b) { return vmulq_f32(a, b); }
inline vf div(vf a, vf b) { return vdivq_f32(a, b); }
inline vf max(vf a, vf b) { return vmaxq_f32(a, b); }
inline vf min(vf a, vf b) { return vminq_f32(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
inline vf fnmadd(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); }
inline vf blend_below(vf x, vf bound, vf yes, vf no) { return vbslq_f32(vcltq_f32(x, bound), yes, no); }
inline vf round_nearest(vf x) { return vrndnq_f32(x); }
inline vf scale_by_power_of_two(vf p, vf n) {
    const int32x4_t whole = vcvtq_s32_f32(n);
    const int32x4_t half = vshrq_n_s32(whole, 1);
    const int32x4_t rest = vsubq_s32(whole, half);
    const int32x4_t bias = vdupq_n_s32(127);
    const vf first = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, bias), 23));
    const vf second = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(rest, bias), 23));
    return vmulq_f32(vmulq_f32(p, first), second);
}
inline vf keep_first(vf x, int64_t n, vf fill) {
    const int32_t lanes[4] = {0, 1, 2, 3};
    const int32_t bound = static_cast<int32_t>(n < 0 ? 0 : n > 4 ? 4 : n);
    const uint32x4_t live = vcltq_s32(vld1q_s32(lanes), vdupq_n_s32(bound));
    return vbslq_f32(live, x, fill);
}
// (l, l + 2), then (0, 1).
inline float sum_lanes(vf a) {
    const float32x2_t s2 = vadd_f32(vget_low_f32(a), vget_high_f32(a));
    return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}
inline float max_lanes(vf a) {
    const float32x2_t m2 = vmax_f32(vget_low_f32(a), vget_high_f32(a));
    return std::max(vget_lane_f32(m2, 0), vget_lane_f32(m2, 1));
}
inline float first_lane(vf a) { return vgetq_lane_f32(a, 0); }
inline void transpose(vf r[4]) {
    const float32x4x2_t a = vtrnq_f32(r[0], r[1]), b = vtrnq_f32(r[2], r[3]);
    r[0] = vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(b.val[0]));
    r[1] = vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(b.val[1]));
    r[2] = vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(b.val[0]));
    r[3] = vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(b.val[1]));
}

#else
// Portable: 4 lanes in the compiler's generic vectors (GCC and Clang lower them to whatever the
// target has: an SSE2 register on baseline x86-64, NEON, VSX, or scalar code; wider generic vectors
// lower to memory round trips where the target has no register that wide). Multiply-adds round twice:
// no fused instruction is assumed (setup.py passes -ffp-contract=off, so none is fused behind the
// code's back either).
#define PREFIXSERVE_SIMD_FUSED 0
constexpr int W = 4;
constexpr const char* BACKEND = "portable";
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

inline vf bits_to_float(vi x) {
    vf out;
    std::memcpy(&out, &x, sizeof(out));
    return out;
}
inline vi float_to_bits(vf x) {
    vi out;
    std::memcpy(&out, &x, sizeof(out));
    return out;
}
inline vf zero() { return vf{}; }
inline vf set1(float x) { return vf{x, x, x, x}; }
inline vf load(const float* p) {
    vf out;
    std::memcpy(&out, p, sizeof(out));
    return out;
}
inline vf load(const at::BFloat16* p) {
    uint16_t half[W];
    std::memcpy(half, p, sizeof(half));
    vi bits;
    for (int l = 0; l < W; ++l) bits[l] = static_cast<int32_t>(static_cast<uint32_t>(half[l]) << 16);
    return bits_to_float(bits);
}
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }
inline void store(at::BFloat16* p, vf x) {  // c10's conversion: nearest even, NaN stays NaN
    for (int l = 0; l < W; ++l) p[l] = static_cast<at::BFloat16>(x[l]);
}
inline vf add(vf a, vf b) { return a + b; }
inline vf sub(vf a, vf b) { return a - b; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf div(vf a, vf b) { return a / b; }
inline vf select(vi mask, vf yes, vf no) {  // lanes where mask is all ones take yes
    return bits_to_float((float_to_bits(yes) & mask) | (float_to_bits(no) & ~mask));
}
inline vf max(vf a, vf b) { return select(a > b, a, b); }
inline vf min(vf a, vf b) { return select(a < b, a, b); }
inline vf fmadd(vf a, vf b, vf c) { return a * b + c; }
inline vf fnmadd(vf a, vf b, vf c) { return c - a * b; }
inline vf blend_below(vf x, vf bound, vf yes, vf no) { return select(x < bound, yes, no); }
// Round to nearest even by adding and removing 1.5 * 2^23 (exact for |x| < 2^22; the kernels round
// x log2(e) for x in [-87, 89]); IEEE arithmetic without -ffast-math may not fold it away.
inline vf round_nearest(vf x) {
    const vf magic = set1(12582912.f);
    return (x + magic) - magic;
}
// p 2^n for integral n in [-126, 128], as two exact multiplications by powers of two (see AVX2's).
inline vf scale_by_power_of_two(vf p, vf n) {
    vi whole;
    for (int l = 0; l < W; ++l) whole[l] = static_cast<int32_t>(n[l]);
    const vi half = whole >> 1;
    return p * bits_to_float((half + 127) << 23) * bits_to_float((whole - half + 127) << 23);
}
inline vf keep_first(vf x, int64_t n, vf fill) {
    const vi lane = {0, 1, 2, 3};
    const int32_t bound = static_cast<int32_t>(n < 0 ? 0 : n > W ? W : n);
    return select(lane < bound, x, fill);
}
// (l, l + 2), then (0, 1): the same tree as the NEON variant.
inline float sum_lanes(vf a) { return (a[0] + a[2]) + (a[1] + a[3]); }
inline float max_lanes(vf a) {
    float m = a[0];
    for (int l = 1; l < W; ++l) m = a[l] > m ? a[l] : m;
    return m;
}
inline float first_lane(vf a) { return a[0]; }
inline void transpose(vf r[W]) {
    for (int j = 0; j < W; ++j) {
        for (int k = j + 1; k < W; ++k) {
            const float t = r[j][k];
            r[j][k] = r[k][j];
            r[k][j] = t;
        }
    }
}
#endif

// out[i] = sum_lanes(a[i]) for i < N, bit for bit. On AVX-512 and AVX2, groups of at least W / 2 sums
// are reduced side by side (lane_sums; a tile's 12-16 sums take a third of the instructions one by
// one takes); fewer, and the 4-lane backends, one by one. Inlined whole (N is known), so a tile's sums
// go from its registers to the output without a pass through memory.
template <int N>
__attribute__((always_inline)) inline void sum_lanes_each(const vf (&a)[N], float* out) {
    int i = 0;
#if defined(PREFIXSERVE_SIMD_AVX512) || defined(PREFIXSERVE_SIMD_AVX2)
    for (; N - i >= W / 2; i += W) {
        const int count = std::min(W, N - i);
        vf group[W];
        for (int j = 0; j < W; ++j) group[j] = j < count ? a[i + j] : zero();
        alignas(64) float sums[W];
        store(sums, lane_sums(group));
        for (int j = 0; j < count; ++j) out[i + j] = sums[j];
    }
#endif
    for (; i < N; ++i) out[i] = sum_lanes(a[i]);
}

// x rounded as storing it as T would (bf16: nearest even), back in float32 lanes.
template <typename T>
inline vf round_to(vf x) {
    if constexpr (std::is_same<T, float>::value) {
        return x;
    } else {
        alignas(64) T rounded[W];
        store(rounded, x);
        return load(rounded);
    }
}

// e^x, lane by lane (see EXP_POLY).
inline vf exp(vf x) {
    x = min(max(x, set1(EXP_LOW)), set1(EXP_HIGH));
    const vf n = round_nearest(mul(x, set1(LOG2E)));
    vf r = fnmadd(n, set1(LN2_HIGH), x);
    r = fnmadd(n, set1(LN2_LOW), r);
    vf p = set1(EXP_POLY[0]);
    for (int k = 1; k < 7; ++k) p = fmadd(p, r, set1(EXP_POLY[k]));
    return scale_by_power_of_two(p, n);
}

// tanh x, lane by lane. |x| < TANH_SERIES: its odd Taylor series to x^17 (the next term is under
// 1e-9 relative there); above, (1 - e^-2|x|) / (1 + e^-2|x|), where the subtraction loses under one
// bit (e^-2|x| < 0.45). The sign of x is put back by a multiplication (exact).
constexpr float TANH_SERIES = 0.4f;
constexpr float TANH_TAYLOR[8] = {  // the coefficients of x^17, x^15, ..., x^3
    0.00059002744f, -0.0014558344f, 0.0035921280f, -0.0088632355f, 0.021869489f, -0.053968254f, 0.13333334f,
    -0.33333334f};
inline vf tanh(vf x) {
    const vf size = max(x, sub(zero(), x));
    const vf square = mul(x, x);
    vf series = set1(TANH_TAYLOR[0]);
    for (int k = 1; k < 8; ++k) series = fmadd(series, square, set1(TANH_TAYLOR[k]));
    series = fmadd(mul(series, square), x, x);  // x + x (c3 x^2 + c5 x^4 + ...)
    const vf t = exp(mul(size, set1(-2.f)));
    const vf whole = div(sub(set1(1.f), t), add(set1(1.f), t));
    const vf sign = div(x, max(size, set1(1e-30f)));  // +-1; 0 for x = 0, where either form is 0
    return blend_below(size, set1(TANH_SERIES), series, mul(whole, sign));
}

// Fetch the cache line at p for reading soon (a hint: no effect on results).
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

}  // namespace simd
}  // namespace prefixserve
