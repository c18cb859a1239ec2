// The matmul of a weight kept quantized (quantized.h), in two steps per block of TILE_COLS weight rows:
//
//   1. decode the block's codes to float32 rows in a small buffer (L1-sized: TILE_COLS x cols), once
//      per chunk of ROW_CHUNK input rows: the codes are read from memory once per chunk, the only
//      pass over the weight a decode step makes (4 or 8 times fewer bytes than float32 weights);
//   2. multiply TILE_ROWS input rows by the block in registers: TILE_ROWS x TILE_COLS running sums of
//      W lanes each, one multiply-add per lane and value, then each sum's lanes in a fixed tree.
//
// A call of at most FUSED_ROWS rows (a decode step) skips the buffer: fused_tile decodes into registers
// and multiplies at once, the same operations in the same order, so the same bits as the two steps.
//
// Every output element is the same sequence of operations wherever its row sits in the call (a tile
// of one row or of TILE_ROWS), so a token's logits never depend on its batch. Against a float32
// matmul of the decoded weights the sums differ in order only.
//
// Threads split the weight rows (out_features); each keeps its own decode buffer.
#include "quantized.h"
#include "quantized_scales.h"

#include "simd.h"

#include <ATen/Parallel.h>

#include <array>
#include <utility>
#include <vector>

namespace prefixserve {

using simd::vf;
using simd::W;

namespace {

#if defined(PREFIXSERVE_SIMD_AVX512)
constexpr int TILE_ROWS = 4, TILE_COLS = 4;  // 16 running sums of 32 registers
// W int8 codes at p, less zero_point, as float lanes (exact).
inline vf int8_lanes(const uint8_t* p, __m512i zero_point) {
    const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(wide, zero_point));
}
// (int4 codes decode by a table lookup here: decode_group.)
inline __m512i zero_point_lanes(int32_t zero_point) { return _mm512_set1_epi32(zero_point); }
// The 32 high bits of a 5-bit group (quantized.h: value e's at bit e), as 16 in each of two masks.
inline uint32_t high_bits(const uint8_t* p) {
    uint32_t bits;
    std::memcpy(&bits, p + 16, sizeof(bits));
    return bits;
}
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
#elif defined(PREFIXSERVE_SIMD_AVX2)
constexpr int TILE_ROWS = 3, TILE_COLS = 4;  // 12 running sums of 16 registers
inline vf int8_lanes(const uint8_t* p, __m256i zero_point) {
    const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(wide, zero_point));
}
// The low (or high) nibbles of W bytes at p, less zero_point.
inline vf nibble_lanes(const uint8_t* p, bool high, __m256i zero_point) {
    __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    if (high) wide = _mm256_srli_epi32(wide, 4);
    wide = _mm256_and_si256(wide, _mm256_set1_epi32(0xF));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(wide, zero_point));
}
inline __m256i zero_point_lanes(int32_t zero_point) { return _mm256_set1_epi32(zero_point); }
// A 5-bit group's high bits as four vectors of 0 or 16 (values 8 v .. 8 v + 7), the bit of value e at e.
inline void five_bit_highs(const uint8_t* p, __m256i* out) {
    uint32_t bits;
    std::memcpy(&bits, p + 16, sizeof(bits));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int v = 0; v < 4; ++v) {
        const __m256i shifted = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits >> (8 * v))), lane);
        out[v] = _mm256_slli_epi32(_mm256_and_si256(shifted, _mm256_set1_epi32(1)), 4);
    }
}
// Q6_K's group of 32 at p as four vectors (values 8 v .. 8 v + 7): low nibbles as nibble_lanes reads them,
// the high pair of value 8 v + j from byte 16 + j at bit 2 v.
inline void six_bit_lanes(const uint8_t* p, __m256i zero_point, __m256* out) {
    const __m256i high = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16))), 4);
    for (int v = 0; v < 4; ++v) {
        __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * (v % 2))));
        if (v >= 2) low = _mm256_srli_epi32(low, 4);
        const __m256i code = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(0xF)),
            _mm256_and_si256(_mm256_srl_epi32(high, _mm_cvtsi32_si128(2 * v)), _mm256_set1_epi32(0x30)));
        out[v] = _mm256_cvtepi32_ps(_mm256_sub_epi32(code, zero_point));
    }
}
#else
// NEON and portable: the codes are widened one lane at a time (exact either way); the multiply-adds
// that dominate stay vector operations.
constexpr int TILE_ROWS = 2, TILE_COLS = 4;
inline vf from_lanes(const float* lanes) { return simd::load(lanes); }
inline vf int8_lanes(const uint8_t* p, int32_t zero_point) {
    float lanes[W];
    for (int l = 0; l < W; ++l) lanes[l] = static_cast<float>(static_cast<int8_t>(p[l]) - zero_point);
    return from_lanes(lanes);
}
inline vf nibble_lanes(const uint8_t* p, bool high, int32_t zero_point) {
    float lanes[W];
    for (int l = 0; l < W; ++l) lanes[l] = static_cast<float>(((high ? p[l] >> 4 : p[l]) & 0xF) - zero_point);
    return from_lanes(lanes);
}
inline int32_t zero_point_lanes(int32_t zero_point) { return zero_point; }
// A 5-bit group at p as 32 / W vectors: value e's low nibble as for 4 bits, its high bit bit e of the
// group's last 4 bytes.
inline void five_bit_lanes(const uint8_t* p, int32_t zero_point, vf* out) {
    for (int v = 0; v < 32 / W; ++v) {
        float lanes[W];
        for (int l = 0; l < W; ++l) {
            const int e = v * W + l;
            const int low = (p[e % 16] >> (e >= 16 ? 4 : 0)) & 0xF, high = (p[16 + e / 8] >> (e % 8)) & 1;
            lanes[l] = static_cast<float>((low | high << 4) - zero_point);
        }
        out[v] = from_lanes(lanes);
    }
}
// Q6_K's group of 32 at p as 32 / W vectors: value e's low nibble from byte e % 16 (the high nibble from
// e = 16 on), its high pair from byte 16 + e % 8 at bit 2 (e / 8).
inline void six_bit_lanes(const uint8_t* p, int32_t zero_point, vf* out) {
    for (int v = 0; v < 32 / W; ++v) {
        float lanes[W];
        for (int l = 0; l < W; ++l) {
            const int e = v * W + l;
            const int low = (p[e % 16] >> (e >= 16 ? 4 : 0)) & 0xF, high = (p[16 + e % 8] >> (2 * (e / 8))) & 3;
            lanes[l] = static_cast<float>((low | high << 4) - zero_point);
        }
        out[v] = from_lanes(lanes);
    }
}
#endif

constexpr int64_t ROW_CHUNK = 64;  // input rows that stay in L2 while a thread decodes its blocks
// Calls of up to this many rows decode in registers, once per TILE_ROWS rows. benchmarks/quantized_matmul.py
// on an AVX-512 EPYC: at 1-4 rows the fused path takes 0.3-0.6x the buffered one's time; at 8 rows they
// are even (decoding twice costs what the buffer costs); at 16 the buffered path is faster.
constexpr int64_t FUSED_ROWS = TILE_ROWS;
// How far ahead (in blocks of TILE_COLS weight rows) a decode step asks for the codes it reads next. On the
// AVX-512 EPYC, SmolLM2 Q4_1's 121 matmuls of one token (96 MB from DRAM) took 8.1 ms without and 5.9 ms
// with it (1, 2 or 4 blocks alike; benchmarks/quantized_matmul.py). A prefill's tiles are compute-bound:
// no gain there, so only the fused path asks.
constexpr int64_t PREFETCH_BLOCKS = 2;

// The values of group g of weight row n, decoded into out[GROUP / W]: scale (code - zero_point) + offset,
// one rounding each. int4: 32 values in 16 bytes, value e in byte e % 16, its high nibble from e = 16 on.
// Q6_K (bits 6): 24 bytes a group, its last 16 values scaled by high_scale (the others by scale, as
// every value of the other formats).
template <typename ZeroPoint>
inline void decode_group(const QuantizedWeight& weight, int64_t n, int64_t g, vf scale, vf high_scale, vf offset,
                         ZeroPoint zero_point, vf* out) {
    if (weight.bits == 6) {
        six_bit_lanes(weight.codes + n * (weight.cols / 4 * 3) + g * 24, zero_point, out);
        for (int64_t v = 0; v < GROUP; v += W) out[v / W] = simd::fmadd(out[v / W], v < 16 ? scale : high_scale, offset);
        return;
    }
    if (weight.bits == 5) {
        const uint8_t* codes = weight.codes + n * (weight.cols / 8 * 5) + g * 20;
#if defined(PREFIXSERVE_SIMD_AVX512)
        // As for 4 bits, a table of the 32 values a code can take, looked up by code (two tables of 16).
        const __m512i first_levels = _mm512_sub_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), zero_point);
        const __m512 low_table = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first_levels), scale, offset);
        const __m512 high_table = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_add_epi32(first_levels, _mm512_set1_epi32(16))), scale, offset);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
        const uint32_t high = high_bits(codes);
        const __m512i sixteen = _mm512_set1_epi32(16);
        const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), upper = _mm512_srli_epi32(bytes, 4);
        const __m512i first = _mm512_mask_or_epi32(low, static_cast<__mmask16>(high), low, sixteen);
        const __m512i second = _mm512_mask_or_epi32(upper, static_cast<__mmask16>(high >> 16), upper, sixteen);
        out[0] = _mm512_permutex2var_ps(low_table, first, high_table);
        out[1] = _mm512_permutex2var_ps(low_table, second, high_table);
#elif defined(PREFIXSERVE_SIMD_AVX2)
        __m256i highs[4];
        five_bit_highs(codes, highs);
        for (int v = 0; v < 4; ++v) {
            const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * (v % 2))));
            const __m256i nibble = _mm256_and_si256(v >= 2 ? _mm256_srli_epi32(low, 4) : low, _mm256_set1_epi32(0xF));
            const __m256i code = _mm256_sub_epi32(_mm256_or_si256(nibble, highs[v]), zero_point);
            out[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), scale, offset);
        }
#else
        five_bit_lanes(codes, zero_point, out);
        for (int64_t v = 0; v < GROUP; v += W) out[v / W] = simd::fmadd(out[v / W], scale, offset);
#endif
        return;
    }
    if (weight.bits == 8) {
        const uint8_t* codes = weight.codes + n * weight.cols + g * GROUP;
        for (int64_t v = 0; v < GROUP; v += W) {
            out[v / W] = simd::fmadd(int8_lanes(codes + v, zero_point), scale, offset);
        }
        return;
    }
    const uint8_t* codes = weight.codes + n * (weight.cols / 2) + g * 16;
#if defined(PREFIXSERVE_SIMD_AVX512)
    // The 16 values a code can take, decoded once per group, then looked up by each code's nibble: the same
    // multiply-add of the same operands as decoding each value, in one permute instead of three operations.
    const __m512 levels = _mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), zero_point));
    const __m512 table = _mm512_fmadd_ps(levels, scale, offset);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    out[0] = _mm512_permutexvar_ps(bytes, table);  // reads each index's low 4 bits: the low nibble
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#else
    for (int64_t v = 0; v < 32; v += W) {
        out[v / W] = simd::fmadd(nibble_lanes(codes + v % 16, v >= 16, zero_point), scale, offset);
    }
#endif
}

// Weight row n decoded into out [cols], its scales and offsets converted as fused_tile converts them.
void decode_row(const QuantizedWeight& weight, int64_t n, float* out) {
    const auto zero_point = zero_point_lanes(weight.zero_point);
    const int64_t groups = weight.cols / GROUP;
    vf values[GROUP / W];
    float scales[VALUE_CHUNK], high_scales[VALUE_CHUNK], offsets[VALUE_CHUNK];
    const float* high = weight.bits == 6 ? high_scales : scales;  // a group's last 16 values' scales
    for (int64_t g0 = 0; g0 < groups; g0 += VALUE_CHUNK) {
        const int64_t count = std::min(VALUE_CHUNK, groups - g0);
        convert_values(weight, Part::scale, n, g0, count, scales);
        if (weight.bits == 6) convert_values(weight, Part::high_scale, n, g0, count, high_scales);
        convert_values(weight, Part::offset, n, g0, count, offsets);
        for (int64_t g = g0; g < g0 + count; ++g) {
            decode_group(weight, n, g, simd::set1(scales[g - g0]), simd::set1(high[g - g0]), simd::set1(offsets[g - g0]),
                         zero_point, values);
            for (int64_t v = 0; v < GROUP; v += W) simd::store(out + g * GROUP + v, values[v / W]);
        }
    }
}


// The same sums as decode_row then tile<R, C> (the same operations in the same order, so the same bits),
// with the decoded values kept in registers: for calls of a few rows (decode steps), where writing the
// block out and reading it back would cost more than the multiply-adds.
template <int R, int C>
void fused_tile(const QuantizedWeight& weight, int64_t n0, const float* x, int64_t x_stride, const float* bias,
                float* out, int64_t out_stride) {
    vf sums[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) sums[r][c] = simd::zero();
    const auto zero_point = zero_point_lanes(weight.zero_point);
    const int64_t groups = weight.cols / GROUP;
    vf values[GROUP / W];
    float scales[C][VALUE_CHUNK], high_scales[C][VALUE_CHUNK], offsets[C][VALUE_CHUNK];
    const bool halves = weight.bits == 6;  // Q6_K: a scale per 16 values
    const int64_t row_bytes = weight.cols * weight.bits / 8, group_bytes = GROUP * weight.bits / 8;
    const int64_t ahead = std::min<int64_t>(C, std::max<int64_t>(0, weight.rows - n0 - PREFETCH_BLOCKS * C));
    for (int64_t g0 = 0; g0 < groups; g0 += VALUE_CHUNK) {
        const int64_t count = std::min(VALUE_CHUNK, groups - g0);
        for (int c = 0; c < C; ++c) {
            convert_values(weight, Part::scale, n0 + c, g0, count, scales[c]);
            if (halves) convert_values(weight, Part::high_scale, n0 + c, g0, count, high_scales[c]);
            convert_values(weight, Part::offset, n0 + c, g0, count, offsets[c]);
        }
        for (int64_t g = g0; g < g0 + count; ++g) {
            // The codes of the block PREFETCH_BLOCKS ahead, at this group's offset: a decode step reads each
            // weight once, so its speed is how soon the next rows arrive from memory.
            for (int64_t c = 0; c < ahead; ++c) {
                __builtin_prefetch(weight.codes + (n0 + PREFETCH_BLOCKS * C + c) * row_bytes + g * group_bytes, 0, 3);
            }
            for (int c = 0; c < C; ++c) {
                const float* high = halves ? high_scales[c] : scales[c];
                decode_group(weight, n0 + c, g, simd::set1(scales[c][g - g0]), simd::set1(high[g - g0]),
                             simd::set1(offsets[c][g - g0]), zero_point, values);
                for (int64_t v = 0; v < GROUP; v += W) {
                    const int64_t k = g * GROUP + v;
                    for (int r = 0; r < R; ++r) {
                        sums[r][c] = simd::fmadd(values[v / W], simd::load(x + r * x_stride + k), sums[r][c]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            const float sum = simd::sum_lanes(sums[r][c]);
            out[r * out_stride + c] = bias == nullptr ? sum : sum + bias[c];
        }
    }
}

// out[r, c] = x[r] . block[c] (+ bias[c]) for R rows and C decoded weight rows.
template <int R, int C>
void tile(const float* x, int64_t x_stride, const float* block, int64_t cols, const float* bias, float* out,
          int64_t out_stride) {
    vf sums[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) sums[r][c] = simd::zero();
    for (int64_t k = 0; k < cols; k += W) {
        vf w[C];
        for (int c = 0; c < C; ++c) w[c] = simd::load(block + c * cols + k);
        for (int r = 0; r < R; ++r) {
            const vf xv = simd::load(x + r * x_stride + k);
            for (int c = 0; c < C; ++c) sums[r][c] = simd::fmadd(w[c], xv, sums[r][c]);
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            const float sum = simd::sum_lanes(sums[r][c]);
            out[r * out_stride + c] = bias == nullptr ? sum : sum + bias[c];
        }
    }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t);

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

template <int R, int... C>
constexpr std::array<FusedFn, sizeof...(C)> fused_of_rows(std::integer_sequence<int, C...>) {
    return {&fused_tile<R, C + 1>...};
}

template <int... R>
constexpr std::array<std::array<FusedFn, TILE_COLS>, sizeof...(R)> all_fused(std::integer_sequence<int, R...>) {
    return {fused_of_rows<R + 1>(std::make_integer_sequence<int, TILE_COLS>())...};
}

const auto FUSED = all_fused(std::make_integer_sequence<int, TILE_ROWS>());

}  // namespace

void quantized_matmul(const QuantizedWeight& weight, const float* x, int64_t num_rows, int64_t x_stride,
                      const float* bias, float* out, int64_t out_stride) {
    const int64_t cols = weight.cols;
    const int64_t num_blocks = (weight.rows + TILE_COLS - 1) / TILE_COLS;
    // A decode step (a few rows) splits the weight finely; a prefill's blocks are larger work each.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (cols * std::min<int64_t>(num_rows, ROW_CHUNK)));
    at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> block(static_cast<size_t>(TILE_COLS * cols));
        for (int64_t first_row = 0; first_row < num_rows; first_row += ROW_CHUNK) {
            const int64_t chunk_end = std::min(num_rows, first_row + ROW_CHUNK);
            for (int64_t b = begin; b < end; ++b) {
                const int64_t n0 = b * TILE_COLS;
                const int64_t num_cols = std::min<int64_t>(TILE_COLS, weight.rows - n0);
                const float* block_bias = bias == nullptr ? nullptr : bias + n0;
                if (chunk_end - first_row <= FUSED_ROWS) {  // a decode step: decode in registers
                    for (int64_t r = first_row; r < chunk_end; r += TILE_ROWS) {
                        const int64_t count = std::min<int64_t>(TILE_ROWS, chunk_end - r);
                        FUSED[count - 1][num_cols - 1](weight, n0, x + r * x_stride, x_stride, block_bias,
                                                       out + r * out_stride + n0, out_stride);
                    }
                    continue;
                }
                for (int64_t c = 0; c < num_cols; ++c) decode_row(weight, n0 + c, block.data() + c * cols);
                for (int64_t r = first_row; r < chunk_end; r += TILE_ROWS) {
                    const int64_t count = std::min<int64_t>(TILE_ROWS, chunk_end - r);
                    TILES[count - 1][num_cols - 1](x + r * x_stride, x_stride, block.data(), cols, block_bias,
                                                   out + r * out_stride + n0, out_stride);
                }
            }
        }
    });
}

void dequantize_rows(const QuantizedWeight& weight, int64_t first, int64_t count, float* out) {
    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) decode_row(weight, first + i, out + i * weight.cols);
    });
}

}  // namespace prefixserve
