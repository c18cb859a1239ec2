// The decoder layer's row-wise work in one pass each, where PyTorch takes several (a pass is a trip
// over [tokens, hidden] through memory): RMSNorm (and the residual add before it), rotary embedding
// of q and k in place, SiLU(gate) * up. Written over simd.h, compiled per variant, for float32 and
// bfloat16 rows (bf16: computed in float32, rounded to bf16 where the reference rounds: llama.py).
//
// Each output element is computed from its own row only, in an order fixed by the row, so a token's
// bits are the same in any batch. Against the PyTorch reference (llama.py): rotary and the residual
// add round exactly as it does in float32 (bf16: rotary's product, then one fused multiply-add, each
// rounded to bf16); RMSNorm's sum of squares runs in another order (W running sums and a fixed tree)
// and SiLU uses simd::exp, so those agree to rounding (a few float32 ulp, or one bf16 ulp), not bit
// for bit.
#include "rowwise.h"

#include "simd.h"

#include <ATen/Parallel.h>

#if PREFIXSERVE_SIMD_FUSED  // rotary rounds as PyTorch's addcmul_: one fused multiply-add
namespace prefixserve {

using simd::vf;
using simd::W;

namespace {

// Rows per task: enough work that a thread's start-up is paid back, and one task for a decode step.
int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(width, 1)); }

// The sum of x[j]^2 over a row of `width` values (a multiple of W): W running sums, a fixed tree.
template <typename T>
inline float sum_of_squares(const T* x, int64_t width) {
    vf sum = simd::zero();
    for (int64_t j = 0; j < width; j += W) {
        const vf v = simd::load(x + j);
        sum = simd::add(sum, simd::mul(v, v));
    }
    return simd::sum_lanes(sum);
}

// out = T(T(x * (1 / sqrt(mean(x^2) + eps))) * weight): each product rounded as the reference rounds it.
template <typename T>
inline void normalise_row(const T* x, const T* weight, int64_t width, float eps, T* out) {
    const float scale = 1.f / std::sqrt(sum_of_squares(x, width) / static_cast<float>(width) + eps);
    const vf s = simd::set1(scale);
    for (int64_t j = 0; j < width; j += W) {
        const vf normed = simd::round_to<T>(simd::mul(simd::load(x + j), s));
        simd::store(out + j, simd::mul(normed, simd::load(weight + j)));
    }
}

}  // namespace

template <typename T>
void rms_norm_rows(const T* x, int64_t rows, int64_t width, const T* weight, float eps, T* out) {
    at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) normalise_row(x + r * width, weight, width, eps, out + r * width);
    });
}

template <typename T>
void add_rms_norm_rows(T* x, const T* delta, int64_t rows, int64_t width, const T* weight, float eps, T* out) {
    at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            T* row = x + r * width;
            const T* d = delta + r * width;
            for (int64_t j = 0; j < width; j += W) simd::store(row + j, simd::add(simd::load(row + j), simd::load(d + j)));
            normalise_row(row, weight, width, eps, out + r * width);
        }
    });
}

template <typename T>
void rotate_heads_rows(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const T* cos,
                       const T* sin) {
    const int64_t half = head_dim / 2;
    at::parallel_for(0, rows, grain_rows(heads * head_dim), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T* c = cos + r * half;
            const T* s = sin + r * half;
            for (int64_t h = 0; h < heads; ++h) {
                T* x1 = x + r * row_stride + h * head_dim;
                T* x2 = x1 + half;
                for (int64_t j = 0; j < half; j += W) {
                    const vf a = simd::load(x1 + j), b = simd::load(x2 + j);
                    const vf cj = simd::load(c + j), sj = simd::load(s + j);
                    // x1 cos - x2 sin and x2 cos + x1 sin rounded as llama.py's rotate rounds them (a
                    // product, then PyTorch's addcmul_: one fused multiply-add).
                    simd::store(x1 + j, simd::fnmadd(b, sj, simd::round_to<T>(simd::mul(a, cj))));
                    simd::store(x2 + j, simd::fmadd(a, sj, simd::round_to<T>(simd::mul(b, cj))));
                }
            }
        }
    });
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t width, T* out) {
    const vf one = simd::set1(1.f);
    at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T* gate = gate_up + r * 2 * width;
            const T* up = gate + width;
            T* o = out + r * width;
            for (int64_t j = 0; j < width; j += W) {
                const vf g = simd::load(gate + j);
                // silu(g) = g / (1 + e^-g); e^-g overflows to inf for g < -88.7, giving -0 as it should.
                const vf silu = simd::div(g, simd::add(one, simd::exp(simd::sub(simd::zero(), g))));
                simd::store(o + j, simd::mul(simd::round_to<T>(silu), simd::load(up + j)));
            }
        }
    });
}

#define PREFIXSERVE_ROWWISE(T)                                                                              \
    template void rms_norm_rows<T>(const T*, int64_t, int64_t, const T*, float, T*);                        \
    template void add_rms_norm_rows<T>(T*, const T*, int64_t, int64_t, const T*, float, T*);                \
    template void rotate_heads_rows<T>(T*, int64_t, int64_t, int64_t, int64_t, const T*, const T*);         \
    template void silu_mul_rows<T>(const T*, int64_t, int64_t, T*);
PREFIXSERVE_ROWWISE(float)
PREFIXSERVE_ROWWISE(at::BFloat16)
#undef PREFIXSERVE_ROWWISE

}  // namespace prefixserve
#endif
