// Causal attention of every row of a step, read in place from the paged cache: a row at position p
// attends to keys [0, p + 1), or with a sliding window of w keys to [first, p + 1), first = max(0, p + 1 - w);
// with a soft cap c (Gemma 2) each score s becomes c tanh(s / c) before the softmax.
// Every row of every step, prefill chunks and decodes, float32 and bf16 (model/attention/compiled.py: an engine
// whose pool the kernel takes calls nothing else).
//
// Written once over simd.h and compiled once per CPU variant (W float32 lanes: 16 on AVX-512, 8 on
// AVX2, 4 on NEON and portable). A work item is up to ROWS consecutive rows of one sequence and one
// KV head: ROWS x group query vectors. Keys go by in steps of STEP = 32 positions aligned to
// multiples of 32 (absolute positions), each step TILES = 32 / W tiles of W keys:
//
//   key tile, transposed in registers     key_t[c] lane k = element c of key k (a bf16 pair, or a float)
//   a vector's W scores per tile          sum over c of q[c] * key_t[c]: bf16 pairs (AVX512_BF16) in
//                                         CHAINS running sums (c mod CHAINS) added in a fixed tree;
//                                         floats in one running sum, c in turn. One register either way
//   online softmax step over 32 scores    running max and sum, float32
//   values                                acc += w[k] * value[k] for k = 0 .. 31 in turn, float32
//
// Each vector's sums are the same operations in the same order whatever other rows share its item:
// a decode (1 row), a prefill chunk, wherever the chunk starts. A row's bits are its own, so a
// cache hit, a different batch or another chunking gives the same tokens (tests/test_model_kernels.py).
// Vectors are computed in blocks (PAIR_BLOCK, FLOAT_BLOCK, VALUE_BLOCK, sized to each variant's
// registers) only so that one load of a key or value register serves several of them; blocking
// changes no vector's order of operations. head_dim not a multiple of W takes the scalar path of
// attention_tiles.h, a row at a time.
//
// A sliding window changes only which lanes are live: an item's steps begin at the step holding its
// lowest row's first key (keys below it are never read: their blocks may be gone), and a row's lanes
// below its own first key are masked like those past its position. A step in which a row has no live
// lane leaves its sums exactly as they were (weights 0, maximum unchanged), so a row's bits are still its own.
#include "amx_tiles.h"
#include "attention_tiles.h"
#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <optional>

namespace prefixserve {
namespace {

using simd::vf;
using simd::W;

constexpr int64_t ROWS = 32;  // rows of one sequence a work item takes
constexpr int64_t STEP = 32;  // keys per online-softmax step
constexpr int64_t TILE = W;   // keys per tile: one register of scores
constexpr int TILES = STEP / W;
static_assert(STEP % W == 0, "a step is a whole number of tiles");

// Register blocking per variant: vectors scored together (FLOAT_BLOCK x FLOAT_PASS accumulators),
// tiles each float32 scoring pass holds, vectors whose values are summed together (VALUE_BLOCK x
// VALUE_WIDTH accumulators of W dims). AVX-512 and NEON have 32 registers, AVX2 16.
#if defined(PREFIXSERVE_SIMD_AVX512)
constexpr int FLOAT_BLOCK = 8, FLOAT_PASS = 2, VALUE_BLOCK = 6, VALUE_WIDTH = 4;
#elif defined(PREFIXSERVE_SIMD_NEON)
constexpr int FLOAT_BLOCK = 4, FLOAT_PASS = 4, VALUE_BLOCK = 4, VALUE_WIDTH = 4;
#elif defined(PREFIXSERVE_SIMD_AVX2)
constexpr int FLOAT_BLOCK = 4, FLOAT_PASS = 2, VALUE_BLOCK = 2, VALUE_WIDTH = 4;
#else  // portable: 4-lane vectors, 16 registers on baseline x86-64
constexpr int FLOAT_BLOCK = 4, FLOAT_PASS = 2, VALUE_BLOCK = 2, VALUE_WIDTH = 4;
#endif
static_assert(TILES % FLOAT_PASS == 0, "scoring passes cover the step's tiles");

// bf16 scores by the bf16 dot-product instruction (AVX512_BF16): lane i of a chunk sums the pair
// (2i, 2i + 1); used when head_dim is a multiple of 32.
template <typename T>
constexpr bool bf16_pairs_for() {
#if defined(__AVX512BF16__)
    return std::is_same<T, at::BFloat16>::value;
#else
    return false;
#endif
}

// bf16 scores and value sums on AMX tiles (amx_tiles.h), where the variant is built with them.
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define PREFIXSERVE_AMX 1
#else
#define PREFIXSERVE_AMX 0
#endif
template <typename T>
constexpr bool amx_for() {
    return PREFIXSERVE_AMX && std::is_same<T, at::BFloat16>::value;
}

// A query row: its sequence's block table, its position (it reads keys [first, position + 1)), its row of q.
struct Row {
    const int64_t* table;
    int64_t position, q_row, first;
};

// The first key a row at `position` reads: 0, or the start of its sliding window (window > 0).
inline int64_t first_key(int64_t position, int64_t window) {
    return window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0;
}

// x in lanes [lo, hi) of a tile, `fill` in the others.
inline vf keep_range(vf x, int64_t lo, int64_t hi, vf fill) {
    const vf upper = simd::keep_first(x, hi, fill);
    return lo > 0 ? simd::keep_first(fill, lo, upper) : upper;
}

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
    std::vector<uint32_t> query_pairs;  // per vector: bf16 pairs as stored (PAIRS); 16 vectors of slack
    std::vector<float> query_floats;    // or q * scale as floats
    std::vector<float> acc, running_max, running_sum, weights, key_t, values, zeros;
    // AMX: a block's scores and value sums, its bf16 weights, the step's values interleaved, a zero row
    std::vector<float> block_scores, block_out;
    std::vector<uint16_t> block_weights, vnni, zero_row;
    CausalScratch(int64_t group, int64_t head_dim)
        : query_pairs((ROWS * group + 16) * head_dim / 2), query_floats(ROWS * group * head_dim),
          acc(ROWS * group * head_dim), running_max(ROWS * group), running_sum(ROWS * group),
          weights(ROWS * group * STEP), key_t(head_dim * STEP), values(STEP * head_dim), zeros(head_dim, 0.f),
          block_scores(16 * STEP), block_out(16 * head_dim), block_weights(16 * STEP), vnni(head_dim * STEP),
          zero_row(head_dim, 0) {}
};

#if defined(__AVX512BF16__)
constexpr int CHAINS = 4;        // bf16: running sums per score, enough independent chains for one decode row
constexpr int PAIR_BLOCK = 6;    // bf16 vectors scored together, a tile at a time: 6 x CHAINS accumulators
#else
constexpr int PAIR_BLOCK = 1;
#endif
constexpr int SCORE_BLOCK = std::max(PAIR_BLOCK, FLOAT_BLOCK);

// Keys as 32-bit elements: bf16 pairs (PAIRS: the bf16 dot-product instruction multiplies a pair
// per lane) or floats. `elements` per key, a multiple of 16.
template <typename T, bool PAIRS>
inline vf load_elements(const T* key, int64_t e) {
    if constexpr (PAIRS) {  // the raw bits of W pairs, never converted
        return simd::load(reinterpret_cast<const float*>(reinterpret_cast<const uint32_t*>(key) + e));
    } else {
        return simd::load(key + e);
    }
}

// n keys of a tile (zeros for the rest), transposed: key_t[c * W + k] = element c of key k.
template <typename T, bool PAIRS>
inline void load_key_tile(const T* const* key_of, int64_t n, int64_t elements, float* key_t) {
    for (int64_t e0 = 0; e0 < elements; e0 += W) {
        vf r[W];
        for (int64_t k = 0; k < W; ++k) r[k] = k < n ? load_elements<T, PAIRS>(key_of[k], e0) : simd::zero();
        simd::transpose(r);
        for (int64_t c = 0; c < W; ++c) simd::store(key_t + (e0 + c) * W, r[c]);
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

// bf16 scores of NV vectors (pairs [NV][elements]) against one key tile, times scale (AVX512_BF16).
template <int NV>
inline void score_pairs(const uint32_t* query, int64_t elements, const float* key_t, float scale, vf* scores) {
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
#else
    (void)query, (void)elements, (void)key_t, (void)scale, (void)scores;
#endif
}

// float32 scores of NV vectors (q * scale, [NV][elements]) against the step's TILES tiles, one running
// sum each, FLOAT_PASS tiles a pass: per element, FLOAT_PASS key registers serve FLOAT_PASS x NV
// multiply-adds, and as many independent sums keep the multiply-add units busy (on AVX-512 a block of
// four vectors' sums measured 1.5x slower than eight: latency-bound). scores[v * TILES + t].
// Not inlined: inlined into attend_rows it measured 6-8% slower over the whole prefill (registers).
template <int NV>
__attribute__((noinline)) void score_floats(const float* query, int64_t elements, const float* key_t, vf* scores) {
    for (int t0 = 0; t0 < TILES; t0 += FLOAT_PASS) {
        vf sum[NV][FLOAT_PASS];
        for (int v = 0; v < NV; ++v) {
            for (int p = 0; p < FLOAT_PASS; ++p) sum[v][p] = simd::zero();
        }
        const float* tiles = key_t + t0 * elements * TILE;
        for (int64_t c = 0; c < elements; ++c) {
            vf key[FLOAT_PASS];
            for (int p = 0; p < FLOAT_PASS; ++p) key[p] = simd::load(tiles + (p * elements + c) * TILE);
            for (int v = 0; v < NV; ++v) {
                const vf q = simd::set1(query[v * elements + c]);
                for (int p = 0; p < FLOAT_PASS; ++p) sum[v][p] = simd::fmadd(q, key[p], sum[v][p]);
            }
        }
        for (int v = 0; v < NV; ++v) {
            for (int p = 0; p < FLOAT_PASS; ++p) scores[v * TILES + t0 + p] = sum[v][p];
        }
    }
}

// A block of `count` vectors' scores for the step, scores[v * TILES + t] for keys t W .. t W + W - 1;
// tiles past `live_tiles` hold what the caller masks out.
template <bool PAIRS>
inline void score_step(int64_t count, const QueryElement<PAIRS>* query, int64_t elements, const float* key_t,
                       int64_t live_tiles, float scale, vf* scores) {
    if constexpr (PAIRS) {
        with_block<PAIR_BLOCK>(count, [&](auto nv) {
            constexpr int NV = decltype(nv)::value;
            for (int t = 0; t < TILES; ++t) {
                vf tile[NV];
                if (t < live_tiles) {
                    score_pairs<NV>(query, elements, key_t + t * elements * TILE, scale, tile);
                } else {
                    std::fill(tile, tile + NV, simd::zero());
                }
                for (int v = 0; v < NV; ++v) scores[v * TILES + t] = tile[v];
            }
        });
    } else {
        with_block<FLOAT_BLOCK>(count, [&](auto nv) { score_floats<decltype(nv)::value>(query, elements, key_t, scores); });
    }
}

// Gemma 2's soft-capped scores, softcap tanh(s / softcap), as transformers computes them; softcap 0: s.
inline vf capped(vf scores, float softcap) {
    if (softcap == 0.f) return scores;
    const vf cap = simd::set1(softcap);
    return simd::mul(simd::tanh(simd::div(scores, cap)), cap);
}

// One step's online softmax for one vector, its STEP scores in TILES registers of which the first n
// lanes are live: they update the running max and sum, the sums so far are rescaled when the max
// grows, and the step's weights (0 in dead lanes) go to `weights` for the value sums.
inline void softmax_step(const vf* scores, int64_t lo, int64_t n, float softcap, float& running_max, float& running_sum,
                         float* acc, int64_t head_dim, float* weights) {
    const vf none = simd::set1(-std::numeric_limits<float>::infinity());
    vf live[TILES];
    for (int t = 0; t < TILES; ++t) live[t] = keep_range(capped(scores[t], softcap), lo - t * TILE, n - t * TILE, none);
    vf top_lanes = live[0];
    for (int t = 1; t < TILES; ++t) top_lanes = simd::max(top_lanes, live[t]);
    const float new_max = std::max(running_max, simd::max_lanes(top_lanes));
    const float correction = running_max == new_max ? 1.f : simd::first_lane(simd::exp(simd::set1(running_max - new_max)));
    const vf top = simd::set1(new_max);
    vf p[TILES];
    for (int t = 0; t < TILES; ++t) {
        p[t] = keep_range(simd::exp(simd::sub(live[t], top)), lo - t * TILE, n - t * TILE, simd::zero());
        simd::store(weights + t * TILE, p[t]);
    }
    for (int width = TILES / 2; width > 0; width /= 2) {  // the tiles' weights in a fixed tree
        for (int t = 0; t < width; ++t) p[t] = simd::add(p[t], p[t + width]);
    }
    running_sum = running_sum * correction + simd::sum_lanes(p[0]);
    running_max = new_max;
    if (correction != 1.f) {
        const vf c = simd::set1(correction);
        for (int64_t j = 0; j < head_dim; j += W) simd::store(acc + j, simd::mul(simd::load(acc + j), c));
    }
}

// acc[v][j .. j + WIDTH W) += sum over t of weights[v][t] * value_rows[t][j ..], t = 0 .. STEP - 1 in turn.
template <int NV, int WIDTH>
inline void value_block(float* acc, int64_t head_dim, const float* weights, const float* const* value_rows, int64_t j) {
    vf a[NV][WIDTH];
    for (int v = 0; v < NV; ++v) {
        for (int m = 0; m < WIDTH; ++m) a[v][m] = simd::load(acc + v * head_dim + j + W * m);
    }
    for (int t = 0; t < STEP; ++t) {
        vf value[WIDTH];
        for (int m = 0; m < WIDTH; ++m) value[m] = simd::load(value_rows[t] + j + W * m);
        for (int v = 0; v < NV; ++v) {
            const vf w = simd::set1(weights[v * STEP + t]);
            for (int m = 0; m < WIDTH; ++m) a[v][m] = simd::fmadd(w, value[m], a[v][m]);
        }
    }
    for (int v = 0; v < NV; ++v) {
        for (int m = 0; m < WIDTH; ++m) simd::store(acc + v * head_dim + j + W * m, a[v][m]);
    }
}

template <int NV>
inline void value_columns(float* acc, int64_t head_dim, const float* weights, const float* const* value_rows) {
    int64_t j = 0;
    for (; j + W * VALUE_WIDTH <= head_dim; j += W * VALUE_WIDTH) {
        value_block<NV, VALUE_WIDTH>(acc, head_dim, weights, value_rows, j);
    }
    const int64_t rest = (head_dim - j) / W;  // registers left, fewer than VALUE_WIDTH
    if (rest > 0) {
        with_block<VALUE_WIDTH - 1>(rest, [&](auto width) {
            value_block<NV, decltype(width)::value>(acc, head_dim, weights, value_rows, j);
        });
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
                for (int64_t j = 0; j < head_dim; ++j) vector[j] = load_scalar(head, j) * scale;
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

// Ask for the widest row's next step (keys and values) while this one computes: its rows sit in
// other blocks, scattered over the pool, where the hardware's stride prefetch does not follow, and a
// decode, computing little per key, waits on memory otherwise (AVX-512, 32 bf16 decodes at 1,000
// tokens over scattered blocks: 3.1 -> 1.6 ms a layer).
template <typename T>
inline void prefetch_step(const PagedKV<T>& kv, const Blocks& blocks, int64_t first, int64_t last, int64_t slot_stride,
                          int64_t h) {
    const int64_t row_bytes = kv.head_dim * static_cast<int64_t>(sizeof(T));
    for (int64_t p = first; p < last; ++p) {
        const int64_t offset = blocks.slot(p) * slot_stride + h * kv.head_dim;
        const char* key = reinterpret_cast<const char*>(kv.keys + offset);
        const char* value = reinterpret_cast<const char*>(kv.values + offset);
        for (int64_t byte = 0; byte < row_bytes; byte += 64) {
            simd::prefetch(key + byte);
            simd::prefetch(value + byte);
        }
    }
}

// A key row of zeros in T (float: the zeros row; bf16: the zero row of bits), for lanes no row reads.
template <typename T>
inline const T* zero_key_of(const CausalScratch& s) {
    if constexpr (std::is_same<T, float>::value) {
        return s.zeros.data();
    } else {
        return reinterpret_cast<const T*>(s.zero_row.data());
    }
}

// Zeroed sums, running maxima at -inf, for an item's `vectors` query vectors.
inline void reset_sums(CausalScratch& s, int64_t vectors, int64_t head_dim) {
    std::fill(s.acc.begin(), s.acc.begin() + vectors * head_dim, 0.f);
    std::fill(s.running_max.begin(), s.running_max.begin() + vectors, -std::numeric_limits<float>::infinity());
    std::fill(s.running_sum.begin(), s.running_sum.begin() + vectors, 0.f);
}

// The item's 32-key steps and, per step, its runs: rows (positions ascending) that read the same
// blocks for the step's keys (all rows of one sequence; decodes of sequences sharing a cached
// prefix), which share one transposed copy of the keys. visit(start, run, run_end, blocks, in_step,
// widest_end): rows [run, run_end) read keys from `start`; the widest of them reads in_step of the
// step's keys, through `blocks`, and keys up to widest_end in all.
template <typename Visit>
inline void for_each_step_run(const Row* rows, int64_t count, int64_t shift, Visit&& visit) {
    const int64_t end = rows[count - 1].position + 1;
    int64_t first_row = 0;  // rows before it end before the step: positions ascend
    for (int64_t start = rows[0].first / STEP * STEP; start < end; start += STEP) {  // rows[0] reads the lowest key
        while (rows[first_row].position < start) ++first_row;
        for (int64_t run = first_row, run_end; run < count; run = run_end) {
            run_end = run + 1;
            while (run_end < count && same_blocks(rows[run_end - 1], rows[run_end], start, shift)) ++run_end;
            const Row& widest = rows[run_end - 1];  // reads the most keys of the step
            const Blocks blocks{widest.table, shift, (int64_t{1} << shift) - 1};
            visit(start, run, run_end, blocks, std::min(STEP, widest.position + 1 - start), widest.position + 1);
        }
    }
}

// The `count` rows of an item (positions ascending), KV head h; leaves each vector's unnormalised
// sums, running max and running sum in the scratch. A step's rows that read the same blocks (all
// rows of one sequence; decodes of sequences sharing a cached prefix) form a run that shares one
// transposed copy of the keys; a row's sums are the same whichever run it is in.
template <typename T, bool PAIRS>
void attend_rows(const Row* rows, int64_t count, int64_t shift, const PagedKV<T>& kv, int64_t h, int64_t group,
                 float scale, float softcap, CausalScratch& s) {
    const int64_t head_dim = kv.head_dim, elements = PAIRS ? head_dim / 2 : head_dim;
    const int64_t slot_stride = kv.num_kv_heads * head_dim;
    reset_sums(s, count * group, head_dim);
    const T* key_of[STEP];
    const float* value_rows[STEP];
    float* key_t = s.key_t.data();  // the step's tiles, transposed, one after the other
    const T* zero_key = zero_key_of<T>(s);
    for_each_step_run(rows, count, shift, [&](int64_t start, int64_t run, int64_t run_end, const Blocks& blocks,
                                              int64_t in_step, int64_t widest_end) {
        for (int64_t t = 0; t < STEP; ++t) {
            if (t >= in_step || start + t < rows[0].first) {  // past every row, or below every row's window
                key_of[t] = zero_key;
                value_rows[t] = s.zeros.data();  // weight 0 in every vector; zeros, never unread memory
                continue;
            }
            const int64_t offset = blocks.slot(start + t) * slot_stride + h * head_dim;
            key_of[t] = kv.keys + offset;
            if constexpr (std::is_same<T, float>::value) {
                value_rows[t] = kv.values + offset;
            } else {
                float* row = s.values.data() + t * head_dim;
                for (int64_t j = 0; j < head_dim; j += W) simd::store(row + j, simd::load(kv.values + offset + j));
                value_rows[t] = row;
            }
        }
        prefetch_step(kv, blocks, start + STEP, std::min(start + 2 * STEP, widest_end), slot_stride, h);
        const int64_t live_tiles = (in_step + TILE - 1) / TILE;
        for (int64_t t = 0; t < live_tiles; ++t) {  // tiles past them are masked out of every score
            load_key_tile<T, PAIRS>(key_of + t * TILE, std::min(TILE, in_step - t * TILE), elements,
                                    key_t + t * elements * TILE);
        }
        const int64_t run_vectors = run_end * group;
        constexpr int64_t block_size = PAIRS ? PAIR_BLOCK : FLOAT_BLOCK;
        for (int64_t v0 = run * group; v0 < run_vectors; v0 += block_size) {
            const int64_t block = std::min<int64_t>(block_size, run_vectors - v0);
            vf scores[SCORE_BLOCK * TILES];
            score_step<PAIRS>(block, queries_in<PAIRS>(s) + v0 * elements, elements, key_t, live_tiles, scale,
                              scores);
            for (int64_t v = v0; v < v0 + block; ++v) {
                const Row& row = rows[v / group];
                const int64_t n = std::min(STEP, row.position + 1 - start);  // keys of the step it sees: [lo, n)
                softmax_step(scores + (v - v0) * TILES, row.first - start, n, softcap, s.running_max[v], s.running_sum[v],
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
    });
}

#if PREFIXSERVE_AMX
// One step's online softmax for one vector on AMX: as softmax_step, its weights rounded to bf16 into
// `weights` (the A operand of the value tile) and the rounded weights summed.
inline void softmax_step_bf16(const float* scores, int64_t lo, int64_t n, float scale, float softcap,
                              float& running_max, float& running_sum, float* acc, int64_t head_dim, uint16_t* weights) {
    const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 low = keep_range(capped(_mm512_mul_ps(_mm512_loadu_ps(scores), _mm512_set1_ps(scale)), softcap), lo,
                                  n, none);
    const __m512 high = keep_range(capped(_mm512_mul_ps(_mm512_loadu_ps(scores + 16), _mm512_set1_ps(scale)), softcap),
                                   lo - 16, n - 16, none);
    const float new_max = std::max(running_max, _mm512_reduce_max_ps(_mm512_max_ps(low, high)));
    const float correction = running_max == new_max ? 1.f : simd::first_lane(simd::exp(simd::set1(running_max - new_max)));
    const __m512 top = _mm512_set1_ps(new_max);
    const __m512 p_low = amx::round_to_bf16(keep_range(simd::exp(_mm512_sub_ps(low, top)), lo, n, simd::zero()),
                                            weights);
    const __m512 p_high = amx::round_to_bf16(
        keep_range(simd::exp(_mm512_sub_ps(high, top)), lo - 16, n - 16, simd::zero()), weights + 16);
    running_sum = running_sum * correction + simd::sum_lanes(_mm512_add_ps(p_low, p_high));
    running_max = new_max;
    if (correction != 1.f) {
        const __m512 c = _mm512_set1_ps(correction);
        for (int64_t j = 0; j < head_dim; j += 16) _mm512_storeu_ps(acc + j, _mm512_mul_ps(_mm512_loadu_ps(acc + j), c));
    }
}

// attend_rows on AMX tiles (bf16, head_dim a multiple of 32): the same steps, runs and shared key
// tiles; scores and value sums by tile products, 16 vectors a block.
template <typename T>
void attend_rows_amx(const Row* rows, int64_t count, int64_t shift, const PagedKV<T>& kv, int64_t h, int64_t group,
                     float scale, float softcap, CausalScratch& s) {
    const int64_t head_dim = kv.head_dim, elements = head_dim / 2;
    const int64_t slot_stride = kv.num_kv_heads * head_dim;
    reset_sums(s, count * group, head_dim);
    const T* key_of[STEP];
    const uint16_t* value_rows[STEP];
    const uint16_t* values = reinterpret_cast<const uint16_t*>(kv.values);
    float* key_t = s.key_t.data();
    for_each_step_run(rows, count, shift, [&](int64_t start, int64_t run, int64_t run_end, const Blocks& blocks,
                                              int64_t in_step, int64_t widest_end) {
        for (int64_t t = 0; t < STEP; ++t) {
            if (t >= in_step || start + t < rows[0].first) {  // past every row, or below every row's window
                key_of[t] = reinterpret_cast<const T*>(s.zero_row.data());
                value_rows[t] = s.zero_row.data();
                continue;
            }
            const int64_t offset = blocks.slot(start + t) * slot_stride + h * head_dim;
            key_of[t] = kv.keys + offset;
            value_rows[t] = values + offset;
        }
        prefetch_step(kv, blocks, start + STEP, std::min(start + 2 * STEP, widest_end), slot_stride, h);
        load_key_tile<T, true>(key_of, std::min(TILE, in_step), elements, key_t);
        load_key_tile<T, true>(key_of + TILE, std::max<int64_t>(0, in_step - TILE), elements, key_t + elements * TILE);
        amx::interleave_values(value_rows, head_dim, s.vnni.data());
        for (int64_t v0 = run * group; v0 < run_end * group; v0 += amx::ROWS) {
            const int64_t block = std::min<int64_t>(amx::ROWS, run_end * group - v0);
            amx::score_block(s.query_pairs.data() + v0 * elements, elements * 4, key_t, elements,
                             s.block_scores.data());
            for (int64_t v = v0; v < v0 + block; ++v) {
                const Row& row = rows[v / group];
                const int64_t n = std::min(STEP, row.position + 1 - start);
                softmax_step_bf16(s.block_scores.data() + (v - v0) * STEP, row.first - start, n, scale, softcap, s.running_max[v],
                                  s.running_sum[v], s.acc.data() + v * head_dim, head_dim,
                                  s.block_weights.data() + (v - v0) * STEP);
            }
            amx::value_block(s.block_weights.data(), s.vnni.data(), head_dim, s.block_out.data());
            for (int64_t v = v0; v < v0 + block; ++v) {
                float* acc = s.acc.data() + v * head_dim;
                const float* out = s.block_out.data() + (v - v0) * head_dim;
                for (int64_t j = 0; j < head_dim; j += 16) {
                    _mm512_storeu_ps(acc + j, _mm512_add_ps(_mm512_loadu_ps(acc + j), _mm512_loadu_ps(out + j)));
                }
            }
        }
    });
}
#endif

// Work items of up to ROWS rows, positions ascending. A prefill chunk's rows go ROWS at a time; the
// decodes (one row each) of sequences whose tables start with the same block go together, so that
// the keys of the prefix they share are transposed once for all of them (without a window).
//
// Decodes sharing a prefix go in smaller items when the step would otherwise have too few to share
// out: 32 decodes on one system prompt with 3 KV heads are 3 items, 2 for one thread and 1 for the
// other of 2; in items of 8 rows they are 12, 6 each. Items are halved down to MIN_SHARED_ROWS rows
// until there are at least ITEMS_PER_THREAD x threads (items x KV heads). A row's sums never depend
// on the other rows of its item, so this changes no bits, only who computes them.
constexpr int64_t MIN_SHARED_ROWS = 4;
constexpr int64_t ITEMS_PER_THREAD = 4;

std::vector<int64_t> make_items(const int64_t* query_start, const int64_t* seq_lens, int64_t num_seqs,
                                const int64_t* tables, int64_t table_stride, int64_t window, int64_t num_kv_heads,
                                int64_t num_threads, std::vector<Row>& rows) {
    std::vector<int64_t> item_start;  // item k: rows[item_start[k] .. item_start[k + 1])
    std::vector<std::pair<int64_t, int64_t>> decodes;  // (first block id, sequence)
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t query_len = query_start[i + 1] - query_start[i];
        const int64_t* table = tables + i * table_stride;
        if (query_len == 1) {
            // Sequences sharing their first block share an item. With a window no two do: a table's entries
            // below its own window may be released (-1), and another row's run could read through them.
            decodes.emplace_back(window > 0 ? -1 - i : table[0], i);
            continue;
        }
        for (int64_t r0 = query_start[i]; r0 < query_start[i + 1]; r0 += ROWS) {
            item_start.push_back(static_cast<int64_t>(rows.size()));
            for (int64_t r = r0; r < std::min(r0 + ROWS, query_start[i + 1]); ++r) {
                const int64_t position = seq_lens[i] - query_len + (r - query_start[i]);
                rows.push_back({table, position, r, first_key(position, window)});
            }
        }
    }
    std::stable_sort(decodes.begin(), decodes.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<int64_t> run_lengths;  // decodes sharing a first block, in order
    for (size_t d = 0; d < decodes.size();) {
        size_t end = d;
        while (end < decodes.size() && decodes[end].first == decodes[d].first) ++end;
        run_lengths.push_back(static_cast<int64_t>(end - d));
        d = end;
    }
    auto decode_items = [&](int64_t rows_per_item) {
        int64_t count = 0;
        for (int64_t length : run_lengths) count += (length + rows_per_item - 1) / rows_per_item;
        return count;
    };
    const int64_t prefill_items = static_cast<int64_t>(item_start.size());
    int64_t rows_per_item = ROWS;
    while (rows_per_item / 2 >= MIN_SHARED_ROWS &&
           (prefill_items + decode_items(rows_per_item)) * num_kv_heads < ITEMS_PER_THREAD * num_threads) {
        rows_per_item /= 2;
    }
    size_t d = 0;
    for (int64_t length : run_lengths) {
        const int64_t parts = (length + rows_per_item - 1) / rows_per_item;
        for (int64_t part = 0; part < parts; ++part) {  // even parts: lengths differ by one at most
            item_start.push_back(static_cast<int64_t>(rows.size()));
            const int64_t part_rows = length / parts + (part < length % parts ? 1 : 0);
            for (int64_t j = 0; j < part_rows; ++j, ++d) {
                const int64_t i = decodes[d].second;
                rows.push_back({tables + i * table_stride, seq_lens[i] - 1, query_start[i],
                                first_key(seq_lens[i] - 1, window)});
            }
            std::sort(rows.begin() + item_start.back(), rows.end(),
                      [](const Row& a, const Row& b) { return a.position < b.position; });
        }
    }
    item_start.push_back(static_cast<int64_t>(rows.size()));
    return item_start;
}

}  // namespace

template <typename T>
void causal_kernel(const Queries<T>& q, const PagedKV<T>& kv, const int64_t* query_start, const int64_t* seq_lens,
                   int64_t num_seqs, float scale, int64_t window, float softcap, T* out) {
    const int64_t num_kv_heads = kv.num_kv_heads, head_dim = kv.head_dim;
    const int64_t group = q.num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;
    const int64_t shift = log2_exact(kv.block_size);
    const bool vectorized = head_dim % W == 0;
    const bool pairs = bf16_pairs_for<T>() && head_dim % 32 == 0;
    const bool tiles = amx_for<T>() && head_dim % 32 == 0;
    (void)tiles;  // read only where the variant has AMX
    std::vector<Row> rows;
    const std::vector<int64_t> item_start = make_items(query_start, seq_lens, num_seqs, kv.tables, kv.table_stride,
                                                       window, num_kv_heads, at::get_num_threads(), rows);
    const int64_t out_row_stride = q.num_heads * head_dim;
    // Item k: rows of item k / num_kv_heads, KV head k % num_kv_heads.
    auto attend_item = [&](int64_t k, Scratch& row_scratch, CausalScratch& s) {
        const int64_t item = k / num_kv_heads, h = k % num_kv_heads;
        const Row* item_rows = rows.data() + item_start[item];
        const int64_t count = item_start[item + 1] - item_start[item];
        auto out_of = [&](const Row& row) { return out + row.q_row * out_row_stride + h * group * head_dim; };
        if (vectorized) {
#if PREFIXSERVE_AMX
            if (tiles) {
                load_queries<T, true>(q, item_rows, count, h, group, head_dim, scale, queries_in<true>(s));
                attend_rows_amx<T>(item_rows, count, shift, kv, h, group, scale, softcap, s);
            } else
#endif
            if (pairs) {
                load_queries<T, true>(q, item_rows, count, h, group, head_dim, scale, queries_in<true>(s));
                attend_rows<T, true>(item_rows, count, shift, kv, h, group, scale, softcap, s);
            } else {
                load_queries<T, false>(q, item_rows, count, h, group, head_dim, scale, queries_in<false>(s));
                attend_rows<T, false>(item_rows, count, shift, kv, h, group, scale, softcap, s);
            }
            for (int64_t r = 0; r < count; ++r) {
                finish(s.acc.data() + r * group * head_dim, s.running_sum.data() + r * group, group, head_dim,
                       out_of(item_rows[r]));
            }
            return;
        }
        // The scalar path (head_dim not a multiple of W): a row at a time.
        Scratch& one = row_scratch;
        for (int64_t r = 0; r < count; ++r) {
            const Row& row = item_rows[r];
            const Blocks blocks{row.table, shift, kv.block_size - 1};
            load_query(q.data + row.q_row * q.row_stride, q.head_stride, h, group, head_dim, scale, one.query.data());
            attend_row(one.query.data(), row.first, row.position + 1, blocks, kv.keys, kv.values, slot_stride, h, group,
                       head_dim, softcap, one.scores.data(), one.running_max.data(), one.running_sum.data(),
                       one.acc.data());
            finish(one.acc.data(), one.running_sum.data(), group, head_dim, out_of(row));
        }
    };
    const int64_t num_items = static_cast<int64_t>(item_start.size() - 1) * num_kv_heads;
    // Item k goes to worker k mod workers: later rows read more keys, so their cost is dealt out evenly.
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
        Scratch row_scratch(group, head_dim);
        CausalScratch causal_scratch(group, head_dim);
#if PREFIXSERVE_AMX
        std::optional<amx::AmxTiles> configured;  // this thread's tiles, released when it is done
        if (tiles) configured.emplace();
#endif
        for (int64_t w = begin; w < end; ++w) {
            for (int64_t k = w; k < num_items; k += workers) attend_item(k, row_scratch, causal_scratch);
        }
    });
}

template void causal_kernel<float>(const Queries<float>&, const PagedKV<float>&, const int64_t*, const int64_t*,
                                   int64_t, float, int64_t, float, float*);
template void causal_kernel<at::BFloat16>(const Queries<at::BFloat16>&, const PagedKV<at::BFloat16>&, const int64_t*,
                                          const int64_t*, int64_t, float, int64_t, float, at::BFloat16*);

}  // namespace prefixserve
