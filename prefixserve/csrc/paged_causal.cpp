// Causal attention of every row of a step, read in place from the paged cache: a row at position p
// attends to keys [0, p + 1). Every row of every step, prefill chunks and decodes, float32 and bf16
// (attention.py calls nothing else where the kernel is built).
//
// A work item is up to ROWS consecutive rows of one sequence and one KV head: ROWS x group query
// vectors. Keys go by in steps of STEP = 32 positions aligned to multiples of 32 (absolute positions),
// each step two tiles of 16:
//
//   key tile, transposed in registers     key_t[c] lane k = element c of key k (a bf16 pair, or a float)
//   a vector's 16 scores per tile         sum over c of q[c] * key_t[c]: bf16 pairs in CHAINS running
//                                         sums (c mod CHAINS) added in a fixed tree; floats in one
//                                         running sum, c in turn. One register either way
//   online softmax step over 32 scores    running max and sum, float32
//   values                                acc += w[k] * value[k] for k = 0 .. 31 in turn, float32
//
// Each vector's sums are the same operations in the same order whatever other rows share its item:
// a decode (1 row), a prefill chunk, wherever the chunk starts. A row's bits are its own, so a
// cache hit, a different batch or another chunking gives the same tokens (tests/test_model_kernels.py).
// Vectors are computed in blocks (PAIR_BLOCK, FLOAT_BLOCK, VALUE_BLOCK) only so that one load of a
// key or value register serves several of them; blocking changes no vector's order of operations.
#include "attention_tiles.h"
#include "kernels.h"

#include <ATen/Parallel.h>

namespace prefixserve {
namespace {

constexpr int64_t ROWS = 32;  // rows of one sequence a work item takes
constexpr int64_t STEP = 2 * TILE;  // keys per online-softmax step: two 16-key tiles

// A query row: its sequence's block table, its position (it reads keys [0, position + 1)), its row of q.
struct Row {
    const int64_t* table;
    int64_t position, q_row;
};

// Whether rows a and b (a's position <= b's) read the same blocks for the keys of the step from
// `start` that a sees: then one transposed copy of b's keys serves both.
inline bool same_blocks(const Row& a, const Row& b, int64_t start, int64_t shift) {
    if (a.table == b.table) return true;
    const int64_t last = std::min(start + STEP, a.position + 1) - 1;
    for (int64_t block = start >> shift; block <= (last >> shift); ++block) {
        if (a.table[block] != b.table[block]) return false;
    }
    return true;
}

// Scratch of one worker: ROWS rows of `group` vectors.
struct CausalScratch {
    std::vector<uint32_t> query_pairs;  // per vector: bf16 pairs as stored (PAIRS)
    std::vector<float> query_floats;    // or q * scale as floats
    std::vector<float> acc, running_max, running_sum, weights, key_t, values, zeros;
    CausalScratch(int64_t group, int64_t head_dim)
        : query_pairs(ROWS * group * head_dim / 2), query_floats(ROWS * group * head_dim),
          acc(ROWS * group * head_dim), running_max(ROWS * group), running_sum(ROWS * group),
          weights(ROWS * group * STEP), key_t(head_dim * STEP), values(STEP * head_dim), zeros(head_dim, 0.f) {}
};

#if defined(__AVX512F__)
constexpr int CHAINS = 4;        // bf16: running sums per score, enough independent chains for one decode row
constexpr int PAIR_BLOCK = 6;    // bf16 vectors scored together, a tile at a time: 6 x CHAINS accumulators
constexpr int FLOAT_BLOCK = 8;   // float32 vectors scored together against both tiles: 8 x 2 accumulators
constexpr int SCORE_BLOCK = std::max(PAIR_BLOCK, FLOAT_BLOCK);
constexpr int VALUE_BLOCK = 6;   // vectors whose values are summed together: 6 x 4 registers of 16 dims
constexpr int VALUE_WIDTH = 4;   // registers of 16 dims a value pass holds per vector

// 16 registers of 16 32-bit lanes, transposed in place: afterwards r[j] lane k = before r[k] lane j.
inline void transpose16(__m512 r[16]) {
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

// Keys as 32-bit elements: bf16 pairs (PAIRS: the bf16 dot-product instruction multiplies a pair
// per lane) or floats. `elements` per key, a multiple of 16.
template <typename T, bool PAIRS>
inline __m512 load_elements(const T* key, int64_t e) {
    if constexpr (PAIRS) {
        return _mm512_castsi512_ps(_mm512_loadu_si512(reinterpret_cast<const uint32_t*>(key) + e));
    } else {
        return load16(key + e);
    }
}

template <typename T, bool PAIRS>
inline void load_key_tile(const T* const* key_of, int64_t n, int64_t elements, float* key_t) {
    for (int64_t e0 = 0; e0 < elements; e0 += 16) {
        __m512 r[16];
        for (int64_t k = 0; k < 16; ++k) r[k] = k < n ? load_elements<T, PAIRS>(key_of[k], e0) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t c = 0; c < 16; ++c) _mm512_storeu_ps(key_t + (e0 + c) * 16, r[c]);
    }
}

template <bool PAIRS>
using QueryElement = std::conditional_t<PAIRS, uint32_t, float>;

// Calls body(std::integral_constant<int, n>) for count = n in 1 .. N: blocks of every size compile
// with their accumulators in registers.
template <int N, typename Body>
inline void with_block(int64_t count, Body&& body) {
    if constexpr (N > 1) {
        if (count < N) return with_block<N - 1>(count, body);
    }
    body(std::integral_constant<int, N>{});
}

// bf16 scores of NV vectors (pairs [NV][elements]) against one key tile, times scale.
template <int NV>
inline void score_pairs(const uint32_t* query, int64_t elements, const float* key_t, float scale, __m512* scores) {
#if defined(__AVX512BF16__)
    __m512 sum[NV][CHAINS];
    for (int v = 0; v < NV; ++v) {
        for (int ch = 0; ch < CHAINS; ++ch) sum[v][ch] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < elements; c += CHAINS) {
        for (int ch = 0; ch < CHAINS; ++ch) {
            const __m512bh k = (__m512bh)_mm512_castps_si512(_mm512_loadu_ps(key_t + (c + ch) * 16));
            for (int v = 0; v < NV; ++v) {
                const __m512i q = _mm512_set1_epi32(static_cast<int>(query[v * elements + c + ch]));
                sum[v][ch] = _mm512_dpbf16_ps(sum[v][ch], (__m512bh)q, k);
            }
        }
    }
    static_assert(CHAINS == 4, "the fixed tree below adds four running sums");
    for (int v = 0; v < NV; ++v) {
        const __m512 total = _mm512_add_ps(_mm512_add_ps(sum[v][0], sum[v][1]), _mm512_add_ps(sum[v][2], sum[v][3]));
        scores[v] = _mm512_mul_ps(total, _mm512_set1_ps(scale));
    }
#endif
}

// float32 scores of NV vectors (q * scale, [NV][elements]) against both tiles of the step, one running
// sum each: per element, two key registers serve 2 NV multiply-adds, and 2 NV independent sums keep
// the multiply-add units busy (a block of four vectors' sums measured 1.5x slower: latency-bound).
// Not inlined: inlined into attend_rows it measured 6-8% slower over the whole prefill (registers).
template <int NV>
__attribute__((noinline)) void score_floats(const float* query, int64_t elements, const float* key_t, __m512* low,
                                             __m512* high) {
    __m512 a[NV], b[NV];
    for (int v = 0; v < NV; ++v) a[v] = b[v] = _mm512_setzero_ps();
    const float* key_high = key_t + elements * TILE;
    for (int64_t c = 0; c < elements; ++c) {
        const __m512 k_low = _mm512_loadu_ps(key_t + c * 16), k_high = _mm512_loadu_ps(key_high + c * 16);
        for (int v = 0; v < NV; ++v) {
            const __m512 q = _mm512_set1_ps(query[v * elements + c]);
            a[v] = _mm512_fmadd_ps(q, k_low, a[v]);
            b[v] = _mm512_fmadd_ps(q, k_high, b[v]);
        }
    }
    for (int v = 0; v < NV; ++v) {
        low[v] = a[v];
        high[v] = b[v];
    }
}

// A block of `count` vectors' scores for the step: keys 0-15 in low, 16-31 in high (zeros past the
// step's keys, masked out by the caller).
template <bool PAIRS>
inline void score_step(int64_t count, const QueryElement<PAIRS>* query, int64_t elements, const float* key_t,
                       bool two_tiles, float scale, __m512* low, __m512* high) {
    if constexpr (PAIRS) {
        with_block<PAIR_BLOCK>(count, [&](auto nv) {
            score_pairs<decltype(nv)::value>(query, elements, key_t, scale, low);
            if (two_tiles) score_pairs<decltype(nv)::value>(query, elements, key_t + elements * TILE, scale, high);
        });
        if (!two_tiles) std::fill(high, high + count, _mm512_setzero_ps());
    } else {
        with_block<FLOAT_BLOCK>(count, [&](auto nv) {
            score_floats<decltype(nv)::value>(query, elements, key_t, low, high);
        });
    }
}

// One step's online softmax for one vector, its STEP scores in two registers (keys 0-15, 16-31):
// the live lanes update the running max and sum, the sums so far are rescaled when the max grows,
// and the step's weights (0 in dead lanes) go to `weights` for the value sums.
inline void softmax_step(__m512 low, __m512 high, __mmask16 live_low, __mmask16 live_high, float& running_max,
                         float& running_sum, float* acc, int64_t head_dim, float* weights) {
    const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    low = _mm512_mask_mov_ps(none, live_low, low);
    high = _mm512_mask_mov_ps(none, live_high, high);
    const float new_max = std::max(running_max, _mm512_reduce_max_ps(_mm512_max_ps(low, high)));
    const float correction = running_max == new_max ? 1.f
                             : _mm512_cvtss_f32(exp16(_mm512_set1_ps(running_max - new_max)));
    const __m512 top = _mm512_set1_ps(new_max);
    const __m512 p_low = _mm512_maskz_mov_ps(live_low, exp16(_mm512_sub_ps(low, top)));
    const __m512 p_high = _mm512_maskz_mov_ps(live_high, exp16(_mm512_sub_ps(high, top)));
    _mm512_storeu_ps(weights, p_low);
    _mm512_storeu_ps(weights + TILE, p_high);
    running_sum = running_sum * correction + tree16(_mm512_add_ps(p_low, p_high));
    running_max = new_max;
    if (correction != 1.f) {
        const __m512 c = _mm512_set1_ps(correction);
        for (int64_t j = 0; j < head_dim; j += 16) _mm512_storeu_ps(acc + j, _mm512_mul_ps(_mm512_loadu_ps(acc + j), c));
    }
}

// acc[v][j .. j + 16 W) += sum over t of weights[v][t] * value_rows[t][j ..], t = 0 .. STEP - 1 in turn.
template <int NV, int W>
inline void value_block(float* acc, int64_t head_dim, const float* weights, const float* const* value_rows, int64_t j) {
    __m512 a[NV][W];
    for (int v = 0; v < NV; ++v) {
        for (int m = 0; m < W; ++m) a[v][m] = _mm512_loadu_ps(acc + v * head_dim + j + 16 * m);
    }
    for (int t = 0; t < STEP; ++t) {
        __m512 value[W];
        for (int m = 0; m < W; ++m) value[m] = _mm512_loadu_ps(value_rows[t] + j + 16 * m);
        for (int v = 0; v < NV; ++v) {
            const __m512 w = _mm512_set1_ps(weights[v * STEP + t]);
            for (int m = 0; m < W; ++m) a[v][m] = _mm512_fmadd_ps(w, value[m], a[v][m]);
        }
    }
    for (int v = 0; v < NV; ++v) {
        for (int m = 0; m < W; ++m) _mm512_storeu_ps(acc + v * head_dim + j + 16 * m, a[v][m]);
    }
}

template <int NV>
inline void value_columns(float* acc, int64_t head_dim, const float* weights, const float* const* value_rows) {
    int64_t j = 0;
    for (; j + 16 * VALUE_WIDTH <= head_dim; j += 16 * VALUE_WIDTH) {
        value_block<NV, VALUE_WIDTH>(acc, head_dim, weights, value_rows, j);
    }
    switch ((head_dim - j) / 16) {
        case 3: value_block<NV, 3>(acc, head_dim, weights, value_rows, j); break;
        case 2: value_block<NV, 2>(acc, head_dim, weights, value_rows, j); break;
        case 1: value_block<NV, 1>(acc, head_dim, weights, value_rows, j); break;
        default: break;
    }
}

template <typename T, bool PAIRS>
void load_queries(const Queries<T>& q, const Row* rows, int64_t count, int64_t h, int64_t group, int64_t head_dim,
                  float scale, QueryElement<PAIRS>* query) {
    const int64_t elements = PAIRS ? head_dim / 2 : head_dim;
    for (int64_t r = 0; r < count; ++r) {
        for (int64_t g = 0; g < group; ++g) {
            const T* head = q.data + rows[r].q_row * q.row_stride + (h * group + g) * q.head_stride;
            QueryElement<PAIRS>* vector = query + (r * group + g) * elements;
            if constexpr (PAIRS) {
                std::memcpy(vector, head, head_dim * sizeof(T));  // pairs as stored; scale after the sums
            } else {
                for (int64_t j = 0; j < head_dim; ++j) vector[j] = load(head, j) * scale;
            }
        }
    }
}

template <bool PAIRS>
QueryElement<PAIRS>* queries_in(CausalScratch& s) {
    if constexpr (PAIRS) {
        return s.query_pairs.data();
    } else {
        return s.query_floats.data();
    }
}

// The `count` rows of an item (positions ascending), KV head h; leaves each vector's unnormalised
// sums, running max and running sum in the scratch. A step's rows that read the same blocks (all
// rows of one sequence; decodes of sequences sharing a cached prefix) form a run that shares one
// transposed copy of the keys; a row's sums are the same whichever run it is in.
template <typename T, bool PAIRS>
void attend_rows(const Row* rows, int64_t count, int64_t shift, const PagedKV<T>& kv, int64_t h, int64_t group,
                 float scale, CausalScratch& s) {
    const int64_t head_dim = kv.head_dim, elements = PAIRS ? head_dim / 2 : head_dim;
    const int64_t slot_stride = kv.num_kv_heads * head_dim;
    const int64_t vectors = count * group;
    std::fill(s.acc.begin(), s.acc.begin() + vectors * head_dim, 0.f);
    std::fill(s.running_max.begin(), s.running_max.begin() + vectors, -std::numeric_limits<float>::infinity());
    std::fill(s.running_sum.begin(), s.running_sum.begin() + vectors, 0.f);
    const T* key_of[STEP];
    const float* value_rows[STEP];
    float* key_t = s.key_t.data();  // the step's two transposed tiles, one after the other
    const int64_t end = rows[count - 1].position + 1;
    int64_t first_row = 0;  // rows before it end before the step: positions ascend
    for (int64_t start = 0; start < end; start += STEP) {
        while (rows[first_row].position < start) ++first_row;
        for (int64_t run = first_row, run_end; run < count; run = run_end) {
            run_end = run + 1;
            while (run_end < count && same_blocks(rows[run_end - 1], rows[run_end], start, shift)) ++run_end;
            const Row& widest = rows[run_end - 1];  // reads the most keys of the step
            const Blocks blocks{widest.table, shift, (int64_t{1} << shift) - 1};
            const int64_t in_step = std::min(STEP, widest.position + 1 - start);
            for (int64_t t = 0; t < STEP; ++t) {
                if (t >= in_step) {
                    value_rows[t] = s.zeros.data();  // weight 0 in every vector; zeros, never unread memory
                    continue;
                }
                const int64_t offset = blocks.slot(start + t) * slot_stride + h * head_dim;
                key_of[t] = kv.keys + offset;
                if constexpr (std::is_same<T, float>::value) {
                    value_rows[t] = kv.values + offset;
                } else {
                    float* row = s.values.data() + t * head_dim;
                    for (int64_t j = 0; j < head_dim; j += 16) _mm512_storeu_ps(row + j, load16(kv.values + offset + j));
                    value_rows[t] = row;
                }
            }
            {   // Ask for the widest row's next step (keys and values) while this one computes: its rows sit
                // in other blocks, scattered over the pool, where the hardware's stride prefetch does
                // not follow, and a decode, computing little per key, waits on memory otherwise (32 bf16
                // decodes at 1,000 tokens over scattered blocks: 3.1 -> 1.6 ms a layer). Written inline:
                // the same loop as a separate function measured no faster than none at all.
                const int64_t next = start + STEP, next_end = std::min(next + STEP, widest.position + 1);
                const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
                for (int64_t p = next; p < next_end; ++p) {
                    const int64_t offset = blocks.slot(p) * slot_stride + h * head_dim;
                    const char* key = reinterpret_cast<const char*>(kv.keys + offset);
                    const char* value = reinterpret_cast<const char*>(kv.values + offset);
                    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
                        _mm_prefetch(key + byte, _MM_HINT_T0);
                        _mm_prefetch(value + byte, _MM_HINT_T0);
                    }
                }
            }
            load_key_tile<T, PAIRS>(key_of, std::min(TILE, in_step), elements, key_t);
            const bool two_tiles = in_step > TILE;
            if (two_tiles || !PAIRS) {  // float32 scores both tiles at once: zeros where the step has no keys
                load_key_tile<T, PAIRS>(key_of + TILE, std::max<int64_t>(0, in_step - TILE), elements,
                                        key_t + elements * TILE);
            }
            const int64_t run_vectors = run_end * group;
            constexpr int64_t block_size = PAIRS ? PAIR_BLOCK : FLOAT_BLOCK;
            for (int64_t v0 = run * group; v0 < run_vectors; v0 += block_size) {
                const int64_t block = std::min<int64_t>(block_size, run_vectors - v0);
                __m512 low[SCORE_BLOCK], high[SCORE_BLOCK];
                score_step<PAIRS>(block, queries_in<PAIRS>(s) + v0 * elements, elements, key_t, two_tiles, scale, low,
                                  high);
                for (int64_t v = v0; v < v0 + block; ++v) {
                    const int64_t n = std::min(STEP, rows[v / group].position + 1 - start);  // keys of the step it sees
                    const __mmask16 live_low = static_cast<__mmask16>(n >= TILE ? 0xFFFFu : (1u << n) - 1u);
                    const __mmask16 live_high = static_cast<__mmask16>(n > TILE ? (1u << (n - TILE)) - 1u : 0u);
                    softmax_step(low[v - v0], high[v - v0], live_low, live_high, s.running_max[v], s.running_sum[v],
                                  s.acc.data() + v * head_dim, head_dim, s.weights.data() + v * STEP);
                }
            }
            for (int64_t v0 = run * group; v0 < run_vectors; v0 += VALUE_BLOCK) {
                float* acc = s.acc.data() + v0 * head_dim;
                const float* weights = s.weights.data() + v0 * STEP;
                with_block<VALUE_BLOCK>(std::min<int64_t>(VALUE_BLOCK, run_vectors - v0), [&](auto nv) {
                    value_columns<decltype(nv)::value>(acc, head_dim, weights, value_rows);
                });
            }
        }
    }
}
#endif

// Work items of up to ROWS rows, positions ascending. A prefill chunk's rows go ROWS at a time; the
// decodes (one row each) of sequences whose tables start with the same block go together, so that
// the keys of the prefix they share are transposed once for all of them.
std::vector<int64_t> make_items(const int64_t* query_start, const int64_t* seq_lens, int64_t num_seqs,
                                const int64_t* tables, int64_t table_stride, std::vector<Row>& rows) {
    std::vector<int64_t> item_start;  // item k: rows[item_start[k] .. item_start[k + 1])
    std::vector<std::pair<int64_t, int64_t>> decodes;  // (first block id, sequence)
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t query_len = query_start[i + 1] - query_start[i];
        const int64_t* table = tables + i * table_stride;
        if (query_len == 1) {
            decodes.emplace_back(table[0], i);
            continue;
        }
        for (int64_t r0 = query_start[i]; r0 < query_start[i + 1]; r0 += ROWS) {
            item_start.push_back(static_cast<int64_t>(rows.size()));
            for (int64_t r = r0; r < std::min(r0 + ROWS, query_start[i + 1]); ++r) {
                rows.push_back({table, seq_lens[i] - query_len + (r - query_start[i]), r});
            }
        }
    }
    std::stable_sort(decodes.begin(), decodes.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t d = 0; d < decodes.size();) {
        item_start.push_back(static_cast<int64_t>(rows.size()));
        const size_t first = d;
        for (; d < decodes.size() && d - first < ROWS && decodes[d].first == decodes[first].first; ++d) {
            const int64_t i = decodes[d].second;
            rows.push_back({tables + i * table_stride, seq_lens[i] - 1, query_start[i]});
        }
        std::sort(rows.begin() + item_start.back(), rows.end(),
                  [](const Row& a, const Row& b) { return a.position < b.position; });
    }
    item_start.push_back(static_cast<int64_t>(rows.size()));
    return item_start;
}

}  // namespace

template <typename T>
void causal_kernel(const Queries<T>& q, const PagedKV<T>& kv, const int64_t* query_start, const int64_t* seq_lens,
                   int64_t num_seqs, float scale, T* out) {
    const int64_t num_kv_heads = kv.num_kv_heads, head_dim = kv.head_dim;
    const int64_t group = q.num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;
    const int64_t shift = log2_exact(kv.block_size);
    const bool vectorized = VECTOR_PATH && head_dim % 16 == 0;
    const bool pairs = bf16_dot_for<T>() && head_dim % 32 == 0;
    std::vector<Row> rows;
    const std::vector<int64_t> item_start = make_items(query_start, seq_lens, num_seqs, kv.tables, kv.table_stride, rows);
    const int64_t out_row_stride = q.num_heads * head_dim;
    // Item k: rows of item k / num_kv_heads, KV head k % num_kv_heads.
    auto attend_item = [&](int64_t k, Scratch& row_scratch, CausalScratch& s) {
        const int64_t item = k / num_kv_heads, h = k % num_kv_heads;
        const Row* item_rows = rows.data() + item_start[item];
        const int64_t count = item_start[item + 1] - item_start[item];
        auto out_of = [&](const Row& row) { return out + row.q_row * out_row_stride + h * group * head_dim; };
#if defined(__AVX512F__)
        if (vectorized) {
            if (pairs) {
                load_queries<T, true>(q, item_rows, count, h, group, head_dim, scale, queries_in<true>(s));
                attend_rows<T, true>(item_rows, count, shift, kv, h, group, scale, s);
            } else {
                load_queries<T, false>(q, item_rows, count, h, group, head_dim, scale, queries_in<false>(s));
                attend_rows<T, false>(item_rows, count, shift, kv, h, group, scale, s);
            }
            for (int64_t r = 0; r < count; ++r) {
                finish(s.acc.data() + r * group * head_dim, s.running_sum.data() + r * group, group, head_dim,
                       out_of(item_rows[r]));
            }
            return;
        }
#endif
        // Portable path (no AVX-512, or head_dim not a multiple of 16): a row at a time.
        Scratch& one = row_scratch;
        for (int64_t r = 0; r < count; ++r) {
            const Row& row = item_rows[r];
            const Blocks blocks{row.table, shift, kv.block_size - 1};
            load_query(q.data + row.q_row * q.row_stride, q.head_stride, h, group, head_dim, scale, one.query.data());
            attend_row(one.query.data(), 0, row.position + 1, blocks, kv.keys, kv.values, slot_stride, h, group,
                       head_dim, one.scores.data(), one.running_max.data(), one.running_sum.data(), one.acc.data());
            finish(one.acc.data(), one.running_sum.data(), group, head_dim, out_of(row));
        }
    };
    const int64_t num_items = static_cast<int64_t>(item_start.size() - 1) * num_kv_heads;
    // Item k goes to worker k mod workers: later rows read more keys, so their cost is dealt out evenly.
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
        Scratch row_scratch(group, head_dim);
        CausalScratch causal_scratch(group, head_dim);
        for (int64_t w = begin; w < end; ++w) {
            for (int64_t k = w; k < num_items; k += workers) attend_item(k, row_scratch, causal_scratch);
        }
    });
}

template void causal_kernel<float>(const Queries<float>&, const PagedKV<float>&, const int64_t*, const int64_t*,
                                   int64_t, float, float*);
template void causal_kernel<at::BFloat16>(const Queries<at::BFloat16>&, const PagedKV<at::BFloat16>&, const int64_t*,
                                          const int64_t*, int64_t, float, at::BFloat16*);

}  // namespace prefixserve
