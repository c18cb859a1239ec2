// bf16 attention on AMX tiles (the amx variant: AVX-512 BF16 and AMX-BF16), for paged_causal.cpp.
//
// Per 32-key step and block of 16 query vectors (head_dim a multiple of 32):
//
//   scores  C[16 vectors x 16 keys] += Q[16 x 32 bf16] . K[16 pairs x 16 keys]   per 32-element chunk,
//           two C tiles for the step's two key tiles. K is the transposed pair tile paged_causal.cpp
//           builds for the dot-product path anyway: exactly AMX's B layout.
//   softmax the online step in float32, its weights rounded to bf16 (the rounded ones are summed)
//   values  O[16 vectors x 16 dims] = P[16 x 32 bf16] . V[16 key pairs x 16 dims x 2] per 16 dims,
//           added to the float32 accumulators; V is re-laid out per step, key pairs interleaved.
//
// AMX sums each output's products in an order fixed by the hardware, and a tile row depends on its
// own row of A alone: a vector's bits are the same whatever other rows share its tile, so rows stay
// batch-invariant. Tiles are always configured 16 rows x 64 bytes (a block with fewer vectors
// leaves the rest unused). Each worker thread configures them (AmxTiles) and releases them after.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace prefixserve {
namespace amx {

constexpr int ROWS = 16;        // tile rows: query vectors, key pairs
constexpr int ROW_BYTES = 64;   // 32 bf16, 16 floats
// The tile registers by name. GCC's tile intrinsics paste their operand into the instruction text,
// so these must be macros of literal numbers.
#define PREFIXSERVE_TILE_QUERY 0
#define PREFIXSERVE_TILE_KEYS_LOW 1
#define PREFIXSERVE_TILE_KEYS_HIGH 2
#define PREFIXSERVE_TILE_SCORES_LOW 3
#define PREFIXSERVE_TILE_SCORES_HIGH 4
#define PREFIXSERVE_TILE_WEIGHTS 5
#define PREFIXSERVE_TILE_VALUES 6
#define PREFIXSERVE_TILE_OUT 7

// The thread's tile configuration for its lifetime: every tile 16 x 64 bytes; released at the end so
// that a library sharing the thread (oneDNN) configures its own.
struct AmxTiles {
    AmxTiles() {
        alignas(64) uint8_t config[64] = {0};
        config[0] = 1;  // palette 1
        for (int t = 0; t < 8; ++t) {
            config[16 + 2 * t] = ROW_BYTES;  // bytes per row (little-endian uint16)
            config[48 + t] = ROWS;           // rows
        }
        _tile_loadconfig(config);
    }
    ~AmxTiles() { _tile_release(); }
    AmxTiles(const AmxTiles&) = delete;
    AmxTiles& operator=(const AmxTiles&) = delete;
};

// scores[16][32] (floats, row stride 32) of 16 vectors: their bf16 query rows start at `query` with
// `query_stride` bytes between vectors; key tiles as paged_causal.cpp lays them out (pairs).
inline void score_block(const uint32_t* query, int64_t query_stride, const float* key_t, int64_t elements,
                        float* scores) {
    _tile_zero(PREFIXSERVE_TILE_SCORES_LOW);
    _tile_zero(PREFIXSERVE_TILE_SCORES_HIGH);
    const float* high = key_t + elements * 16;
    for (int64_t c = 0; c < elements; c += 16) {  // 16 pairs: 32 bf16 a chunk
        _tile_loadd(PREFIXSERVE_TILE_QUERY, query + c, query_stride);
        _tile_loadd(PREFIXSERVE_TILE_KEYS_LOW, key_t + c * 16, ROW_BYTES);
        _tile_loadd(PREFIXSERVE_TILE_KEYS_HIGH, high + c * 16, ROW_BYTES);
        _tile_dpbf16ps(PREFIXSERVE_TILE_SCORES_LOW, PREFIXSERVE_TILE_QUERY, PREFIXSERVE_TILE_KEYS_LOW);
        _tile_dpbf16ps(PREFIXSERVE_TILE_SCORES_HIGH, PREFIXSERVE_TILE_QUERY, PREFIXSERVE_TILE_KEYS_HIGH);
    }
    _tile_stored(PREFIXSERVE_TILE_SCORES_LOW, scores, 32 * sizeof(float));
    _tile_stored(PREFIXSERVE_TILE_SCORES_HIGH, scores + 16, 32 * sizeof(float));
}

// The step's 32 value rows (bf16, head_dim each; rows past the step's keys are zeros) as AMX's B
// operand per 16 dims: vnni[d / 16][pair r][2 n + e] = value[2 r + e][d + n].
inline void interleave_values(const uint16_t* const* value_rows, int64_t head_dim, uint16_t* vnni) {
    for (int64_t d = 0; d < head_dim; d += 16) {
        uint16_t* block = vnni + d * 32;  // 16 pair rows x 32 bf16
        for (int r = 0; r < 16; ++r) {
            const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value_rows[2 * r] + d));
            const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value_rows[2 * r + 1] + d));
            const __m512i pairs = _mm512_permutexvar_epi16(
                _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0),
                _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
            _mm512_storeu_si512(block + r * 32, pairs);
        }
    }
}

// out[16][head_dim] floats (row stride head_dim) = weights[16][32] bf16 (row stride 64 bytes) . values.
inline void value_block(const uint16_t* weights, const uint16_t* vnni, int64_t head_dim, float* out) {
    _tile_loadd(PREFIXSERVE_TILE_WEIGHTS, weights, ROW_BYTES);
    for (int64_t d = 0; d < head_dim; d += 16) {
        _tile_zero(PREFIXSERVE_TILE_OUT);
        _tile_loadd(PREFIXSERVE_TILE_VALUES, vnni + d * 32, ROW_BYTES);
        _tile_dpbf16ps(PREFIXSERVE_TILE_OUT, PREFIXSERVE_TILE_WEIGHTS, PREFIXSERVE_TILE_VALUES);
        _tile_stored(PREFIXSERVE_TILE_OUT, out + d, head_dim * sizeof(float));
    }
}

// 16 floats rounded to bf16 (nearest even), stored, and returned widened back to floats.
inline __m512 round_to_bf16(__m512 x, uint16_t* stored) {
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(stored), rounded);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
}

}  // namespace amx
}  // namespace prefixserve
#endif
