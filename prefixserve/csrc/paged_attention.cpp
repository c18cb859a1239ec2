// prefixserve's compiled CPU attention, read in place from the paged KV cache (no gather):
//
//   paged_decode   decode row i's group of query heads over keys [first[i], last[i]) of its sequence;
//                  returns (out, float32 log-sum-exp), the pair the cascade's merge takes.
//                  Reference: attention.py's _attend_decodes.
//   paged_causal   every row of a step, a row at position p over keys [0, p + 1): bf16's batch-invariant
//                  path. Reference: invariant_attention.py (and _attend in float32).
//
// A position p lives at block tables[i][p / block_size], offset p % block_size. Keys are taken in
// tiles of TILE positions aligned to multiples of TILE; each tile's scores update a running max and
// sum (online softmax, float32), then its values are accumulated in float32. The order of every sum
// depends on the row's own key range only, never on the other rows of the step.
#include <torch/extension.h>
#include <ATen/Parallel.h>

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

namespace {

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

// The sum of 16 lanes in a fixed tree: (l, l+8), then (l, l+4), (l, l+2), (0, 1). Every score and
// every tile sum is reduced this way, so the transposed multi-row path below reproduces the bits.
inline float tree16(__m512 a) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// bf16 scores by the bf16 dot-product instruction (AVX512_BF16): lane i of a 32-element chunk sums
// the pair (2i, 2i + 1); chunks accumulate in turn. Used when head_dim is a multiple of 32, by the
// decode path and the transposed path alike, so a row's bits stay the same in both.
template <typename T>
constexpr bool bf16_dot_for() {
#if defined(__AVX512BF16__)
    return std::is_same<T, at::BFloat16>::value;
#else
    return false;
#endif
}

#if defined(__AVX512BF16__)
inline __m512 dot_pairs(const uint16_t* q, const at::BFloat16* k, int64_t head_dim) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < head_dim; j += 32) {
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + j), (__m512bh)_mm512_loadu_si512(k + j));
    }
    return acc;
}
#endif

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

// One tile's online-softmax step for one query vector, shared by both paths so that they round
// alike: the live lanes of `scores` update the running max and sum, the accumulator is rescaled,
// and the tile's weights (0 in dead lanes) are stored to `weights` for the value sums.
inline void softmax_step(__m512 scores, __mmask16 live, float& running_max, float& running_sum, float* acc,
                         int64_t head_dim, float* weights) {
    const __m512 tile = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, scores);
    const float new_max = std::max(running_max, _mm512_reduce_max_ps(tile));
    const float correction = running_max == new_max ? 1.f
                             : _mm512_cvtss_f32(exp16(_mm512_set1_ps(running_max - new_max)));
    const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(tile, _mm512_set1_ps(new_max))));
    _mm512_storeu_ps(weights, p);
    running_sum = running_sum * correction + tree16(p);
    running_max = new_max;
    if (correction != 1.f) {
        const __m512 c = _mm512_set1_ps(correction);
        for (int64_t j = 0; j < head_dim; j += 16) _mm512_storeu_ps(acc + j, _mm512_mul_ps(_mm512_loadu_ps(acc + j), c));
    }
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

#if defined(__AVX512F__)
template <typename T>
inline void tile_avx512(const float* query, const uint16_t* query_bits, float scale, const T* const* key_of,
                        const T* const* value_of, int64_t n, int64_t group, int64_t head_dim, float* scores,
                        float* running_max, float* running_sum, float* acc) {
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    const bool pairs = bf16_dot_for<T>() && head_dim % 32 == 0;
    for (int64_t g = 0; g < group; ++g) {
        const float* qg = query + g * head_dim;
        float* s = scores + g * TILE;
        for (int64_t t = 0; t < n; ++t) {
#if defined(__AVX512BF16__)
            if constexpr (bf16_dot_for<T>()) {
                if (pairs) {
                    s[t] = tree16(dot_pairs(query_bits + g * head_dim, key_of[t], head_dim)) * scale;
                    continue;
                }
            }
#endif
            __m512 sum = _mm512_mul_ps(load16(qg), load16(key_of[t]));
            for (int64_t j = 16; j < head_dim; j += 16) sum = _mm512_fmadd_ps(load16(qg + j), load16(key_of[t] + j), sum);
            s[t] = tree16(sum);
        }
        softmax_step(_mm512_loadu_ps(s), live, running_max[g], running_sum[g], acc + g * head_dim, head_dim, s);
    }
    for (int64_t j = 0; j < head_dim; j += 16) {
        for (int64_t g = 0; g < group; ++g) {
            float* a = acc + g * head_dim + j;
            const float* p = scores + g * TILE;
            __m512 sum = load16(a);
            for (int64_t t = 0; t < n; ++t) sum = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load16(value_of[t] + j), sum);
            _mm512_storeu_ps(a, sum);
        }
    }
}
#endif

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

// Scratch of one worker: up to `rows` query rows of `group` heads.
struct Scratch {
    std::vector<float> query, acc, scores, running_max, running_sum, keys_t, values;
    std::vector<uint16_t> query_bits;  // bf16 q as stored (the bf16 dot product reads it)
    Scratch(int64_t rows, int64_t group, int64_t head_dim)
        : query(rows * group * head_dim), acc(rows * group * head_dim), scores(group * TILE), running_max(rows * group),
          running_sum(rows * group), keys_t(head_dim * TILE), values(TILE * head_dim),
          query_bits(rows * group * head_dim) {}
};

template <typename T>
inline void load_query(const T* q_row, int64_t q_head_stride, int64_t h, int64_t group, int64_t head_dim, float scale,
                       float* query, uint16_t* query_bits) {
    for (int64_t g = 0; g < group; ++g) {
        const T* head = q_row + (h * group + g) * q_head_stride;
        for (int64_t j = 0; j < head_dim; ++j) query[g * head_dim + j] = load(head, j) * scale;
        if constexpr (std::is_same<T, at::BFloat16>::value) {
            std::memcpy(query_bits + g * head_dim, head, head_dim * sizeof(uint16_t));
        }
    }
}

// The group of query heads of one row over keys [first, last), a tile at a time (the decode path).
template <typename T>
void attend_row(const float* query, const uint16_t* query_bits, float scale, int64_t first, int64_t last,
                const Blocks& blocks, const T* k_cache, const T* v_cache, int64_t slot_stride, int64_t h, int64_t group, int64_t head_dim, bool vectorized,
                float* scores, float* running_max, float* running_sum, float* acc) {
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
#if defined(__AVX512F__)
        if (vectorized) {
            tile_avx512(query, query_bits, scale, key_of, value_of, n, group, head_dim, scores, running_max, running_sum,
                        acc);
        } else
#endif
        {
            tile_portable(query, key_of, value_of, n, group, head_dim, scores, running_max, running_sum, acc);
        }
        start = stop;
    }
}

template <typename T>
inline void finish(const float* acc, const float* running_max, const float* running_sum, int64_t group,
                   int64_t head_dim, T* out_heads, float* lse_heads) {
    for (int64_t g = 0; g < group; ++g) {
        const float total = running_sum[g];
        const float inverse = total > 0.f ? 1.f / total : 0.f;
        for (int64_t j = 0; j < head_dim; ++j) out_heads[g * head_dim + j] = static_cast<T>(acc[g * head_dim + j] * inverse);
        if (lse_heads != nullptr) {
            lse_heads[g] = total > 0.f ? running_max[g] + std::log(total) : -std::numeric_limits<float>::infinity();
        }
    }
}

template <typename T>
void decode_kernel(const T* q, int64_t q_row_stride, int64_t q_head_stride, const int64_t* rows,
                   const T* k_cache, const T* v_cache, int64_t block_size, int64_t num_kv_heads,
                   const int64_t* tables, int64_t table_stride, const int64_t* first, const int64_t* last,
                   int64_t num_decodes, int64_t num_heads, int64_t head_dim, float scale, T* out,
                   float* lse) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive positions
    const int64_t shift = log2_exact(block_size);
    const bool vectorized = VECTOR_PATH && head_dim % 16 == 0;
    at::parallel_for(0, num_decodes * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
        Scratch scratch(1, group, head_dim);
        for (int64_t item = begin; item < end; ++item) {
            const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
            load_query(q + rows[i] * q_row_stride, q_head_stride, h, group, head_dim, scale, scratch.query.data(),
                       scratch.query_bits.data());
            const Blocks blocks{tables + i * table_stride, shift, block_size - 1};
            attend_row(scratch.query.data(), scratch.query_bits.data(), scale, first[i], last[i], blocks, k_cache,
                       v_cache, slot_stride, h, group, head_dim, vectorized, scratch.scores.data(),
                       scratch.running_max.data(), scratch.running_sum.data(), scratch.acc.data());
            finish(scratch.acc.data(), scratch.running_max.data(), scratch.running_sum.data(), group, head_dim,
                   out + (i * num_heads + h * group) * head_dim, lse + i * num_heads + h * group);
        }
    });
}

#if defined(__AVX512F__)
// `count` consecutive rows at positions p0, p0 + 1, ... of one sequence (group heads each), causal
// over keys [0, p + 1). A key tile is transposed once ([d][16], float32) and read by every row, and
// a row's 16 scores come out in one register. Each score and sum is the same operations in the same
// order as tile_avx512 (the partial for lane l sums d = l, l + 16, ... in turn, then tree16's tree),
// so a row's bits do not depend on how many rows shared the call or on decode versus prefill.
constexpr int64_t HEADS_AT_ONCE = 4;  // query heads of a KV group the transposed path computes together

template <typename T>
void attend_rows_transposed(int64_t count, int64_t p0, const Blocks& blocks, const T* k_cache, const T* v_cache,
                            int64_t slot_stride, int64_t h, int64_t group, int64_t head_dim, float scale,
                            Scratch& scratch) {
    const bool pairs = bf16_dot_for<T>() && head_dim % 32 == 0;  // keys_t then holds [d / 2][16] bf16 pairs
    const int64_t vectors = count * group;
    float* query = scratch.query.data();
    float* acc = scratch.acc.data();
    float* running_max = scratch.running_max.data();
    float* running_sum = scratch.running_sum.data();
    float* keys_t = scratch.keys_t.data();
    float* values = scratch.values.data();
    float* p = scratch.scores.data();
    std::fill(acc, acc + vectors * head_dim, 0.f);
    std::fill(running_max, running_max + vectors, -std::numeric_limits<float>::infinity());
    std::fill(running_sum, running_sum + vectors, 0.f);
    const int64_t end = p0 + count;
    for (int64_t start = 0; start < end; start += TILE) {
        const int64_t in_tile = std::min(TILE, end - start);
        for (int64_t t = 0; t < TILE; ++t) {
            if (t < in_tile) {
                const int64_t slot = blocks.slot(start + t);
                const T* key = k_cache + slot * slot_stride + h * head_dim;
                const T* value = v_cache + slot * slot_stride + h * head_dim;
                if (pairs) {
                    uint32_t* pairs_t = reinterpret_cast<uint32_t*>(keys_t);
                    const uint32_t* key_pairs = reinterpret_cast<const uint32_t*>(key);
                    for (int64_t c = 0; c < head_dim / 2; ++c) pairs_t[c * TILE + t] = key_pairs[c];
                } else {
                    for (int64_t j = 0; j < head_dim; ++j) keys_t[j * TILE + t] = load(key, j);
                }
                for (int64_t j = 0; j < head_dim; j += 16) _mm512_storeu_ps(values + t * head_dim + j, load16(value + j));
            } else {
                for (int64_t j = 0; j < head_dim; ++j) keys_t[j * TILE + t] = 0.f;
            }
        }
        for (int64_t r = 0; r < count; ++r) {
            const int64_t n = std::min(TILE, p0 + r + 1 - start);  // keys of this tile row r sees
            if (n <= 0) continue;
            const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
            // The heads of the row share each load of the transposed keys and of the values.
            for (int64_t g0 = 0; g0 < group; g0 += HEADS_AT_ONCE) {
                const int64_t heads = std::min(HEADS_AT_ONCE, group - g0);
                __m512 part[HEADS_AT_ONCE][16];
#if defined(__AVX512BF16__)
                if (pairs) {  // lane l of partial l: pairs l, l + 16, ... (dot_pairs' lanes), each zero-started
                    const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(scratch.query_bits.data());
                    for (int64_t l = 0; l < 16; ++l) {
                        for (int64_t g = 0; g < heads; ++g) part[g][l] = _mm512_setzero_ps();
                        for (int64_t c = l; c < head_dim / 2; c += 16) {
                            const __m512bh kc = (__m512bh)_mm512_loadu_si512(keys_t + c * TILE);
                            for (int64_t g = 0; g < heads; ++g) {
                                const uint32_t qp = q_pairs[((r * group + g0 + g) * head_dim) / 2 + c];
                                part[g][l] = _mm512_dpbf16_ps(part[g][l], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp)), kc);
                            }
                        }
                    }
                } else
#endif
                for (int64_t l = 0; l < 16; ++l) {
                    const __m512 k0 = _mm512_loadu_ps(keys_t + l * TILE);
                    for (int64_t g = 0; g < heads; ++g) {
                        part[g][l] = _mm512_mul_ps(_mm512_set1_ps(query[(r * group + g0 + g) * head_dim + l]), k0);
                    }
                    for (int64_t j = l + 16; j < head_dim; j += 16) {
                        const __m512 kj = _mm512_loadu_ps(keys_t + j * TILE);
                        for (int64_t g = 0; g < heads; ++g) {
                            part[g][l] = _mm512_fmadd_ps(_mm512_set1_ps(query[(r * group + g0 + g) * head_dim + j]), kj,
                                                         part[g][l]);
                        }
                    }
                }
                for (int64_t g = 0; g < heads; ++g) {
                    const int64_t v = r * group + g0 + g;
                    __m512* pg = part[g];
                    for (int64_t l = 0; l < 8; ++l) pg[l] = _mm512_add_ps(pg[l], pg[l + 8]);
                    for (int64_t l = 0; l < 4; ++l) pg[l] = _mm512_add_ps(pg[l], pg[l + 4]);
                    for (int64_t l = 0; l < 2; ++l) pg[l] = _mm512_add_ps(pg[l], pg[l + 2]);
                    const __m512 scores = pairs ? _mm512_mul_ps(_mm512_add_ps(pg[0], pg[1]), _mm512_set1_ps(scale))
                                                : _mm512_add_ps(pg[0], pg[1]);
                    softmax_step(scores, live, running_max[v], running_sum[v], acc + v * head_dim, head_dim, p + g * TILE);
                }
                for (int64_t j = 0; j < head_dim; j += 16) {
                    __m512 sum[HEADS_AT_ONCE];
                    for (int64_t g = 0; g < heads; ++g) sum[g] = _mm512_loadu_ps(acc + (r * group + g0 + g) * head_dim + j);
                    for (int64_t t = 0; t < n; ++t) {
                        const __m512 value = _mm512_loadu_ps(values + t * head_dim + j);
                        for (int64_t g = 0; g < heads; ++g) sum[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * TILE + t]), value, sum[g]);
                    }
                    for (int64_t g = 0; g < heads; ++g) _mm512_storeu_ps(acc + (r * group + g0 + g) * head_dim + j, sum[g]);
                }
            }
        }
    }
}
#endif

constexpr int64_t ROWS = 16;           // rows of a sequence a work item takes
constexpr int64_t MIN_TRANSPOSED = 4;  // fewer rows take the decode path (the same bits, cheaper)

// Causal attention of every row of the step: sequence i's rows query_start[i] .. query_start[i+1]
// are its last positions, seq_lens[i] - query_len .. seq_lens[i] - 1; a row at p reads keys [0, p + 1).
template <typename T>
void causal_kernel(const T* q, int64_t q_row_stride, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                   int64_t block_size, int64_t num_kv_heads, const int64_t* tables, int64_t table_stride,
                   const int64_t* query_start, const int64_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                   int64_t head_dim, float scale, T* out) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;
    const int64_t shift = log2_exact(block_size);
    const bool vectorized = VECTOR_PATH && head_dim % 16 == 0;
    std::vector<int64_t> item_seq, item_row;  // a work item: up to ROWS rows of a sequence (all KV heads)
    for (int64_t i = 0; i < num_seqs; ++i) {
        for (int64_t r = query_start[i]; r < query_start[i + 1]; r += ROWS) {
            item_seq.push_back(i);
            item_row.push_back(r);
        }
    }
    // Item k: rows item_row[k / num_kv_heads] .. of sequence item_seq[...], KV head k % num_kv_heads.
    auto attend_item = [&](int64_t k, Scratch& scratch) {
        const int64_t item = k / num_kv_heads, h = k % num_kv_heads;
        const int64_t i = item_seq[item], r0 = item_row[item];
        const int64_t count = std::min(ROWS, query_start[i + 1] - r0);
        const int64_t p0 = seq_lens[i] - (query_start[i + 1] - query_start[i]) + (r0 - query_start[i]);
        const Blocks blocks{tables + i * table_stride, shift, block_size - 1};
        const int64_t per_row = group * head_dim;
        for (int64_t r = 0; r < count; ++r) {
            load_query(q + (r0 + r) * q_row_stride, q_head_stride, h, group, head_dim, scale,
                       scratch.query.data() + r * per_row, scratch.query_bits.data() + r * per_row);
        }
        T* out_row = out + (r0 * num_heads + h * group) * head_dim;  // row r0's heads of this KV group
        const int64_t out_row_stride = num_heads * head_dim;
#if defined(__AVX512F__)
        if (vectorized && count >= MIN_TRANSPOSED) {
            attend_rows_transposed(count, p0, blocks, k_cache, v_cache, slot_stride, h, group, head_dim, scale, scratch);
            for (int64_t r = 0; r < count; ++r) {
                finish(scratch.acc.data() + r * per_row, scratch.running_max.data() + r * group,
                       scratch.running_sum.data() + r * group, group, head_dim, out_row + r * out_row_stride,
                       static_cast<float*>(nullptr));
            }
            return;
        }
#endif
        for (int64_t r = 0; r < count; ++r) {
            attend_row(scratch.query.data() + r * per_row, scratch.query_bits.data() + r * per_row, scale, 0, p0 + r + 1,
                       blocks, k_cache, v_cache, slot_stride, h, group, head_dim, vectorized, scratch.scores.data(),
                       scratch.running_max.data(), scratch.running_sum.data(), scratch.acc.data());
            finish(scratch.acc.data(), scratch.running_max.data(), scratch.running_sum.data(), group, head_dim,
                   out_row + r * out_row_stride, static_cast<float*>(nullptr));
        }
    };
    const int64_t num_items = static_cast<int64_t>(item_seq.size()) * num_kv_heads;
    // Item k goes to worker k mod workers: later rows read more keys, so their cost is dealt out evenly.
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
        Scratch scratch(ROWS, group, head_dim);
        for (int64_t w = begin; w < end; ++w) {
            for (int64_t k = w; k < num_items; k += workers) attend_item(k, scratch);
        }
    });
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  std::initializer_list<const torch::Tensor*> indices) {
    TORCH_CHECK(q.dim() == 3, "q must be [tokens, heads, head_dim]");
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                "k_cache and v_cache must both be [blocks, block_size, kv_heads, head_dim]");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                "q and the caches must share a dtype");
    TORCH_CHECK(q.stride(2) == 1, "q's head_dim must be contiguous");
    TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "the kernels run on CPU tensors");
    for (const torch::Tensor* index : indices) {
        TORCH_CHECK(index->scalar_type() == torch::kInt64 && index->is_contiguous(), "index tensors must be contiguous int64");
    }
    TORCH_CHECK(k_cache.size(3) == q.size(2), "q and the caches differ in head_dim");
    TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of KV heads");
    TORCH_CHECK(k_cache.size(1) > 0 && (k_cache.size(1) & (k_cache.size(1) - 1)) == 0, "block_size must be a power of two");
}

// Every block holding positions [first, last) of sequence i must exist: a bad table is an error,
// never a stray read.
void check_blocks(const torch::Tensor& tables, int64_t i, int64_t first, int64_t last, int64_t block_size,
                  int64_t num_blocks) {
    TORCH_CHECK(first >= 0 && first <= last && (last == 0 || (last - 1) / block_size < tables.size(1)),
                "key range [first, last) outside the block table");
    const int64_t* table = tables.data_ptr<int64_t>() + i * tables.stride(0);
    for (int64_t b = first / block_size; b * block_size < last; ++b) {
        TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block id out of range");
    }
}

std::vector<torch::Tensor> paged_decode(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& k_cache,
                                        const torch::Tensor& v_cache, const torch::Tensor& tables,
                                        const torch::Tensor& first, const torch::Tensor& last, double scale) {
    check_inputs(q, k_cache, v_cache, {&rows, &tables, &first, &last});
    const int64_t num_decodes = rows.size(0), num_heads = q.size(1), head_dim = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_decodes && first.size(0) == num_decodes &&
                    last.size(0) == num_decodes, "one block table, first and last per decode");
    const int64_t* lo = first.data_ptr<int64_t>();
    const int64_t* hi = last.data_ptr<int64_t>();
    const int64_t* row = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < num_decodes; ++i) {
        TORCH_CHECK(row[i] >= 0 && row[i] < q.size(0), "decode row out of range");
        check_blocks(tables, i, lo[i], hi[i], block_size, k_cache.size(0));
    }
    auto out = torch::empty({num_decodes, num_heads, head_dim}, q.options());
    auto lse = torch::empty({num_decodes, num_heads}, q.options().dtype(torch::kFloat32));
    AT_DISPATCH_SWITCH(q.scalar_type(), "paged_decode",
        AT_DISPATCH_CASE(torch::kFloat32, [&] {
            decode_kernel<float>(q.data_ptr<float>(), q.stride(0), q.stride(1), rows.data_ptr<int64_t>(),
                                 k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_size, num_kv_heads,
                                 tables.data_ptr<int64_t>(), tables.stride(0), first.data_ptr<int64_t>(),
                                 last.data_ptr<int64_t>(), num_decodes, num_heads, head_dim,
                                 static_cast<float>(scale), out.data_ptr<float>(), lse.data_ptr<float>());
        })
        AT_DISPATCH_CASE(torch::kBFloat16, [&] {
            decode_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), rows.data_ptr<int64_t>(),
                                        k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), block_size,
                                        num_kv_heads, tables.data_ptr<int64_t>(), tables.stride(0),
                                        first.data_ptr<int64_t>(), last.data_ptr<int64_t>(), num_decodes, num_heads,
                                        head_dim, static_cast<float>(scale), out.data_ptr<at::BFloat16>(),
                                        lse.data_ptr<float>());
        }));
    return {out, lse};
}

torch::Tensor paged_causal(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& tables, const torch::Tensor& query_start, const torch::Tensor& seq_lens,
                           double scale) {
    check_inputs(q, k_cache, v_cache, {&tables, &query_start, &seq_lens});
    const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), head_dim = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && query_start.size(0) == num_seqs + 1,
                "one block table and seq_len per sequence, num_seqs + 1 query starts");
    const int64_t* start = query_start.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    TORCH_CHECK(start[0] == 0 && start[num_seqs] == q.size(0), "query starts must cover q's rows");
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t query_len = start[i + 1] - start[i];
        TORCH_CHECK(query_len >= 0 && lens[i] >= query_len, "each sequence needs 0 <= query_len <= seq_len");
        check_blocks(tables, i, 0, lens[i], block_size, k_cache.size(0));
    }
    auto out = torch::empty({q.size(0), num_heads, head_dim}, q.options());
    AT_DISPATCH_SWITCH(q.scalar_type(), "paged_causal",
        AT_DISPATCH_CASE(torch::kFloat32, [&] {
            causal_kernel<float>(q.data_ptr<float>(), q.stride(0), q.stride(1), k_cache.data_ptr<float>(),
                                 v_cache.data_ptr<float>(), block_size, num_kv_heads, tables.data_ptr<int64_t>(),
                                 tables.stride(0), query_start.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                                 num_seqs, num_heads, head_dim, static_cast<float>(scale), out.data_ptr<float>());
        })
        AT_DISPATCH_CASE(torch::kBFloat16, [&] {
            causal_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1),
                                        k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), block_size,
                                        num_kv_heads, tables.data_ptr<int64_t>(), tables.stride(0),
                                        query_start.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), num_seqs,
                                        num_heads, head_dim, static_cast<float>(scale), out.data_ptr<at::BFloat16>());
        }));
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "prefixserve's compiled CPU kernels (the pure-PyTorch paths in prefixserve.model are their reference)";
    m.def("paged_decode", &paged_decode, "decode attention read in place from the paged KV cache");
    m.def("paged_causal", &paged_causal, "causal attention of every row of a step, each row alike in any batch");
}
