// The matmul of a weight kept quantized (quantized.h), in two steps per block of TILE_COLS weight rows:
//
//   1. decode the block's codes to float32 rows in a small buffer (L1-sized: TILE_COLS x cols), once
//      per chunk of ROW_CHUNK input rows: the codes are read from memory once per chunk, the only
//      pass over the weight a decode step makes (4 or 8 times fewer bytes than float32 weights);
//   2. multiply TILE_ROWS input rows by the block in registers: TILE_ROWS x TILE_COLS running sums of
//      W lanes each, one multiply-add per lane and value, then each sum's lanes in a fixed tree (the
//      tile's sums side by side where the vector has room: the same tree, fewer instructions).
//
// A call of at most FUSED_ROWS rows (a decode step) skips the buffer: fused_tile decodes into registers
// and multiplies at once, the same operations in the same order, so the same bits as the two steps.
//
// Every output element is the same sequence of operations wherever its row sits in the call (a tile
// of one row or of TILE_ROWS), so a token's logits never depend on its batch. Against a float32
// matmul of the decoded weights the sums differ in order only.
//
// A float32 weight (bits 32) has nothing to decode: the same tiles read its rows where they lie,
// so a float32 model's rows are batch-invariant by the same construction.
//
// Threads split the weight rows (out_features); each keeps its own decode buffer.
#include "quantized.h"
#include "quantized_codes.h"
#include "quantized_scales.h"

#include "simd.h"

#include <ATen/Parallel.h>

#include <array>
#include <cstring>
#include <utility>
#include <vector>

namespace prefixserve {

using simd::vf;
using simd::W;

namespace {

#if defined(PREFIXSERVE_SIMD_AVX512)
constexpr int TILE_ROWS = 4, TILE_COLS = 4;  // 16 running sums of 32 registers
#elif defined(PREFIXSERVE_SIMD_AVX2)
constexpr int TILE_ROWS = 3, TILE_COLS = 4;  // 12 running sums of 16 registers
#else  // NEON and portable
constexpr int TILE_ROWS = 2, TILE_COLS = 4;
#endif

constexpr int64_t ROW_CHUNK = 64;  // input rows that stay in L2 while a thread decodes its blocks
// Calls of up to this many rows decode in registers, once per TILE_ROWS rows. benchmarks/quantized_matmul.py
// on an AVX-512 EPYC: at 1-4 rows the fused path takes 0.3-0.6x the buffered one's time; at 8 rows they
// are even (decoding twice costs what the buffer costs); at 16 the buffered path is faster.
constexpr int64_t FUSED_ROWS = TILE_ROWS;
// How far ahead (in blocks of TILE_COLS weight rows) a call asks for a float32 weight's rows (tile).
constexpr int64_t PREFETCH_BLOCKS = 2;
// How far ahead a decode step (fused_tile) asks for the codes it reads next, and where it asks for them: L2
// (locality 1, prefetcht2; on AMD it fills L2 as prefetcht1 does). Once the scales' conversion was inlined
// (2026-12-07), the tile decoded fast enough that the stream became the bound, and the old choice of 2 blocks
// into L1 (prefetcht0) starved it. SmolLM2 Q8_0's 1-row matmuls of one token, AVX-512 EPYC, 2 threads
// (benchmarks/quantized_matmul.py-like chain, interleaved): the 30 layers took 7.3 ms that way, 4.8 ms at 8
// blocks into L2; lm_head 1.8 ms, 1.1 ms. 2 blocks into L2: 5.9 ms; 4: 5.3; 16: 5.1; prefetchnta: 6.9.
constexpr int64_t CODE_PREFETCH_BLOCKS = 8;
constexpr int CODE_PREFETCH_LOCALITY = 1;
// Where a float32 weight's next rows go: L2 (locality 2, prefetcht1). Asked into L1 (prefetcht0), the stream
// of 4-8x the bytes pushed out the lines in use: a 1-row matmul of a 512 MB float32 weight on the AVX-512 EPYC,
// 2 threads, read 22-26 GB/s that way, 37-44 into L2 (a C++ loop of the same shape). Locality 1 and 4 blocks
// ahead read the same (within 3%, 2026-12-07).
constexpr int FLOAT_PREFETCH_LOCALITY = 2;
constexpr int64_t PREFETCH_TILES = 4;  // the tiles of a chunk that ask for a float32 weight's next rows

// out[r, c] = the sum of sums[r][c]'s lanes (+ bias[c]): the tree of simd::sum_lanes, a tile's sums side by side.
template <int R, int C>
__attribute__((always_inline)) inline void write_sums(const vf (&sums)[R][C], const float* bias, float* out,
                                                      int64_t out_stride) {
    float totals[R * C];
    simd::sum_lanes_each(reinterpret_cast<const vf(&)[R * C]>(sums), totals);
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            const float sum = totals[r * C + c];
            out[r * out_stride + c] = bias == nullptr ? sum : sum + bias[c];
        }
    }
}

// Weight row n decoded into out [cols], its scales and offsets converted as fused_tile converts them. LEVELS:
// 4-bit codes standing for the weight's levels (IQ4_NL, IQ4_XS), not code - zero_point.
template <int BITS, bool LEVELS>
void decode_row(const QuantizedWeight& weight, int64_t n, float* out) {
    const auto zero_point = zero_point_lanes(weight.zero_point);
    Levels levels{};
    if constexpr (LEVELS) levels = levels_of(weight);
    const int64_t groups = weight.cols / GROUP;
    const uint8_t* codes = weight.codes + n * (weight.cols * BITS / 8);
    vf values[GROUP / W];
    float scales[VALUE_CHUNK], high_scales[VALUE_CHUNK], offsets[VALUE_CHUNK], high_offsets[VALUE_CHUNK];
    const bool with_offsets = has_offsets(weight);
    for (int64_t g0 = 0; g0 < groups; g0 += VALUE_CHUNK) {
        const int64_t count = std::min(VALUE_CHUNK, groups - g0);
        convert_values(weight, Part::scale, n, g0, count, scales);
        if (half_group_scales(BITS)) convert_values(weight, Part::high_scale, n, g0, count, high_scales);
        if (with_offsets) convert_values(weight, Part::offset, n, g0, count, offsets);
        if (BITS == 2) convert_values(weight, Part::high_offset, n, g0, count, high_offsets);
        for (int64_t g = g0; g < g0 + count; ++g) {  // the operands fused_tile gives decode_codes
            const vf scale = simd::set1(scales[g - g0]);
            const vf high = half_group_scales(BITS) ? simd::set1(high_scales[g - g0]) : scale;
            const vf offset = with_offsets ? simd::set1(offsets[g - g0]) : simd::zero();
            const vf high_offset = BITS == 2 ? simd::set1(high_offsets[g - g0]) : offset;
            decode_codes<BITS, LEVELS>(codes + g * (GROUP * BITS / 8), scale, high, offset, high_offset, zero_point,
                                       levels, values);
            for (int64_t v = 0; v < GROUP; v += W) simd::store(out + g * GROUP + v, values[v / W]);
        }
    }
}

// The same sums as decode_row then tile<R, C> (the same operations in the same order, so the same bits),
// with the decoded values kept in registers: for calls of a few rows (decode steps), where writing the
// block out and reading it back would cost more than the multiply-adds.
template <int BITS, bool LEVELS, int R, int C>
void fused_tile(const QuantizedWeight& weight, int64_t n0, const float* x, int64_t x_stride, const float* bias,
                float* out, int64_t out_stride) {
    vf sums[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) sums[r][c] = simd::zero();
    const auto zero_point = zero_point_lanes(weight.zero_point);
    Levels levels{};
    if constexpr (LEVELS) levels = levels_of(weight);
    const int64_t groups = weight.cols / GROUP;
    vf values[GROUP / W];
    float scales[C][VALUE_CHUNK], high_scales[C][VALUE_CHUNK], offsets[C][VALUE_CHUNK], high_offsets[C][VALUE_CHUNK];
    constexpr bool halves = half_group_scales(BITS);  // Q6_K, Q3_K, Q2_K: a scale per 16 values
    constexpr bool half_offsets = BITS == 2;          // Q2_K: an offset per 16 values too
    const bool with_offsets = has_offsets(weight);
    constexpr int64_t group_bytes = GROUP * BITS / 8;
    const int64_t row_bytes = weight.cols * BITS / 8;
    const uint8_t* codes[C];
    const uint8_t* ahead[C];  // the rows CODE_PREFETCH_BLOCKS blocks on, the weight's last row where it has no more
    for (int c = 0; c < C; ++c) {
        codes[c] = weight.codes + (n0 + c) * row_bytes;
        ahead[c] = weight.codes + std::min<int64_t>(n0 + CODE_PREFETCH_BLOCKS * C + c, weight.rows - 1) * row_bytes;
    }
    for (int64_t g0 = 0; g0 < groups; g0 += VALUE_CHUNK) {
        const int64_t count = std::min(VALUE_CHUNK, groups - g0);
        for (int c = 0; c < C; ++c) {
            convert_values(weight, Part::scale, n0 + c, g0, count, scales[c]);
            if (halves) convert_values(weight, Part::high_scale, n0 + c, g0, count, high_scales[c]);
            if (with_offsets) convert_values(weight, Part::offset, n0 + c, g0, count, offsets[c]);
            if (half_offsets) convert_values(weight, Part::high_offset, n0 + c, g0, count, high_offsets[c]);
        }
        for (int64_t g = g0; g < g0 + count; ++g) {
            // The codes of the block CODE_PREFETCH_BLOCKS ahead, at this group's offset: a decode step reads each
            // weight once, so its speed is how soon the next rows arrive from memory.
            // (a fixed count, no loop to branch on: asking again for rows already asked for costs nothing)
            for (int c = 0; c < C; ++c) __builtin_prefetch(ahead[c] + g * group_bytes, 0, CODE_PREFETCH_LOCALITY);
            for (int c = 0; c < C; ++c) {
                const vf scale = simd::set1(scales[c][g - g0]);
                const vf high = halves ? simd::set1(high_scales[c][g - g0]) : scale;
                const vf offset = with_offsets ? simd::set1(offsets[c][g - g0]) : simd::zero();
                const vf high_offset = half_offsets ? simd::set1(high_offsets[c][g - g0]) : offset;
                decode_codes<BITS, LEVELS>(codes[c] + g * group_bytes, scale, high, offset, high_offset, zero_point,
                                           levels, values);
                for (int64_t v = 0; v < GROUP; v += W) {
                    const int64_t k = g * GROUP + v;
                    for (int r = 0; r < R; ++r) {
                        sums[r][c] = simd::fmadd(values[v / W], simd::load(x + r * x_stride + k), sums[r][c]);
                    }
                }
            }
        }
    }
    write_sums(sums, bias, out, out_stride);
}

// out[r, c] = x[r] . block[c] (+ bias[c]) for R rows and C decoded weight rows. `ahead`: how many rows of the
// block PREFETCH_BLOCKS blocks further on to ask for, a cache line at a time (a float32 weight read in place;
// 0 for a decoded block). A prefetch changes no operation, so not the bits.
template <int R, int C>
void tile(const float* x, int64_t x_stride, const float* block, int64_t cols, const float* bias, float* out,
          int64_t out_stride, int64_t ahead) {
    vf sums[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) sums[r][c] = simd::zero();
    constexpr int64_t line = 64 / sizeof(float);  // floats per cache line
    const float* next = ahead > 0 ? block + PREFETCH_BLOCKS * C * cols : block;
    for (int64_t k = 0; k < cols; k += W) {
        if (ahead > 0 && k % line == 0) {
            for (int64_t c = 0; c < ahead; ++c) __builtin_prefetch(next + c * cols + k, 0, FLOAT_PREFETCH_LOCALITY);
        }
        vf w[C];
        for (int c = 0; c < C; ++c) w[c] = simd::load(block + c * cols + k);
        for (int r = 0; r < R; ++r) {
            const vf xv = simd::load(x + r * x_stride + k);
            for (int c = 0; c < C; ++c) sums[r][c] = simd::fmadd(w[c], xv, sums[r][c]);
        }
    }
    write_sums(sums, bias, out, out_stride);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);

template <int R, int... C>
constexpr std::array<TileFn, sizeof...(C)> tiles_of_rows(std::integer_sequence<int, C...>) {
    return {&tile<R, C + 1>...};
}

template <int... R>
constexpr std::array<std::array<TileFn, TILE_COLS>, sizeof...(R)> all_tiles(std::integer_sequence<int, R...>) {
    return {tiles_of_rows<R + 1>(std::make_integer_sequence<int, TILE_COLS>())...};
}

// TILES[r - 1][c - 1]: the tile of r rows and c columns.
const auto TILES = all_tiles(std::make_integer_sequence<int, TILE_ROWS>());

using FusedFn = void (*)(const QuantizedWeight&, int64_t, const float*, int64_t, const float*, float*, int64_t);
using FusedTiles = std::array<std::array<FusedFn, TILE_COLS>, TILE_ROWS>;

template <int BITS, bool LEVELS, int R, int... C>
constexpr std::array<FusedFn, sizeof...(C)> fused_of_rows(std::integer_sequence<int, C...>) {
    return {&fused_tile<BITS, LEVELS, R, C + 1>...};
}

template <int BITS, bool LEVELS, int... R>
constexpr FusedTiles all_fused(std::integer_sequence<int, R...>) {
    return {fused_of_rows<BITS, LEVELS, R + 1>(std::make_integer_sequence<int, TILE_COLS>())...};
}

// FUSED[f][r - 1][c - 1]: the fused tile of r rows and c columns for codes of width 2, 3, 4, 5, 6, 8 (f = 0 .. 5)
// and 4-bit codes with levels (f = 6).
constexpr auto ROWS = std::make_integer_sequence<int, TILE_ROWS>();
const std::array<FusedTiles, 7> FUSED = {all_fused<2, false>(ROWS), all_fused<3, false>(ROWS), all_fused<4, false>(ROWS),
                                         all_fused<5, false>(ROWS), all_fused<6, false>(ROWS), all_fused<8, false>(ROWS),
                                         all_fused<4, true>(ROWS)};
using DecodeRowFn = void (*)(const QuantizedWeight&, int64_t, float*);
const std::array<DecodeRowFn, 7> DECODE_ROW = {&decode_row<2, false>, &decode_row<3, false>, &decode_row<4, false>,
                                               &decode_row<5, false>, &decode_row<6, false>, &decode_row<8, false>,
                                               &decode_row<4, true>};

// The index of a weight's code format in FUSED and DECODE_ROW: one of quantized.h's widths, which module.cpp's
// binding checks, or 4-bit codes with levels.
constexpr int64_t width_index(int32_t bits) { return bits == 8 ? 5 : bits - 2; }
static_assert(width_index(2) == 0 && width_index(3) == 1 && width_index(4) == 2 && width_index(5) == 3 &&
                  width_index(6) == 4 && width_index(8) == 5,
              "the order of FUSED and DECODE_ROW");
int64_t format_index(const QuantizedWeight& weight) { return weight.levels != nullptr ? 6 : width_index(weight.bits); }

}  // namespace

// A float32 weight (bits 32): the tiles read its rows where they lie, nothing to decode, and ask for the rows
// PREFETCH_BLOCKS blocks ahead. A call of a few rows streams the weight once; a longer one walks its chunks of
// ROW_CHUNK input rows over each block while the block sits in L1, as the decoded blocks do. Asking ahead pays
// there too where the weight comes from memory: lm_head's (49152 x 576) 8 to 64 rows took 0.8-0.9x oneDNN's
// time with it, 1.1-1.5x without (AVX-512 EPYC, 2 threads). Only a chunk's first PREFETCH_TILES tiles ask: asked
// by every tile, 512 rows of the MLP's down projection took 1.2x oneDNN's time, against 1.14x. The tiles are the
// quantized path's: on AVX2 (the avx2 variant on the AVX-512 EPYC) a float weight's other tile shapes (2 x 4,
// 4 x 2, 2 x 6, 1 x 8) took 1.03-1.8x 3 x 4's time at 64 and 512 rows; larger row chunks were no faster.
void quantized_matmul(const QuantizedWeight& weight, const float* x, int64_t num_rows, int64_t x_stride,
                      const float* bias, float* out, int64_t out_stride) {
    const int64_t cols = weight.cols;
    const int64_t num_blocks = (weight.rows + TILE_COLS - 1) / TILE_COLS;
    // A decode step (a few rows) splits the weight finely; a prefill's blocks are larger work each. At 1 row
    // a thread takes at least 2^14 / cols blocks (28 blocks of 4 weight rows at 576 columns). With 2^16,
    // SmolLM2's K and V projections (48 blocks) ran on one thread; split, a 1-row Q8_0 192 x 576 matmul took
    // 0.69-0.89x the time (AVX-512 EPYC, 2 threads). Which thread sums a block never changes its bits.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (cols * std::min<int64_t>(num_rows, ROW_CHUNK)));
    const bool in_place = weight.bits == 32;  // float32 values: no codes to decode
    const float* values = in_place ? reinterpret_cast<const float*>(weight.codes) : nullptr;
    const FusedTiles* fused = in_place ? nullptr : &FUSED[format_index(weight)];
    const DecodeRowFn decode_row_of = in_place ? nullptr : DECODE_ROW[format_index(weight)];
    const int64_t code_row_bytes = cols * weight.bits / 8;
    at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> block(in_place ? 0 : static_cast<size_t>(TILE_COLS * cols));
        for (int64_t first_row = 0; first_row < num_rows; first_row += ROW_CHUNK) {
            const int64_t chunk_end = std::min(num_rows, first_row + ROW_CHUNK);
            for (int64_t b = begin; b < end; ++b) {
                const int64_t n0 = b * TILE_COLS;
                const int64_t num_cols = std::min<int64_t>(TILE_COLS, weight.rows - n0);
                const float* block_bias = bias == nullptr ? nullptr : bias + n0;
                const float* block_rows = block.data();
                int64_t ahead = 0;  // the rows of the block PREFETCH_BLOCKS ahead to ask for (float32 only)
                if (in_place) {
                    block_rows = values + n0 * cols;
                    ahead = std::min<int64_t>(TILE_COLS,
                                              std::max<int64_t>(0, weight.rows - n0 - PREFETCH_BLOCKS * TILE_COLS));
                } else if (chunk_end - first_row <= FUSED_ROWS) {  // a decode step: decode in registers
                    for (int64_t r = first_row; r < chunk_end; r += TILE_ROWS) {
                        const int64_t count = std::min<int64_t>(TILE_ROWS, chunk_end - r);
                        (*fused)[count - 1][num_cols - 1](weight, n0, x + r * x_stride, x_stride, block_bias,
                                                          out + r * out_stride + n0, out_stride);
                    }
                    continue;
                } else {
                    // The next block's codes, into L2 while this one decodes and multiplies: at 32 rows (a step of
                    // decodes) the tiles take about a microsecond a block, and codes asked for only when decoded
                    // left decode_row waiting on memory. SmolLM2 Q8_0's 32-row matmuls, interleaved A/B: the 30
                    // layers 0.95-0.98x the time, lm_head 0.87-0.98x; 2 or 4 blocks ahead no better.
                    const int64_t next_rows = std::min<int64_t>(TILE_COLS, weight.rows - n0 - TILE_COLS);
                    for (int64_t byte = 0; byte < next_rows * code_row_bytes; byte += 64) {
                        __builtin_prefetch(weight.codes + (n0 + TILE_COLS) * code_row_bytes + byte, 0,
                                           CODE_PREFETCH_LOCALITY);
                    }
                    for (int64_t c = 0; c < num_cols; ++c) decode_row_of(weight, n0 + c, block.data() + c * cols);
                }
                for (int64_t r = first_row; r < chunk_end; r += TILE_ROWS) {
                    const int64_t count = std::min<int64_t>(TILE_ROWS, chunk_end - r);
                    TILES[count - 1][num_cols - 1](x + r * x_stride, x_stride, block_rows, cols, block_bias,
                                                   out + r * out_stride + n0, out_stride,
                                                   r - first_row < PREFETCH_TILES * TILE_ROWS ? ahead : 0);
                }
            }
        }
    });
}

void dequantize_rows(const QuantizedWeight& weight, int64_t first, int64_t count, float* out) {
    if (weight.bits == 32) {
        std::memcpy(out, reinterpret_cast<const float*>(weight.codes) + first * weight.cols,
                    static_cast<size_t>(count * weight.cols) * sizeof(float));
        return;
    }
    const DecodeRowFn decode_row_of = DECODE_ROW[format_index(weight)];
    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) decode_row_of(weight, first + i, out + i * weight.cols);
    });
}

}  // namespace prefixserve
