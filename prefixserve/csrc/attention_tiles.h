// What paged_causal.cpp builds on: loads of float32 and bf16, a fixed 16-lane reduction tree, exp,
// where a position's keys live, and the portable path (no AVX-512, or head_dim not a multiple of 16)
// that reads one row's keys a tile at a time. Every sum here runs in an order fixed by the row's own
// key range, never by the other rows of a call.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace prefixserve {


constexpr int64_t TILE = 16;   // keys per online-softmax step
constexpr int64_t LANES = 16;  // float32 accumulators a dot product keeps (one AVX-512 register)

inline float load(const float* p, int64_t j) { return p[j]; }

inline float load(const at::BFloat16* p, int64_t j) {
    uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[j]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

// sum_j q[j] * k[j] over d elements, in LANES running sums then a fixed tree.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
    float acc[LANES] = {0.f};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES) {
        for (int64_t l = 0; l < LANES; ++l) acc[l] += q[j + l] * load(k, j + l);
    }
    for (int64_t l = 0; j < d; ++j, ++l) acc[l] += q[j] * load(k, j);
    for (int64_t width = LANES / 2; width > 0; width /= 2) {
        for (int64_t l = 0; l < width; ++l) acc[l] += acc[l + width];
    }
    return acc[0];
}

template <typename T>
inline void axpy(float* out, float a, const T* v, int64_t d) {
    for (int64_t j = 0; j < d; ++j) out[j] += a * load(v, j);
}

#if defined(__AVX512F__)
constexpr bool VECTOR_PATH = true;
// AVX-512 tile: head_dim a multiple of 16. Same online softmax as the portable one below.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The sum of 16 lanes in a fixed tree: (l, l+8), then (l, l+4), (l, l+2), (0, 1) (paged_causal.cpp's
// sum of a step's weights).
inline float tree16(__m512 a) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// bf16 scores by the bf16 dot-product instruction (AVX512_BF16): lane i of a 32-element chunk sums
// the pair (2i, 2i + 1); chunks accumulate in turn. Used when head_dim is a multiple of 32 (the
// decode path here; paged_causal.cpp multiplies pairs too, a key tile at a time).
template <typename T>
constexpr bool bf16_dot_for() {
#if defined(__AVX512BF16__)
    return std::is_same<T, at::BFloat16>::value;
#else
    return false;
#endif
}

// e^x for x <= 0 (scores minus their max): 2^n * e^r, |r| <= ln2/2, e^r by its degree-6 Taylor
// polynomial (relative error under 2e-7); a fixed sequence of operations, so bit-reproducible.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

#endif

#if !defined(__AVX512F__)
constexpr bool VECTOR_PATH = false;
#endif

template <typename T>
inline void tile_portable(const float* query, const T* const* key_of, const T* const* value_of, int64_t n,
                          int64_t group, int64_t head_dim, float* scores, float* running_max, float* running_sum,
                          float* acc) {
    for (int64_t g = 0; g < group; ++g) {
        float* s = scores + g * TILE;
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) {
            s[t] = dot(query + g * head_dim, key_of[t], head_dim);
            tile_max = std::max(tile_max, s[t]);
        }
        const float new_max = std::max(running_max[g], tile_max);
        const float correction = std::exp(running_max[g] - new_max);
        float total = running_sum[g] * correction;
        for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - new_max);
            total += s[t];
        }
        running_sum[g] = total;
        running_max[g] = new_max;
        float* a = acc + g * head_dim;
        for (int64_t j = 0; j < head_dim; ++j) a[j] *= correction;
    }
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t g = 0; g < group; ++g) axpy(acc + g * head_dim, scores[g * TILE + t], value_of[t], head_dim);
    }
}

// Where one sequence's keys live: position p -> slot, through its block table (block size 2^shift).
struct Blocks {
    const int64_t* table;
    int64_t shift, mask;
    inline int64_t slot(int64_t p) const { return (table[p >> shift] << shift) | (p & mask); }
};

inline int64_t log2_exact(int64_t block_size) {
    int64_t shift = 0;
    while ((int64_t{1} << shift) < block_size) ++shift;
    return shift;
}

// Scratch of one worker on the portable path: one row of `group` heads.
struct Scratch {
    std::vector<float> query, acc, scores, running_max, running_sum;
    Scratch(int64_t group, int64_t head_dim)
        : query(group * head_dim), acc(group * head_dim), scores(group * TILE), running_max(group),
          running_sum(group) {}
};

template <typename T>
inline void load_query(const T* q_row, int64_t q_head_stride, int64_t h, int64_t group, int64_t head_dim, float scale,
                       float* query) {
    for (int64_t g = 0; g < group; ++g) {
        const T* head = q_row + (h * group + g) * q_head_stride;
        for (int64_t j = 0; j < head_dim; ++j) query[g * head_dim + j] = load(head, j) * scale;
    }
}

// The group of query heads of one row over keys [first, last), a tile at a time (the portable path).
template <typename T>
inline void attend_row(const float* query, int64_t first, int64_t last, const Blocks& blocks, const T* k_cache,
                       const T* v_cache, int64_t slot_stride, int64_t h, int64_t group, int64_t head_dim, float* scores,
                       float* running_max, float* running_sum, float* acc) {
    std::fill(acc, acc + group * head_dim, 0.f);
    std::fill(running_max, running_max + group, -std::numeric_limits<float>::infinity());
    std::fill(running_sum, running_sum + group, 0.f);
    const T* key_of[TILE];
    const T* value_of[TILE];
    for (int64_t start = first; start < last;) {
        const int64_t stop = std::min(last, (start / TILE + 1) * TILE);
        const int64_t n = stop - start;
        for (int64_t t = 0; t < n; ++t) {
            const int64_t slot = blocks.slot(start + t);
            key_of[t] = k_cache + slot * slot_stride + h * head_dim;
            value_of[t] = v_cache + slot * slot_stride + h * head_dim;
        }
        tile_portable(query, key_of, value_of, n, group, head_dim, scores, running_max, running_sum, acc);
        start = stop;
    }
}

// A row's `group` heads out: each head's value sums divided by its sum of weights.
template <typename T>
inline void finish(const float* acc, const float* running_sum, int64_t group, int64_t head_dim, T* out_heads) {
    for (int64_t g = 0; g < group; ++g) {
        const float total = running_sum[g];
        const float inverse = total > 0.f ? 1.f / total : 0.f;
        for (int64_t j = 0; j < head_dim; ++j) out_heads[g * head_dim + j] = static_cast<T>(acc[g * head_dim + j] * inverse);
    }
}

}  // namespace prefixserve
