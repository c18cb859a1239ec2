// The decoder layer's row-wise float32 kernels (rowwise.cpp) on raw pointers; module.cpp checks the
// tensors and calls these. Built with AVX-512 only (elsewhere module.cpp binds none of them and the
// model keeps PyTorch's ops). Every width (hidden, intermediate, head_dim / 2) is a multiple of 16.
#pragma once

#include <cstdint>

namespace prefixserve {

#if defined(__AVX512F__)
// out[r] = RMSNorm(x[r]) * weight (x, out [rows, width]).
void rms_norm_rows(const float* x, int64_t rows, int64_t width, const float* weight, float eps, float* out);

// x[r] += delta[r] in place, then out[r] = RMSNorm(x[r]) * weight (x, delta, out [rows, width]).
void add_rms_norm_rows(float* x, const float* delta, int64_t rows, int64_t width, const float* weight, float eps,
                       float* out);

// The first `heads` heads of each row of x, rotated in place (rotate-half); cos, sin [rows, head_dim / 2].
void rotate_heads_rows(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const float* cos,
                       const float* sin);

// out[r] = silu(gate_up[r][0, width)) * gate_up[r][width, 2 width); out [rows, width].
void silu_mul_rows(const float* gate_up, int64_t rows, int64_t width, float* out);
#endif

}  // namespace prefixserve
