// prefixserve._C: the compiled CPU attention kernels, read in place from the paged KV cache (no gather).
//
//   paged_causal   every row of a step (prefill chunks and decodes), a row at position p over keys
//                  [0, p + 1), each row's bits its own whatever else is in the call.
//                  Kernel: paged_causal.cpp. Reference: attention.py's plan path (float32) and
//                  invariant_attention.py (bf16).
//
// This file checks what a caller hands in (shapes, dtypes, every block id of every range read: a bad
// table is an error, never a stray read) and dispatches on the dtype.
#include <torch/extension.h>

#include "kernels.h"

namespace {

using prefixserve::PagedKV;
using prefixserve::Queries;

void check_inputs(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  std::initializer_list<const torch::Tensor*> indices) {
    TORCH_CHECK(q.dim() == 3, "q must be [tokens, heads, head_dim]");
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                "k_cache and v_cache must both be [blocks, block_size, kv_heads, head_dim]");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                "q and the caches must share a dtype");
    TORCH_CHECK(q.stride(2) == 1, "q's head_dim must be contiguous");
    TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "the kernels run on CPU tensors");
    for (const torch::Tensor* index : indices) {
        TORCH_CHECK(index->scalar_type() == torch::kInt64 && index->is_contiguous(), "index tensors must be contiguous int64");
    }
    TORCH_CHECK(k_cache.size(3) == q.size(2), "q and the caches differ in head_dim");
    TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of KV heads");
    TORCH_CHECK(k_cache.size(1) > 0 && (k_cache.size(1) & (k_cache.size(1) - 1)) == 0, "block_size must be a power of two");
}

// Every block holding positions [0, seq_len) of sequence i must exist.
void check_blocks(const torch::Tensor& tables, int64_t i, int64_t seq_len, int64_t block_size, int64_t num_blocks) {
    TORCH_CHECK(seq_len == 0 || (seq_len - 1) / block_size < tables.size(1),
                "key range [0, seq_len) outside the block table");
    const int64_t* table = tables.data_ptr<int64_t>() + i * tables.stride(0);
    for (int64_t b = 0; b * block_size < seq_len; ++b) {
        TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block id out of range");
    }
}

template <typename T>
Queries<T> queries_of(const torch::Tensor& q) {
    return {q.data_ptr<T>(), q.stride(0), q.stride(1), q.size(1)};
}

template <typename T>
PagedKV<T> paged_kv_of(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& tables) {
    return {k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.size(1), k_cache.size(2), k_cache.size(3),
            tables.data_ptr<int64_t>(), tables.stride(0)};
}

torch::Tensor paged_causal(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& tables, const torch::Tensor& query_start, const torch::Tensor& seq_lens,
                           double scale) {
    check_inputs(q, k_cache, v_cache, {&tables, &query_start, &seq_lens});
    const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), head_dim = q.size(2);
    const int64_t block_size = k_cache.size(1);
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && query_start.size(0) == num_seqs + 1,
                "one block table and seq_len per sequence, num_seqs + 1 query starts");
    const int64_t* start = query_start.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    TORCH_CHECK(start[0] == 0 && start[num_seqs] == q.size(0), "query starts must cover q's rows");
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t query_len = start[i + 1] - start[i];
        TORCH_CHECK(query_len >= 0 && lens[i] >= query_len, "each sequence needs 0 <= query_len <= seq_len");
        check_blocks(tables, i, lens[i], block_size, k_cache.size(0));
    }
    auto out = torch::empty({q.size(0), num_heads, head_dim}, q.options());
    AT_DISPATCH_SWITCH(q.scalar_type(), "paged_causal",
        AT_DISPATCH_CASE(torch::kFloat32, [&] {
            prefixserve::causal_kernel<float>(queries_of<float>(q), paged_kv_of<float>(k_cache, v_cache, tables), start,
                                              lens, num_seqs, static_cast<float>(scale), out.data_ptr<float>());
        })
        AT_DISPATCH_CASE(torch::kBFloat16, [&] {
            prefixserve::causal_kernel<at::BFloat16>(
                queries_of<at::BFloat16>(q), paged_kv_of<at::BFloat16>(k_cache, v_cache, tables), start, lens, num_seqs,
                static_cast<float>(scale), out.data_ptr<at::BFloat16>());
        }));
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "prefixserve's compiled CPU kernels (the pure-PyTorch paths in prefixserve.model are their reference)";
    m.def("paged_causal", &paged_causal, "causal attention of every row of a step, each row alike in any batch");
}
