// prefixserve._C.DecoderStack: every decoder layer of a step in one call, for models whose projections are
// kept quantized (prefixserve.model.decoder_stack says which). A batch-1 decode step of SmolLM2 makes about
// 400 calls from Python into the kernels (five projections' worth of matmuls, norms, rotary, the KV write
// and attention per layer, 30 layers); each costs a few microseconds of Python around a kernel of tens.
// Here the same kernels run in the same order on the same operands, through the same variant's table:
//
//   h = rms_norm(x)                 qkv = h Wqkv             rotate q and k heads of qkv in place
//   write k, v to their slots       a = paged_causal(q)      x += a Wo, h = rms_norm(x)   (add_rms_norm)
//   g = silu_mul(h Wgate_up)        x += g Wdown
//
// each projection followed, where the step serves LoRA adapters, by its rows' adapters' updates (lora.h:
// lora/step.py adds them after the same projections, through the same kernel),
// so every bit equals llama.py's layer-by-layer path (tests/test_model_decoder_stack.py checks it), and a
// row's bits stay its own whatever else is in the step. Everything Python hands in is checked first, as
// module.cpp checks each kernel's arguments: every slot written and every block read exists.
#include "binding.h"
#include "lora_slots.h"

#include <cstring>
#include <vector>

namespace prefixserve::binding {
namespace {

// One projection: the weight's row blocks (a GGUF may mix layouts in a fused projection), each written
// to its own columns of the output, and an optional float32 bias.
struct Projection {
    std::vector<QuantizedWeight> parts;
    int64_t in_features = 0, out_features = 0;
    const float* bias = nullptr;
};

struct Layer {
    const float* input_norm;
    const float* post_norm;
    float input_eps, post_eps;
    Projection qkv, o, gate_up, down;
};

class DecoderStack {
  public:
    DecoderStack(const py::object& capsule, const py::list& layers, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, int64_t hidden, int64_t intermediate, double scale)
        : capsule_(capsule), kernels_(&table_of(capsule)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
          head_dim_(head_dim), hidden_(hidden), intermediate_(intermediate), scale_(static_cast<float>(scale)) {
        TORCH_CHECK(kernels_->quantized_matmul != nullptr && kernels_->rowwise_float32.silu_mul != nullptr,
                    "kernel variant ", kernels_->variant, " has no quantized matmul or row-wise kernels");
        TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                    "heads must be a positive multiple of KV heads");
        TORCH_CHECK(head_dim > 0 && head_dim % 32 == 0 && hidden % 16 == 0 && intermediate % 16 == 0,
                    "head_dim must be a multiple of 32, hidden and intermediate sizes of 16");
        for (const auto& item : layers) {
            const auto spec = item.cast<py::tuple>();
            TORCH_CHECK(spec.size() == 8,
                        "a layer is (input_norm, input_eps, qkv, o, post_norm, post_eps, gate_up, down)");
            Layer layer;
            layer.input_norm = norm_weight(spec[0].cast<torch::Tensor>());
            layer.input_eps = spec[1].cast<float>();
            layer.post_norm = norm_weight(spec[4].cast<torch::Tensor>());
            layer.post_eps = spec[5].cast<float>();
            const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
            layer.qkv = projection(spec[2], hidden, q_size + 2 * kv_size);
            layer.o = projection(spec[3], q_size, hidden);
            layer.gate_up = projection(spec[6], hidden, 2 * intermediate);
            layer.down = projection(spec[7], intermediate, hidden);
            layers_.push_back(layer);
        }
    }

    // x [rows, hidden] float32, the step's residual stream, updated in place through every layer (and
    // returned); cos, sin [rows, head_dim / 2]; one K and one V cache per layer; the step's attention
    // metadata as paged_causal takes it, and the slot each row's K/V is written to.
    torch::Tensor run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                      const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                      const torch::Tensor& tables, const torch::Tensor& query_start, const torch::Tensor& seq_lens,
                      const torch::Tensor& slot_mapping, const py::object& lora,
                      const c10::optional<torch::Tensor>& slot_of_row) {
        TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() &&
                        x.size(1) == hidden_,
                    "x must be a contiguous float32 CPU tensor [rows, hidden]");
        const int64_t rows = x.size(0);
        for (const torch::Tensor* table : {&cos, &sin}) {
            TORCH_CHECK(table->device().is_cpu() && table->scalar_type() == torch::kFloat32 && table->is_contiguous() &&
                            table->numel() == rows * (head_dim_ / 2),
                        "cos and sin must be contiguous float32 with head_dim / 2 values per row of x");
        }
        check_caches(k_caches, v_caches);
        check_step(rows, k_caches[0], tables, query_start, seq_lens, slot_mapping);

        const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
        const int64_t qkv_width = q_size + 2 * kv_size;
        const auto options = x.options();
        auto normed = torch::empty({rows, hidden_}, options), qkv = torch::empty({rows, qkv_width}, options);
        auto attended = torch::empty({rows, q_size}, options), projected = torch::empty({rows, hidden_}, options);
        auto gate_up = torch::empty({rows, 2 * intermediate_}, options);
        auto activated = torch::empty({rows, intermediate_}, options);
        float *h = normed.data_ptr<float>(), *q = qkv.data_ptr<float>(), *a = attended.data_ptr<float>();
        float *p = projected.data_ptr<float>(), *gu = gate_up.data_ptr<float>(), *g = activated.data_ptr<float>();
        float* residual = x.data_ptr<float>();
        const int64_t* slots = slot_mapping.data_ptr<int64_t>();
        const auto& rowwise = kernels_->rowwise_float32;
        const int64_t block_size = k_caches[0].size(1), num_seqs = seq_lens.size(0);

        // With adapters: each layer's and projection's weights per row, checked before any kernel runs.
        std::vector<std::array<std::vector<const LoRAWeights*>, LORA_MODULES>> adapters;
        if (!lora.is_none()) {
            const auto& slots = lora.cast<const LoRASlots&>();
            TORCH_CHECK(slot_of_row.has_value() && slot_of_row->numel() == rows,
                        "with LoRA slots, slot_of_row names one slot per row of x");
            TORCH_CHECK(slots.num_layers() == num_layers(), "the LoRA slots are for ", slots.num_layers(),
                        " layers, the stack has ", num_layers());
            const int64_t widths[LORA_MODULES][2] = {
                {hidden_, qkv_width}, {q_size, hidden_}, {hidden_, 2 * intermediate_}, {intermediate_, hidden_}};
            adapters.resize(layers_.size());
            for (int64_t index = 0; index < num_layers(); ++index) {
                for (int64_t m = 0; m < LORA_MODULES; ++m) {
                    adapters[index][m] = slots.weights_of(index, m, *slot_of_row, widths[m][0], widths[m][1]);
                }
            }
        }
        // out += the rows' adapters' updates of projection m of layer `index` (in [rows, in_features])
        auto adapt = [&](size_t index, int64_t m, const float* in, int64_t in_features, float* out, int64_t width) {
            if (!adapters.empty()) {
                kernels_->lora_float32(in, rows, in_features, in_features, adapters[index][m].data(), out, width);
            }
        };

        py::gil_scoped_release released;  // as every kernel call: the server's event loop runs meanwhile
        for (size_t index = 0; index < layers_.size(); ++index) {
            const Layer& layer = layers_[index];
            rowwise.rms_norm(residual, rows, hidden_, layer.input_norm, layer.input_eps, h);
            multiply(layer.qkv, h, rows, q);
            adapt(index, 0, h, hidden_, q, qkv_width);
            rowwise.rotate_heads(q, rows, qkv_width, num_heads_ + num_kv_heads_, head_dim_, cos.data_ptr<float>(),
                                 sin.data_ptr<float>());
            float* k_cache = k_caches[index].data_ptr<float>();
            float* v_cache = v_caches[index].data_ptr<float>();
            for (int64_t r = 0; r < rows; ++r) {  // the write_kv of llama.py: each row's K and V to its slot
                const float* row = q + r * qkv_width + q_size;
                std::memcpy(k_cache + slots[r] * kv_size, row, kv_size * sizeof(float));
                std::memcpy(v_cache + slots[r] * kv_size, row + kv_size, kv_size * sizeof(float));
            }
            const Queries<float> queries{q, qkv_width, head_dim_, num_heads_};
            const PagedKV<float> kv{k_cache, v_cache, block_size, num_kv_heads_, head_dim_,
                                    tables.data_ptr<int64_t>(), tables.stride(0)};
            kernels_->causal_float32(queries, kv, query_start.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                                     num_seqs, scale_, 0, 0.f, a);
            multiply(layer.o, a, rows, p);
            adapt(index, 1, a, q_size, p, hidden_);
            rowwise.add_rms_norm(residual, p, rows, hidden_, layer.post_norm, layer.post_eps, h);
            multiply(layer.gate_up, h, rows, gu);
            adapt(index, 2, h, hidden_, gu, 2 * intermediate_);
            rowwise.silu_mul(gu, rows, intermediate_, g);
            multiply(layer.down, g, rows, p);
            adapt(index, 3, g, intermediate_, p, hidden_);
            for (int64_t i = 0; i < rows * hidden_; ++i) residual[i] += p[i];  // x.add_(mlp(...)): one rounding each
        }
        return x;
    }

    int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  private:
    const float* norm_weight(const torch::Tensor& weight) {
        TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                        weight.dim() == 1 && weight.size(0) == hidden_,
                    "a norm weight must be a contiguous float32 CPU tensor [hidden]");
        held_.push_back(weight);
        return weight.data_ptr<float>();
    }

    // (parts, bias): parts a list of kernel_arguments tuples (codes, scales, offsets, bits, group_size,
    // zero_point, levels) in output order, bias a float32 tensor or None.
    Projection projection(const py::handle& spec, int64_t in_features, int64_t out_features) {
        const auto pair = spec.cast<py::tuple>();
        TORCH_CHECK(pair.size() == 2, "a projection is (parts, bias)");
        Projection projection;
        projection.in_features = in_features;
        for (const auto& item : pair[0].cast<py::list>()) {
            const auto arguments = item.cast<py::tuple>();
            TORCH_CHECK(arguments.size() == 7,
                        "a part is (codes, scales, offsets, bits, group_size, zero_point, levels)");
            const auto codes = arguments[0].cast<torch::Tensor>(), scales = arguments[1].cast<torch::Tensor>();
            const auto offsets = arguments[2].cast<torch::Tensor>(), levels = arguments[6].cast<torch::Tensor>();
            const auto weight = quantized_weight_of(codes, scales, offsets, arguments[3].cast<int64_t>(),
                                                    arguments[4].cast<int64_t>(), arguments[5].cast<int64_t>(), levels);
            TORCH_CHECK(weight.cols == in_features, "a projection's parts must take ", in_features, " inputs");
            held_.insert(held_.end(), {codes, scales, offsets, levels});
            projection.parts.push_back(weight);
            projection.out_features += weight.rows;
        }
        TORCH_CHECK(projection.out_features == out_features, "a projection must give ", out_features,
                    " outputs, its parts give ", projection.out_features);
        if (!pair[1].is_none()) {
            const auto bias = pair[1].cast<torch::Tensor>();
            TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() && bias.dim() == 1 &&
                            bias.size(0) == out_features,
                        "a bias must be a contiguous float32 tensor [out_features]");
            held_.push_back(bias);
            projection.bias = bias.data_ptr<float>();
        }
        return projection;
    }

    // in [rows, in_features] times the projection: out [rows, out_features], each part in its own columns,
    // the bias added to each sum as QuantizedLinear adds it (one rounding).
    void multiply(const Projection& projection, const float* in, int64_t rows, float* out) const {
        int64_t column = 0;
        for (const auto& part : projection.parts) {
            const float* bias = projection.bias == nullptr ? nullptr : projection.bias + column;
            kernels_->quantized_matmul(part, in, rows, projection.in_features, bias, out + column,
                                       projection.out_features);
            column += part.rows;
        }
    }

    void check_caches(const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches) const {
        TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                    "one K and one V cache per layer");
        const auto& first = k_caches[0];
        TORCH_CHECK(first.dim() == 4 && first.size(2) == num_kv_heads_ && first.size(3) == head_dim_ &&
                        first.size(1) > 0 && (first.size(1) & (first.size(1) - 1)) == 0,
                    "caches must be [blocks, block_size (a power of two), kv_heads, head_dim]");
        for (const auto* caches : {&k_caches, &v_caches}) {
            for (const auto& cache : *caches) {
                TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == torch::kFloat32 &&
                                cache.is_contiguous() && cache.sizes() == first.sizes(),
                            "every cache must be a contiguous float32 CPU tensor shaped as the first");
            }
        }
    }

    // What paged_causal and write_kv would check: query starts cover the rows, every block a row reads
    // exists, every slot a row writes is in the cache.
    void check_step(int64_t rows, const torch::Tensor& cache, const torch::Tensor& tables,
                    const torch::Tensor& query_start, const torch::Tensor& seq_lens,
                    const torch::Tensor& slot_mapping) const {
        for (const torch::Tensor* index : {&tables, &query_start, &seq_lens, &slot_mapping}) {
            TORCH_CHECK(index->device().is_cpu() && index->scalar_type() == torch::kInt64 && index->is_contiguous(),
                        "index tensors must be contiguous int64 CPU tensors");
        }
        const int64_t num_seqs = seq_lens.size(0), block_size = cache.size(1);
        TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && query_start.size(0) == num_seqs + 1 &&
                        slot_mapping.dim() == 1 && slot_mapping.size(0) == rows,
                    "one block table and seq_len per sequence, num_seqs + 1 query starts, one slot per row");
        const int64_t* start = query_start.data_ptr<int64_t>();
        const int64_t* lens = seq_lens.data_ptr<int64_t>();
        TORCH_CHECK(start[0] == 0 && start[num_seqs] == rows, "query starts must cover x's rows");
        for (int64_t i = 0; i < num_seqs; ++i) {
            const int64_t query_len = start[i + 1] - start[i];
            TORCH_CHECK(query_len >= 0 && lens[i] >= query_len, "each sequence needs 0 <= query_len <= seq_len");
            check_blocks(tables, i, 0, lens[i], block_size, cache.size(0));
        }
        const int64_t num_slots = cache.size(0) * block_size;
        const int64_t* slots = slot_mapping.data_ptr<int64_t>();
        for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "slot out of range");
    }

    py::object capsule_;  // the variant module's table: alive while the stack is
    const KernelTable* kernels_;
    int64_t num_heads_, num_kv_heads_, head_dim_, hidden_, intermediate_;
    float scale_;
    std::vector<Layer> layers_;
    std::vector<torch::Tensor> held_;  // every tensor a layer points into, alive while the stack is
};

}  // namespace

void bind_decoder_stack(py::module& m) {
    py::class_<DecoderStack>(m, "DecoderStack",
                             "every decoder layer of a step in one call, for projections kept quantized")
        .def(py::init<const py::object&, const py::list&, int64_t, int64_t, int64_t, int64_t, int64_t, double>(),
             py::arg("table"), py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
             py::arg("hidden"), py::arg("intermediate"), py::arg("scale"))
        .def("run", &DecoderStack::run, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_caches"),
             py::arg("v_caches"), py::arg("tables"), py::arg("query_start"), py::arg("seq_lens"),
             py::arg("slot_mapping"), py::arg("lora") = py::none(), py::arg("slot_of_row") = py::none())
        .def_property_readonly("num_layers", &DecoderStack::num_layers);
}

}  // namespace prefixserve::binding
