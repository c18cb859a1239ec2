// LoRA's segmented matmul: each row of a step multiplied by its own adapter's A and B (lora.h), in one
// call per projection whatever the mix of adapters, instead of a gather, two small matmuls and a
// scatter per adapter. Written over simd.h and compiled per variant.
//
// Both products are written as sums of scaled rows (x[i] times row i of A^T, t[j] times row j of B^T),
// accumulated in vectors across the output columns: every output value is its own sum in a fixed
// order (i, then j, increasing), one multiply-add at a time, so a row's bits depend on nothing but the
// row and its adapter (tests/test_lora_kernel.py: each row alone as in any batch). The rows of one adapter
// are taken TILE at a time, so that each weight vector loaded serves all of them (the weights, not the
// arithmetic, are what a decode step's LoRA time goes to); a row's own sums are the same in a tile of one.
#include "lora.h"

#include "simd.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace prefixserve {

using simd::vf;
using simd::W;

namespace {

constexpr int TILE = 4;     // rows of one adapter multiplied together
constexpr int VECTORS = 2;  // vectors of columns per pass: TILE * VECTORS sums in registers

inline float multiply_add(float a, float b, float c) {
#if PREFIXSERVE_SIMD_FUSED
    return std::fma(a, b, c);  // what a lane of simd::fmadd computes
#else
    return a * b + c;
#endif
}

// t[n][column, column + V W) = (x[n] A^T) there: the sum over i of x[n][i] a_t[i][column + ...].
template <int N, int V, typename T>
inline void shrink_pass(const T* const* x, int64_t in, const LoRAWeights& w, int64_t column, float* const* t) {
    vf sums[N][V];
    for (int n = 0; n < N; ++n)
        for (int v = 0; v < V; ++v) sums[n][v] = simd::zero();
    for (int64_t i = 0; i < in; ++i) {
        const float* a_row = w.a_t + i * w.padded_rank + column;
        vf a[V];
        for (int v = 0; v < V; ++v) a[v] = simd::load(a_row + v * W);
        for (int n = 0; n < N; ++n) {
            const vf xi = simd::set1(simd::load_scalar(x[n], i));
            for (int v = 0; v < V; ++v) sums[n][v] = simd::fmadd(xi, a[v], sums[n][v]);
        }
    }
    for (int n = 0; n < N; ++n)
        for (int v = 0; v < V; ++v) simd::store(t[n] + column + v * W, sums[n][v]);
}

template <int N, typename T>
void shrink(const T* const* x, int64_t in, const LoRAWeights& w, float* const* t) {
    int64_t column = 0;
    for (; column + VECTORS * W <= w.padded_rank; column += VECTORS * W) shrink_pass<N, VECTORS>(x, in, w, column, t);
    for (; column < w.padded_rank; column += W) shrink_pass<N, 1>(x, in, w, column, t);  // padded_rank: whole vectors
}

// out[n][column, column + V W) += (t[n] B^T) * scaling there, rounded to T once.
template <int N, int V, typename T>
inline void expand_pass(const float* const* t, const LoRAPart& part, vf scaling, int64_t column, T* const* out) {
    vf sums[N][V];
    for (int n = 0; n < N; ++n)
        for (int v = 0; v < V; ++v) sums[n][v] = simd::zero();
    for (int64_t j = 0; j < part.rank; ++j) {
        const float* b_row = part.b_t + j * part.width + column;
        vf b[V];
        for (int v = 0; v < V; ++v) b[v] = simd::load(b_row + v * W);
        for (int n = 0; n < N; ++n) {
            const vf tj = simd::set1(t[n][j]);
            for (int v = 0; v < V; ++v) sums[n][v] = simd::fmadd(tj, b[v], sums[n][v]);
        }
    }
    for (int n = 0; n < N; ++n) {
        for (int v = 0; v < V; ++v) {
            T* o = out[n] + column + v * W;
            simd::store(o, simd::add(simd::load(o), simd::mul(sums[n][v], scaling)));
        }
    }
}

// One part's columns of each row's output (t[n] and out[n] already at the part's own rank and column).
template <int N, typename T>
void expand(const float* const* t, const LoRAPart& part, float scaling, T* const* out) {
    const vf scale = simd::set1(scaling);
    const int64_t whole = part.width / W * W;
    int64_t column = 0;
    for (; column + VECTORS * W <= whole; column += VECTORS * W) expand_pass<N, VECTORS>(t, part, scale, column, out);
    for (; column < whole; column += W) expand_pass<N, 1>(t, part, scale, column, out);
    for (; column < part.width; ++column) {  // the columns past the last whole vector, as a lane computes them
        for (int n = 0; n < N; ++n) {
            float sum = 0.f;
            for (int64_t j = 0; j < part.rank; ++j) sum = multiply_add(t[n][j], part.b_t[j * part.width + column], sum);
            out[n][column] = static_cast<T>(simd::load_scalar(out[n], column) + sum * scaling);
        }
    }
}

// The rows of one tile (one adapter's), through both products; t: N buffers of padded_rank floats.
template <int N, typename T>
void tile(const T* x, int64_t x_stride, int64_t in, const LoRAWeights& w, const int64_t* rows, T* out,
          int64_t out_stride, float* t) {
    const T* inputs[N];
    float* ranks[N];
    T* outputs[N];
    for (int n = 0; n < N; ++n) {
        inputs[n] = x + rows[n] * x_stride;
        ranks[n] = t + n * w.padded_rank;
    }
    shrink<N>(inputs, in, w, ranks);
    for (int64_t p = 0; p < w.num_parts; ++p) {
        const LoRAPart& part = w.parts[p];
        const float* part_ranks[N];
        for (int n = 0; n < N; ++n) {
            part_ranks[n] = ranks[n] + part.rank_offset;
            outputs[n] = out + rows[n] * out_stride + part.column;
        }
        expand<N>(part_ranks, part, w.scaling, outputs);
    }
}

}  // namespace

template <typename T>
void lora_add_rows(const T* x, int64_t rows, int64_t x_stride, int64_t in, const LoRAWeights* const* row_weights,
                   T* out, int64_t out_stride) {
    // Each adapter's rows in step order, then cut into tiles of up to TILE rows.
    std::vector<const LoRAWeights*> adapters;
    std::vector<std::vector<int64_t>> adapter_rows;
    int64_t padded = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const LoRAWeights* w = row_weights[r];
        if (w == nullptr) continue;
        size_t k = 0;
        while (k < adapters.size() && adapters[k] != w) ++k;
        if (k == adapters.size()) {
            adapters.push_back(w);
            adapter_rows.emplace_back();
            padded = std::max(padded, w->padded_rank);
        }
        adapter_rows[k].push_back(r);
    }
    std::vector<std::pair<size_t, size_t>> tiles;  // (adapter, first of its rows)
    for (size_t k = 0; k < adapters.size(); ++k)
        for (size_t first = 0; first < adapter_rows[k].size(); first += TILE) tiles.emplace_back(k, first);
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
        std::vector<float> t(TILE * padded);
        for (int64_t index = begin; index < end; ++index) {
            const auto [k, first] = tiles[index];
            const LoRAWeights& w = *adapters[k];
            const int64_t* tile_rows = adapter_rows[k].data() + first;
            switch (std::min<size_t>(TILE, adapter_rows[k].size() - first)) {
                case 4: tile<4>(x, x_stride, in, w, tile_rows, out, out_stride, t.data()); break;
                case 3: tile<3>(x, x_stride, in, w, tile_rows, out, out_stride, t.data()); break;
                case 2: tile<2>(x, x_stride, in, w, tile_rows, out, out_stride, t.data()); break;
                default: tile<1>(x, x_stride, in, w, tile_rows, out, out_stride, t.data()); break;
            }
        }
    });
}

template void lora_add_rows<float>(const float*, int64_t, int64_t, int64_t, const LoRAWeights* const*, float*,
                                   int64_t);
template void lora_add_rows<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, int64_t, const LoRAWeights* const*,
                                          at::BFloat16*, int64_t);

}  // namespace prefixserve
