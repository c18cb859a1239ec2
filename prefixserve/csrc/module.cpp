// prefixserve._C: the binding of the compiled CPU kernels. Built once, for the baseline of the
// architecture; the kernels themselves come in variants (prefixserve._kernels_<variant>, one build of
// the kernel sources per instruction set, see setup.py), each a KernelTable. Every function here
// takes the table to run as its first argument (prefixserve.model.kernels binds the one in use), so
// several variants can serve one process (the tests compare them).
//
//   paged_causal   every row of a step (prefill chunks and decodes), a row at position p over keys
//                  [0, p + 1) (or its sliding window's last keys), read in place from the paged KV cache,
//                  each row's bits its own whatever else is in the call. Kernel: paged_causal.cpp.
//                  Reference: model/attention/cascade.py (float32) and invariant.py (bf16).
//   rms_norm, add_rms_norm_, rotate_heads_, silu_mul
//                  the decoder layer's row-wise work in float32 or bf16, one pass each (variants with
//                  a fused multiply-add: all but portable).
//                  Kernels: rowwise.cpp. Reference: llama.py's RMSNorm, rotate and MLP.
//   quantized_matmul, dequantize    weights kept quantized (quantized_matmul.cpp)
//   DecoderStack   every decoder layer of a step in one call, through these same kernels (decoder_stack.cpp)
//   LoRASlots      adapters installed once; each adapted projection's rows updated by their own (lora_slots.cpp)
//
// This file checks what a caller hands in (shapes, dtypes, every block id of every range read: a bad
// table is an error, never a stray read) and dispatches on the dtype and the variant. The kernels run
// with the GIL released, as PyTorch's own ops do: the engine thread's step must leave the server's
// event loop free to answer /health and stream tokens.
#include <torch/extension.h>

#include "binding.h"

namespace prefixserve::binding {

// The KernelTable in a variant module's `table` capsule, checked for its layout version.
const KernelTable& table_of(const py::object& capsule) {
    void* pointer = PyCapsule_GetPointer(capsule.ptr(), prefixserve::KERNEL_TABLE_CAPSULE);
    if (pointer == nullptr) throw py::error_already_set();
    const auto& table = *static_cast<const KernelTable*>(pointer);
    TORCH_CHECK(table.version == prefixserve::KERNEL_TABLE_VERSION, "kernel variant ", table.variant,
                " was built for table version ", table.version, ", this binding reads version ",
                prefixserve::KERNEL_TABLE_VERSION, ": reinstall with `pip install -e .`");
    return table;
}

// Every block holding positions [first, seq_len) of sequence i must exist: first is 0, or with a window
// the lowest key its rows read (the blocks below may be released, -1).
void check_blocks(const torch::Tensor& tables, int64_t i, int64_t first, int64_t seq_len, int64_t block_size,
                  int64_t num_blocks) {
    TORCH_CHECK(seq_len == 0 || (seq_len - 1) / block_size < tables.size(1),
                "key range [0, seq_len) outside the block table");
    const int64_t* table = tables.data_ptr<int64_t>() + i * tables.stride(0);
    for (int64_t b = first / block_size; b * block_size < seq_len; ++b) {
        TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block id out of range");
    }
}

// A quantized weight's tensors (quantized.h), checked: codes [rows, cols * bits / 8] bytes; scales and
// offsets (or an empty tensor for none) [rows, cols / group_size] float16 or float32, or Q4_K's (Q5_K's)
// bytes: scales uint8 [rows, groups + groups / 2] (6-bit scales, then float16 d and dmin per 8 groups),
// offsets uint8 [rows, groups] (6-bit minimums), or Q6_K's (Q3_K's): int8 scales per 16 values, then d, or
// Q2_K's: a byte per 16 values (4-bit scale and minimum), then d and dmin. levels: int8 [16] (4-bit codes'
// values, IQ4_NL and IQ4_XS) or an empty tensor; with them, scales float16 (IQ4_NL) or IQ4_XS's bytes: int8
// scales per group, then float16 d per 8 groups.
prefixserve::QuantizedWeight quantized_weight_of(const torch::Tensor& codes, const torch::Tensor& scales,
                                                 const torch::Tensor& offsets, int64_t bits, int64_t group_size,
                                                 int64_t zero_point, const torch::Tensor& levels) {
    TORCH_CHECK((bits == 32 || bits == 8 || (bits >= 2 && bits <= 6)) && group_size == 32,
                "bits must be 32 (float32 values), 8, 6, 5, 4, 3 or 2, group_size 32");
    TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.is_contiguous() && codes.element_size() == 1,
                "codes must be a contiguous 2-D CPU tensor of bytes");
    if (bits == 32) {  // a float32 weight, its values' bytes: nothing to scale, offset or look up
        TORCH_CHECK(reinterpret_cast<uintptr_t>(codes.data_ptr()) % alignof(float) == 0 && codes.size(1) % 4 == 0 &&
                        (codes.size(1) / 4) % group_size == 0,
                    "a float32 weight's codes must be its values' bytes [rows, cols * 4], cols a multiple of 32");
        TORCH_CHECK(scales.numel() == 0 && offsets.numel() == 0 && levels.numel() == 0 && zero_point == 0,
                    "a float32 weight (bits 32) takes no scales, offsets, levels or zero point: pass empty tensors "
                    "and 0");
        return {codes.data_ptr<uint8_t>(), 32, 0, codes.size(0), codes.size(1) / 4, group_size, nullptr, nullptr,
                false};
    }
    TORCH_CHECK(bits != 8 || zero_point == 0, "8-bit codes are int8 with zero_point 0");
    const int64_t rows = codes.size(0), cols = codes.size(1) * 8 / bits;
    TORCH_CHECK(cols % group_size == 0 && cols * bits == codes.size(1) * 8, "the row must be whole groups of 32 values");
    const int64_t groups = cols / group_size;
    const bool has_offsets = offsets.numel() > 0;
    auto is_matrix = [rows](const torch::Tensor& values, int64_t width) {
        return values.device().is_cpu() && values.is_contiguous() && values.dim() == 2 && values.size(0) == rows &&
               values.size(1) == width;
    };
    const bool has_levels = levels.numel() > 0;
    TORCH_CHECK(!has_levels || (bits == 4 && zero_point == 0 && !has_offsets && levels.device().is_cpu() &&
                                levels.scalar_type() == torch::kInt8 && levels.dim() == 1 && levels.size(0) == 16 &&
                                levels.is_contiguous()),
                "levels must be a contiguous int8 tensor of 16 values, for 4-bit codes with zero_point 0 and no "
                "offsets (IQ4_NL, IQ4_XS)");
    const bool int8_scales = has_levels && scales.scalar_type() == torch::kUInt8;
    const bool k_scales = scales.scalar_type() == torch::kUInt8 && (bits == 4 || bits == 5) && !int8_scales;
    if (int8_scales) {
        TORCH_CHECK(groups % 8 == 0 && is_matrix(scales, groups + groups / 4),
                    "IQ4_XS scales must be uint8 [rows, groups + groups / 4] (int8 scales, then float16 d per 256 "
                    "values), in whole super-blocks of 256 values");
    } else if (bits == 2) {
        TORCH_CHECK(zero_point == 0 && groups % 8 == 0 && scales.scalar_type() == torch::kUInt8 &&
                        is_matrix(scales, 2 * groups + groups / 2) && !has_offsets,
                    "Q2_K scales must be uint8 [rows, cols / 16 + cols / 64] (a 4-bit scale and minimum per 16 "
                    "values, then float16 d and dmin per 256 values), without offsets, zero_point 0, in whole "
                    "super-blocks of 256 values");
    } else if (bits == 6 || bits == 3) {
        const char* kind = bits == 6 ? "Q6_K" : "Q3_K";
        const int64_t kind_zero_point = bits == 6 ? 32 : 4;
        TORCH_CHECK(zero_point == kind_zero_point && groups % 8 == 0 && scales.scalar_type() == torch::kUInt8 &&
                        is_matrix(scales, 2 * groups + groups / 4) && !has_offsets,
                    kind, " scales must be uint8 [rows, cols / 16 + cols / 128] (int8 scales, then float16 d per "
                    "256 values), without offsets, zero_point ", kind_zero_point, ", in whole super-blocks of 256 values");
    } else if (k_scales) {
        TORCH_CHECK(zero_point == 0 && groups % 8 == 0 && is_matrix(scales, groups + groups / 2) &&
                        has_offsets && offsets.scalar_type() == torch::kUInt8 && is_matrix(offsets, groups),
                    "Q4_K (Q5_K) scales must be uint8 [rows, groups * 3 / 2] and its minimums uint8 [rows, groups], "
                    "for 4-bit (5-bit) codes in whole super-blocks of 256 values");
    } else {
        TORCH_CHECK(scales.scalar_type() == torch::kFloat16 || scales.scalar_type() == torch::kFloat32,
                    "scales must be float16 or float32 (or Q4_K's bytes)");
        for (const torch::Tensor* values : {&scales, &offsets}) {
            if (values == &offsets && !has_offsets) continue;
            TORCH_CHECK(values->scalar_type() == scales.scalar_type() && is_matrix(*values, groups),
                        "scales and offsets must be contiguous [rows, cols / group_size] tensors of one dtype");
        }
    }
    // The kernels may fold the zero point into the offset (quantized_codes.h): offset - zero_point * scale is exact
    // where the weight has no offsets and the zero point is a power of two (every GGUF kind's is: 4, 8, 16, 32).
    TORCH_CHECK(zero_point == 0 || (!has_offsets && zero_point > 0 && (zero_point & (zero_point - 1)) == 0),
                "zero_point must be 0, or a power of two for a weight without offsets");
    return {codes.data_ptr<uint8_t>(), static_cast<int32_t>(bits), static_cast<int32_t>(zero_point), rows, cols,
            group_size, scales.data_ptr(), has_offsets ? offsets.data_ptr() : nullptr,
            scales.scalar_type() == torch::kFloat16, k_scales,
            has_levels ? levels.data_ptr<int8_t>() : nullptr, int8_scales};
}

}  // namespace prefixserve::binding

namespace {

using namespace prefixserve::binding;

using prefixserve::KernelTable;
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


template <typename T>
Queries<T> queries_of(const torch::Tensor& q) {
    return {q.data_ptr<T>(), q.stride(0), q.stride(1), q.size(1)};
}

template <typename T>
PagedKV<T> paged_kv_of(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& tables) {
    return {k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.size(1), k_cache.size(2), k_cache.size(3),
            tables.data_ptr<int64_t>(), tables.stride(0)};
}

torch::Tensor paged_causal(const py::object& capsule, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& tables, const torch::Tensor& query_start, const torch::Tensor& seq_lens,
                           double scale, int64_t window, double softcap) {
    const KernelTable& kernels = table_of(capsule);
    check_inputs(q, k_cache, v_cache, {&tables, &query_start, &seq_lens});
    const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), head_dim = q.size(2);
    const int64_t block_size = k_cache.size(1);
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && query_start.size(0) == num_seqs + 1,
                "one block table and seq_len per sequence, num_seqs + 1 query starts");
    const int64_t* start = query_start.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    TORCH_CHECK(start[0] == 0 && start[num_seqs] == q.size(0), "query starts must cover q's rows");
    TORCH_CHECK(window >= 0, "a sliding window is a positive number of keys, or 0 for none");
    TORCH_CHECK(softcap >= 0, "an attention soft cap is a positive number, or 0 for none");
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t query_len = start[i + 1] - start[i];
        TORCH_CHECK(query_len >= 0 && lens[i] >= query_len, "each sequence needs 0 <= query_len <= seq_len");
        const int64_t first = window > 0 ? std::max<int64_t>(0, lens[i] - query_len + 1 - window) : 0;
        check_blocks(tables, i, first, lens[i], block_size, k_cache.size(0));
    }
    auto out = torch::empty({q.size(0), num_heads, head_dim}, q.options());
    py::gil_scoped_release released;  // a long prefill must not stall the server's event loop
    AT_DISPATCH_SWITCH(q.scalar_type(), "paged_causal",
        AT_DISPATCH_CASE(torch::kFloat32, [&] {
            kernels.causal_float32(queries_of<float>(q), paged_kv_of<float>(k_cache, v_cache, tables), start, lens,
                                   num_seqs, static_cast<float>(scale), window, static_cast<float>(softcap),
                                   out.data_ptr<float>());
        })
        AT_DISPATCH_CASE(torch::kBFloat16, [&] {
            kernels.causal_bfloat16(queries_of<at::BFloat16>(q), paged_kv_of<at::BFloat16>(k_cache, v_cache, tables),
                                    start, lens, num_seqs, static_cast<float>(scale), window, static_cast<float>(softcap),
                                    out.data_ptr<at::BFloat16>());
        }));
    return out;
}

void check_rows(const torch::Tensor& x, const char* name) {
    TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) &&
                    x.dim() == 2 && x.is_contiguous(),
                name, " must be a contiguous float32 or bfloat16 CPU tensor [rows, width]");
    TORCH_CHECK(x.size(1) % 16 == 0, name, "'s width must be a multiple of 16");
}

void check_weight(const torch::Tensor& weight, const torch::Tensor& x) {
    TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == x.scalar_type() && weight.dim() == 1 &&
                    weight.is_contiguous() && weight.size(0) == x.size(1),
                "weight must be a contiguous CPU tensor of x's dtype and width");
}

// Calls body(the variant's row-wise kernels for T, a T* of each tensor) for x's dtype.
template <typename Body>
void with_rowwise(const KernelTable& kernels, const torch::Tensor& x, Body&& body) {
    if (x.scalar_type() == torch::kBFloat16) {
        TORCH_CHECK(kernels.rowwise_bfloat16.silu_mul != nullptr, "kernel variant ", kernels.variant,
                    " has no row-wise kernels");
        py::gil_scoped_release released;
        body(kernels.rowwise_bfloat16, [](const torch::Tensor& t) { return t.data_ptr<at::BFloat16>(); });
    } else {
        TORCH_CHECK(kernels.rowwise_float32.silu_mul != nullptr, "kernel variant ", kernels.variant,
                    " has no row-wise kernels");
        py::gil_scoped_release released;
        body(kernels.rowwise_float32, [](const torch::Tensor& t) { return t.data_ptr<float>(); });
    }
}

torch::Tensor rms_norm(const py::object& capsule, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
    const KernelTable& kernels = table_of(capsule);
    check_rows(x, "x");
    check_weight(weight, x);
    auto out = torch::empty_like(x);
    with_rowwise(kernels, x, [&](const auto& rowwise, auto pointer) {
        rowwise.rms_norm(pointer(x), x.size(0), x.size(1), pointer(weight), static_cast<float>(eps), pointer(out));
    });
    return out;
}

torch::Tensor add_rms_norm_(const py::object& capsule, torch::Tensor& x, const torch::Tensor& delta,
                            const torch::Tensor& weight, double eps) {
    const KernelTable& kernels = table_of(capsule);
    check_rows(x, "x");
    check_rows(delta, "delta");
    TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
                "delta must have x's shape and dtype");
    check_weight(weight, x);
    auto out = torch::empty_like(x);
    with_rowwise(kernels, x, [&](const auto& rowwise, auto pointer) {
        rowwise.add_rms_norm(pointer(x), pointer(delta), x.size(0), x.size(1), pointer(weight), static_cast<float>(eps),
                             pointer(out));
    });
    return out;
}

void rotate_heads_(const py::object& capsule, torch::Tensor& x, int64_t heads, int64_t head_dim,
                   const torch::Tensor& cos, const torch::Tensor& sin) {
    const KernelTable& kernels = table_of(capsule);
    TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) &&
                    x.dim() == 2 && x.stride(1) == 1,
                "x must be a float32 or bfloat16 CPU tensor [rows, columns] with contiguous columns");
    TORCH_CHECK(heads >= 0 && head_dim > 0 && head_dim % 32 == 0 && heads * head_dim <= x.size(1),
                "the rotated heads must fit in x's columns, head_dim a multiple of 32");
    TORCH_CHECK(x.size(0) <= 1 || x.stride(0) >= x.size(1),
                "rows of x must not overlap (rows are rotated in parallel)");
    for (const torch::Tensor* table : {&cos, &sin}) {
        TORCH_CHECK(table->device().is_cpu() && table->scalar_type() == x.scalar_type() && table->is_contiguous() &&
                        table->numel() == x.size(0) * (head_dim / 2),
                    "cos and sin must be contiguous, of x's dtype, with head_dim / 2 values per row of x");
    }
    with_rowwise(kernels, x, [&](const auto& rowwise, auto pointer) {
        rowwise.rotate_heads(pointer(x), x.size(0), x.stride(0), heads, head_dim, pointer(cos), pointer(sin));
    });
}

torch::Tensor silu_mul(const py::object& capsule, const torch::Tensor& gate_up) {
    const KernelTable& kernels = table_of(capsule);
    check_rows(gate_up, "gate_up");
    TORCH_CHECK(gate_up.size(1) % 32 == 0, "gate_up's width must be twice a multiple of 16");
    const int64_t width = gate_up.size(1) / 2;
    auto out = torch::empty({gate_up.size(0), width}, gate_up.options());
    with_rowwise(kernels, gate_up, [&](const auto& rowwise, auto pointer) {
        rowwise.silu_mul(pointer(gate_up), gate_up.size(0), width, pointer(out));
    });
    return out;
}


const KernelTable& quantized_kernels(const py::object& capsule) {
    const KernelTable& kernels = table_of(capsule);
    TORCH_CHECK(kernels.quantized_matmul != nullptr, "kernel variant ", kernels.variant, " has no quantized matmul");
    return kernels;
}

// x [num_rows, cols] float32 (rows may be strided) times the quantized weight: out [num_rows, rows].
torch::Tensor quantized_matmul(const py::object& capsule, const torch::Tensor& x, const torch::Tensor& codes,
                               const torch::Tensor& scales, const torch::Tensor& offsets, int64_t bits,
                               int64_t group_size, int64_t zero_point, const torch::Tensor& levels,
                               const c10::optional<torch::Tensor>& bias) {
    const KernelTable& kernels = quantized_kernels(capsule);
    const auto weight = quantized_weight_of(codes, scales, offsets, bits, group_size, zero_point, levels);
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1 &&
                    x.size(1) == weight.cols,
                "x must be a float32 CPU tensor [rows, in_features] with contiguous rows");
    if (bias.has_value()) {
        TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->dim() == 1 &&
                        bias->size(0) == weight.rows,
                    "bias must be a contiguous float32 tensor [out_features]");
    }
    auto out = torch::empty({x.size(0), weight.rows}, x.options());
    const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    py::gil_scoped_release released;
    kernels.quantized_matmul(weight, x.data_ptr<float>(), x.size(0), x.stride(0), bias_data, out.data_ptr<float>(),
                             weight.rows);
    return out;
}

// The weight's rows [first, first + count) decoded to float32, as the matmul decodes them.
torch::Tensor dequantize(const py::object& capsule, const torch::Tensor& codes, const torch::Tensor& scales,
                         const torch::Tensor& offsets, int64_t bits, int64_t group_size, int64_t zero_point,
                         const torch::Tensor& levels) {
    const KernelTable& kernels = quantized_kernels(capsule);
    const auto weight = quantized_weight_of(codes, scales, offsets, bits, group_size, zero_point, levels);
    auto out = torch::empty({weight.rows, weight.cols}, torch::kFloat32);
    py::gil_scoped_release released;
    kernels.dequantize_rows(weight, 0, weight.rows, out.data_ptr<float>());
    return out;
}

int64_t multiply_add_flops(const py::object& capsule, int64_t iterations) {
    TORCH_CHECK(iterations > 0, "iterations must be positive");
    const KernelTable& kernels = table_of(capsule);
    py::gil_scoped_release released;
    return kernels.multiply_add_flops(iterations);
}

// What a variant's table says of itself, for prefixserve.model.kernels.
py::dict describe(const py::object& capsule) {
    const KernelTable& kernels = table_of(capsule);
    py::dict info;
    info["variant"] = kernels.variant;
    info["backend"] = kernels.backend;
    info["lanes"] = kernels.lanes;
    info["bf16_pairs"] = kernels.bf16_pairs;
    info["rowwise"] = kernels.rowwise_float32.silu_mul != nullptr;
    return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "prefixserve's compiled CPU kernels (the pure-PyTorch paths in prefixserve.model are their reference)";
    m.def("paged_causal", &paged_causal, "causal attention of every row of a step, each row alike in any batch",
          py::arg("table"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"),
          py::arg("query_start"), py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
          py::arg("softcap") = 0.0);
    m.def("rms_norm", &rms_norm, "RMSNorm of each row of x [rows, width] (float32 or bf16), times weight");
    m.def("add_rms_norm_", &add_rms_norm_, "x += delta in place, then RMSNorm(x) * weight");
    m.def("rotate_heads_", &rotate_heads_, "rotate the first heads of each row of x in place (rotate-half)");
    m.def("silu_mul", &silu_mul, "silu(gate) * up of gate_up [rows, 2 width]");
    m.def("quantized_matmul", &quantized_matmul, "x times a weight kept quantized (csrc/quantized.h)");
    m.def("dequantize", &dequantize, "a quantized weight decoded to float32 as quantized_matmul decodes it");
    m.def("describe", &describe, "what a variant's kernel table says of itself");
    m.def("multiply_add_flops", &multiply_add_flops, "run the variant's multiply-add peak loop; its flops");
    bind_decoder_stack(m);
    bind_lora_slots(m);
}
