// The compiled kernels' entry points on raw pointers: module.cpp checks the tensors (shapes,
// dtypes, every block id of every range read) and calls these.
#pragma once

#include <cstdint>

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
// a row at position p reads keys [0, p + 1). out [rows, heads, head_dim].
template <typename T>
void causal_kernel(const Queries<T>& q, const PagedKV<T>& kv, const int64_t* query_start, const int64_t* seq_lens,
                   int64_t num_seqs, float scale, T* out);

}  // namespace prefixserve
