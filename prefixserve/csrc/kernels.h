// What one compiled variant (a build of the kernel sources for one instruction set) hands to the
// binding module (module.cpp): its entry points on raw pointers, in a table of plain function
// pointers. module.cpp checks the tensors (shapes, dtypes, every block id of every range read) and
// calls through the table; Python picks the table (prefixserve.model.kernels).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "lora.h"
#include "quantized.h"

namespace prefixserve {

// The paged cache of one layer, [blocks, block_size, kv_heads, head_dim] for keys and values alike,
// with one block table row per sequence of the call.
template <typename T>
struct PagedKV {
    const T* keys;
    const T* values;
    int64_t block_size, num_kv_heads, head_dim;
    const int64_t* tables;
    int64_t table_stride;
};

// q: [rows, heads, head_dim] with head_dim contiguous.
template <typename T>
struct Queries {
    const T* data;
    int64_t row_stride, head_stride, num_heads;
};

// Sequence i's rows query_start[i] .. query_start[i + 1] are its last positions, up to seq_lens[i];
// a row at position p reads keys [0, p + 1), or with a sliding `window` > 0 keys [p + 1 - window, p + 1)
// (no key below the lowest of those is read: its block may be gone). A `softcap` > 0 caps each score s
// at softcap tanh(s / softcap) before the softmax (Gemma 2). out [rows, heads, head_dim].
template <typename T>
void causal_kernel(const Queries<T>& q, const PagedKV<T>& kv, const int64_t* query_start, const int64_t* seq_lens,
                   int64_t num_seqs, float scale, int64_t window, float softcap, T* out);

template <typename T>
using CausalKernel = void (*)(const Queries<T>&, const PagedKV<T>&, const int64_t*, const int64_t*, int64_t, float,
                              int64_t, float, T*);

template <typename T>
struct RowwiseKernels {
    void (*rms_norm)(const T*, int64_t, int64_t, const T*, float, T*);
    void (*add_rms_norm)(T*, const T*, int64_t, int64_t, const T*, float, T*);
    void (*rotate_heads)(T*, int64_t, int64_t, int64_t, int64_t, const T*, const T*);
    void (*silu_mul)(const T*, int64_t, int64_t, T*);
};

// Bumped whenever the table's layout or a kernel's contract changes: module.cpp refuses a variant
// built against another (a stale build left beside a new one).
constexpr uint32_t KERNEL_TABLE_VERSION = 7;
constexpr const char* KERNEL_TABLE_CAPSULE = "prefixserve.KernelTable";

struct KernelTable {
    uint32_t version;
    const char* variant;  // the name setup.py built it under ("avx2", ...)
    const char* backend;  // simd.h's backend ("avx512", "avx2", "neon", "portable")
    int32_t lanes;        // float32 lanes of a vector
    bool bf16_pairs;      // bf16 scores by the dot-product instruction
    CausalKernel<float> causal_float32;
    CausalKernel<at::BFloat16> causal_bfloat16;
    // Row-wise kernels (rowwise.h) per dtype; null where the variant has none.
    RowwiseKernels<float> rowwise_float32;
    RowwiseKernels<at::BFloat16> rowwise_bfloat16;
    // The variant's float32 multiply-add peak (peak.h): flops done in `iterations` rounds.
    int64_t (*multiply_add_flops)(int64_t iterations);
    // Weights kept quantized (quantized.h), float32 activations.
    void (*quantized_matmul)(const QuantizedWeight&, const float*, int64_t, int64_t, const float*, float*, int64_t);
    void (*dequantize_rows)(const QuantizedWeight&, int64_t, int64_t, float*);
    // LoRA adapters' updates, each row its own adapter's (lora.h); every variant has them.
    void (*lora_float32)(const float*, int64_t, int64_t, int64_t, const LoRAWeights* const*, float*, int64_t);
    void (*lora_bfloat16)(const at::BFloat16*, int64_t, int64_t, int64_t, const LoRAWeights* const*, at::BFloat16*,
                          int64_t);
};

}  // namespace prefixserve
