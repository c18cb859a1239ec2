// prefixserve._C.LoRASlots (lora_slots.h). What Python hands in is checked first: a slot index outside the
// table, a slot never filled, or weights whose shapes do not match x and out are errors, never a stray read.
#include "lora_slots.h"

namespace prefixserve::binding {

LoRASlots::LoRASlots(const py::object& capsule, int64_t num_slots, int64_t num_layers)
    : capsule_(capsule), kernels_(&table_of(capsule)), num_layers_(num_layers) {
    TORCH_CHECK(num_slots > 0 && num_layers > 0, "num_slots and num_layers must be positive");
    TORCH_CHECK(kernels_->lora_float32 != nullptr, "kernel variant ", kernels_->variant, " has no LoRA kernel");
    slots_.resize(num_slots);
}

namespace {

void check_weight(const torch::Tensor& weight) {
    TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                    weight.dim() == 2,
                "a_t and b_t must be contiguous 2-D float32 CPU tensors");
}

}  // namespace

void LoRASlots::install(int64_t slot, const py::list& layers) {
    TORCH_CHECK(slot >= 0 && slot < num_slots(), "slot out of range");
    TORCH_CHECK(static_cast<int64_t>(layers.size()) == num_layers_, "one item per layer");
    Slot filled;
    for (const auto& item : layers) {
        const auto modules = item.cast<py::tuple>();
        TORCH_CHECK(static_cast<int64_t>(modules.size()) == LORA_MODULES, "a layer is (qkv, o, gate_up, down)");
        std::array<std::optional<Entry>, LORA_MODULES> entries;
        for (int64_t m = 0; m < LORA_MODULES; ++m) {
            if (modules[m].is_none()) continue;
            const auto spec = modules[m].cast<py::tuple>();
            TORCH_CHECK(spec.size() == 4, "an update is (a_t, scaling, width, parts)");
            const auto a_t = spec[0].cast<torch::Tensor>();
            const int64_t width = spec[2].cast<int64_t>();
            const auto parts = spec[3].cast<py::list>();
            check_weight(a_t);
            TORCH_CHECK(a_t.size(1) % 16 == 0, "a_t must be [in, padded_rank], padded_rank a multiple of 16");
            TORCH_CHECK(parts.size() >= 1 && static_cast<int64_t>(parts.size()) <= LORA_MAX_PARTS,
                        "an update has 1 to ", LORA_MAX_PARTS, " parts");
            LoRAWeights weights{a_t.data_ptr<float>(), a_t.size(1), spec[1].cast<float>(),
                                static_cast<int64_t>(parts.size()), {}};
            filled.held.push_back(a_t);
            for (size_t p = 0; p < parts.size(); ++p) {
                const auto part = parts[p].cast<py::tuple>();
                TORCH_CHECK(part.size() == 3, "a part is (b_t, rank_offset, column)");
                const auto b_t = part[0].cast<torch::Tensor>();
                const int64_t rank_offset = part[1].cast<int64_t>(), column = part[2].cast<int64_t>();
                check_weight(b_t);
                TORCH_CHECK(b_t.size(0) > 0 && rank_offset >= 0 && rank_offset + b_t.size(0) <= a_t.size(1) &&
                                column >= 0 && column + b_t.size(1) <= width,
                            "a part's ranks must lie within a_t's columns and its outputs within the width");
                filled.held.push_back(b_t);
                weights.parts[p] = {b_t.data_ptr<float>(), rank_offset, b_t.size(0), column, b_t.size(1)};
            }
            entries[m] = Entry{weights, a_t.size(0), width};
        }
        filled.layers.push_back(entries);
    }
    filled.filled = true;
    slots_[slot] = std::move(filled);
}

std::vector<const LoRAWeights*> LoRASlots::weights_of(int64_t layer, int64_t module, const torch::Tensor& slot_of_row,
                                                      int64_t in_features, int64_t width) const {
    TORCH_CHECK(layer >= 0 && layer < num_layers_ && module >= 0 && module < LORA_MODULES,
                "layer or module out of range");
    TORCH_CHECK(slot_of_row.device().is_cpu() && slot_of_row.scalar_type() == torch::kInt32 &&
                    slot_of_row.is_contiguous() && slot_of_row.dim() == 1,
                "slot_of_row must be a contiguous 1-D int32 CPU tensor, one slot per row");
    const int64_t rows = slot_of_row.size(0);
    const int32_t* slots = slot_of_row.data_ptr<int32_t>();
    std::vector<const LoRAWeights*> weights(rows, nullptr);
    for (int64_t r = 0; r < rows; ++r) {
        if (slots[r] < 0) continue;
        TORCH_CHECK(slots[r] < num_slots() && slots_[slots[r]].filled, "row ", r, " names slot ", slots[r],
                    ", which holds no adapter");
        const auto& entry = slots_[slots[r]].layers[layer][module];
        if (!entry) continue;
        TORCH_CHECK(entry->in_features == in_features && entry->width == width, "slot ", slots[r], "'s update takes ",
                    entry->in_features, " inputs to ", entry->width, " outputs, the call has ", in_features, " and ",
                    width);
        weights[r] = &entry->weights;
    }
    return weights;
}

void LoRASlots::apply(int64_t layer, int64_t module, const torch::Tensor& x, torch::Tensor& out,
                      const torch::Tensor& slot_of_row) const {
    TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 &&
                    out.stride(1) == 1 && x.size(0) == out.size(0) && x.scalar_type() == out.scalar_type() &&
                    (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
                "x and out must be 2-D CPU tensors of one dtype (float32 or bf16), as many rows, contiguous rows");
    TORCH_CHECK(slot_of_row.numel() == x.size(0), "one slot per row of x");
    const auto weights = weights_of(layer, module, slot_of_row, x.size(1), out.size(1));
    const int64_t rows = x.size(0);
    py::gil_scoped_release released;
    if (x.scalar_type() == torch::kFloat32) {
        kernels_->lora_float32(x.data_ptr<float>(), rows, x.stride(0), x.size(1), weights.data(), out.data_ptr<float>(),
                               out.stride(0));
    } else {
        kernels_->lora_bfloat16(x.data_ptr<at::BFloat16>(), rows, x.stride(0), x.size(1), weights.data(),
                                out.data_ptr<at::BFloat16>(), out.stride(0));
    }
}

void bind_lora_slots(py::module& m) {
    py::class_<LoRASlots>(m, "LoRASlots", "the adapters a step may use, and each row's update by its own")
        .def(py::init<const py::object&, int64_t, int64_t>(), py::arg("table"), py::arg("num_slots"),
             py::arg("num_layers"))
        .def("install", &LoRASlots::install, py::arg("slot"), py::arg("layers"))
        .def("apply", &LoRASlots::apply, py::arg("layer"), py::arg("module"), py::arg("x"), py::arg("out"),
             py::arg("slot_of_row"))
        .def_property_readonly("num_slots", &LoRASlots::num_slots);
}

}  // namespace prefixserve::binding
