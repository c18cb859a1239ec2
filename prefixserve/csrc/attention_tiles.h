// What paged_causal.cpp builds on besides simd.h: where a position's keys live, and the scalar path
// (head_dim not a multiple of the variant's vector width) that reads one row's keys a tile of
// ROW_TILE at a time. Every sum here runs in an order fixed by the row's own key range, never by the
// other rows of a call.
#pragma once

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>


namespace prefixserve {


constexpr int64_t ROW_TILE = 16;  // keys per online-softmax step of the scalar path
constexpr int64_t LANES = 16;     // float32 accumulators a dot product keeps

using simd::load_scalar;

// sum_j q[j] * k[j] over d elements, in LANES running sums then a fixed tree.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
    float acc[LANES] = {0.f};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES) {
        for (int64_t l = 0; l < LANES; ++l) acc[l] += q[j + l] * load_scalar(k, j + l);
    }
    for (int64_t l = 0; j < d; ++j, ++l) acc[l] += q[j] * load_scalar(k, j);
    for (int64_t width = LANES / 2; width > 0; width /= 2) {
        for (int64_t l = 0; l < width; ++l) acc[l] += acc[l + width];
    }
    return acc[0];
}

template <typename T>
inline void axpy(float* out, float a, const T* v, int64_t d) {
    for (int64_t j = 0; j < d; ++j) out[j] += a * load_scalar(v, j);
}


template <typename T>
inline void tile_portable(const float* query, const T* const* key_of, const T* const* value_of, int64_t n,
                          int64_t group, int64_t head_dim, float softcap, float* scores, float* running_max,
                          float* running_sum, float* acc) {
    for (int64_t g = 0; g < group; ++g) {
        float* s = scores + g * ROW_TILE;
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) {
            s[t] = dot(query + g * head_dim, key_of[t], head_dim);
            if (softcap != 0.f) s[t] = std::tanh(s[t] / softcap) * softcap;  // Gemma 2's soft cap
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
        for (int64_t g = 0; g < group; ++g) axpy(acc + g * head_dim, scores[g * ROW_TILE + t], value_of[t], head_dim);
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

// Scratch of one worker on the scalar path: one row of `group` heads.
struct Scratch {
    std::vector<float> query, acc, scores, running_max, running_sum;
    Scratch(int64_t group, int64_t head_dim)
        : query(group * head_dim), acc(group * head_dim), scores(group * ROW_TILE), running_max(group),
          running_sum(group) {}
};

template <typename T>
inline void load_query(const T* q_row, int64_t q_head_stride, int64_t h, int64_t group, int64_t head_dim, float scale,
                       float* query) {
    for (int64_t g = 0; g < group; ++g) {
        const T* head = q_row + (h * group + g) * q_head_stride;
        for (int64_t j = 0; j < head_dim; ++j) query[g * head_dim + j] = load_scalar(head, j) * scale;
    }
}

// The group of query heads of one row over keys [first, last), a tile at a time (the scalar path).
template <typename T>
inline void attend_row(const float* query, int64_t first, int64_t last, const Blocks& blocks, const T* k_cache,
                       const T* v_cache, int64_t slot_stride, int64_t h, int64_t group, int64_t head_dim, float softcap,
                       float* scores, float* running_max, float* running_sum, float* acc) {
    std::fill(acc, acc + group * head_dim, 0.f);
    std::fill(running_max, running_max + group, -std::numeric_limits<float>::infinity());
    std::fill(running_sum, running_sum + group, 0.f);
    const T* key_of[ROW_TILE];
    const T* value_of[ROW_TILE];
    for (int64_t start = first; start < last;) {
        const int64_t stop = std::min(last, (start / ROW_TILE + 1) * ROW_TILE);
        const int64_t n = stop - start;
        for (int64_t t = 0; t < n; ++t) {
            const int64_t slot = blocks.slot(start + t);
            key_of[t] = k_cache + slot * slot_stride + h * head_dim;
            value_of[t] = v_cache + slot * slot_stride + h * head_dim;
        }
        tile_portable(query, key_of, value_of, n, group, head_dim, softcap, scores, running_max, running_sum, acc);
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
