// The decoder layer's row-wise float32 kernels (rowwise.cpp) on raw pointers; module.cpp checks the
// tensors and calls these through a variant's KernelTable. Built where the variant has a fused
// multiply-add (rotary must round as PyTorch's addcmul_ does): every variant but portable, where
// the table holds none and the model keeps PyTorch's ops. Every width (hidden, intermediate,
// head_dim / 2) is a multiple of 16.
#pragma once

#include <cstdint>

namespace prefixserve {

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

}  // namespace prefixserve
