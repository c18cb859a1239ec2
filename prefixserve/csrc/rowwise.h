// The decoder layer's row-wise kernels (rowwise.cpp) on raw pointers, for float32 and bf16 rows (T);
// module.cpp checks the tensors and calls these through a variant's KernelTable. Built where the
// variant has a fused multiply-add (rotary must round as PyTorch's addcmul_ does): every variant but
// portable, where the table holds none and the model keeps PyTorch's ops. Every width (hidden,
// intermediate, head_dim / 2) is a multiple of 16.
#pragma once

#include <cstdint>

namespace prefixserve {

// out[r] = RMSNorm(x[r]) * weight (x, out [rows, width]).
template <typename T>
void rms_norm_rows(const T* x, int64_t rows, int64_t width, const T* weight, float eps, T* out);

// x[r] += delta[r] in place, then out[r] = RMSNorm(x[r]) * weight (x, delta, out [rows, width]).
template <typename T>
void add_rms_norm_rows(T* x, const T* delta, int64_t rows, int64_t width, const T* weight, float eps, T* out);

// The first `heads` heads of each row of x, rotated in place (rotate-half); cos, sin [rows, head_dim / 2].
template <typename T>
void rotate_heads_rows(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const T* cos,
                       const T* sin);

// out[r] = silu(gate_up[r][0, width)) * gate_up[r][width, 2 width); out [rows, width].
template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t width, T* out);

}  // namespace prefixserve
