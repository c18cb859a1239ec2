// prefixserve._C.LoRASlots (lora_slots.cpp): the adapters a step may use, each installed in a slot once (its
// weights laid out as lora.h reads them). Python's call updates one projection's rows (lora/step.py); the
// decoder stack (decoder_stack.cpp) asks for each layer's weights per row before it runs the layers.
#pragma once

#include <array>
#include <optional>
#include <vector>

#include "binding.h"

namespace prefixserve::binding {

constexpr int64_t LORA_MODULES = 4;  // qkv, o, gate_up, down: lora/step.py's MODULES

class LoRASlots {
  public:
    LoRASlots(const py::object& capsule, int64_t num_slots, int64_t num_layers);

    // layers: one tuple per layer of one item per module, None (not adapted) or (a_t, scaling, width, parts):
    // a_t float32 [in, padded_rank] (padded_rank a multiple of 16), width the projection's outputs, parts a
    // list of 1 to 3 (b_t, rank_offset, column), b_t float32 [rank, part width] (lora.h's LoRAPart).
    void install(int64_t slot, const py::list& layers);

    // out[r] += row r's adapter's update of `module` in `layer` (x [rows, in], out [rows, width], one
    // dtype: float32 or bf16; slot_of_row int32 [rows], -1 for a row without an adapter).
    void apply(int64_t layer, int64_t module, const torch::Tensor& x, torch::Tensor& out,
               const torch::Tensor& slot_of_row) const;

    // Each row's weights for `module` in `layer` (null: no update), checked: every slot named holds an
    // adapter whose update takes `in_features` inputs to `width` outputs. slot_of_row as apply() takes it.
    std::vector<const LoRAWeights*> weights_of(int64_t layer, int64_t module, const torch::Tensor& slot_of_row,
                                               int64_t in_features, int64_t width) const;

    int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
    int64_t num_layers() const { return num_layers_; }

  private:
    struct Entry {
        LoRAWeights weights;
        int64_t in_features, width;
    };
    struct Slot {
        bool filled = false;
        std::vector<std::array<std::optional<Entry>, LORA_MODULES>> layers;
        std::vector<torch::Tensor> held;  // every tensor an entry points into, alive while the slot holds it
    };

    py::object capsule_;  // the variant module's table: alive while the slots are
    const KernelTable* kernels_;
    int64_t num_layers_;
    std::vector<Slot> slots_;
};

}  // namespace prefixserve::binding
