// Decode attention read in place from the paged cache: each decode row's group of query heads over
// keys [first, last) of its sequence, a tile at a time (attention_tiles.h). Returns the float32
// log-sum-exp beside the output, the pair the cascade's merge takes. Reference: attention.py's
// _attend_decodes.
#include "attention_tiles.h"
#include "kernels.h"

#include <ATen/Parallel.h>

namespace prefixserve {

template <typename T>
void decode_kernel(const Queries<T>& q, const PagedKV<T>& kv, const int64_t* rows, const int64_t* first,
                   const int64_t* last, int64_t num_decodes, float scale, T* out, float* lse) {
    const int64_t num_kv_heads = kv.num_kv_heads, head_dim = kv.head_dim;
    const int64_t group = q.num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive positions
    const int64_t shift = log2_exact(kv.block_size);
    const bool vectorized = VECTOR_PATH && head_dim % 16 == 0;
    at::parallel_for(0, num_decodes * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
        Scratch scratch(1, group, head_dim);
        for (int64_t item = begin; item < end; ++item) {
            const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
            load_query(q.data + rows[i] * q.row_stride, q.head_stride, h, group, head_dim, scale, scratch.query.data(),
                       scratch.query_bits.data());
            const Blocks blocks{kv.tables + i * kv.table_stride, shift, kv.block_size - 1};
            attend_row(scratch.query.data(), scratch.query_bits.data(), scale, first[i], last[i], blocks, kv.keys,
                       kv.values, slot_stride, h, group, head_dim, vectorized, scratch.scores.data(),
                       scratch.running_max.data(), scratch.running_sum.data(), scratch.acc.data());
            finish(scratch.acc.data(), scratch.running_max.data(), scratch.running_sum.data(), group, head_dim,
                   out + (i * q.num_heads + h * group) * head_dim, lse + i * q.num_heads + h * group);
        }
    });
}

template void decode_kernel<float>(const Queries<float>&, const PagedKV<float>&, const int64_t*, const int64_t*,
                                   const int64_t*, int64_t, float, float*, float*);
template void decode_kernel<at::BFloat16>(const Queries<at::BFloat16>&, const PagedKV<at::BFloat16>&, const int64_t*,
                                          const int64_t*, const int64_t*, int64_t, float, at::BFloat16*, float*);

}  // namespace prefixserve
