// What the binding's files (module.cpp, decoder_stack.cpp, lora_slots.cpp) share: reading a variant's kernel table and
// checking what Python hands in before any kernel reads it.
#pragma once

#include <torch/extension.h>

#include "kernels.h"

namespace prefixserve::binding {

// The KernelTable in a variant module's `table` capsule, checked for its layout version.
const KernelTable& table_of(const py::object& capsule);

// Every block holding positions [first, seq_len) of sequence i of `tables` must exist (ids below
// num_blocks): a bad table is an error, never a stray read.
void check_blocks(const torch::Tensor& tables, int64_t i, int64_t first, int64_t seq_len, int64_t block_size,
                  int64_t num_blocks);

// A quantized weight's tensors (quantized.h), checked.
QuantizedWeight quantized_weight_of(const torch::Tensor& codes, const torch::Tensor& scales,
                                    const torch::Tensor& offsets, int64_t bits, int64_t group_size,
                                    int64_t zero_point, const torch::Tensor& levels);

// prefixserve._C.DecoderStack (decoder_stack.cpp).
void bind_decoder_stack(py::module& m);

// prefixserve._C.LoRASlots (lora_slots.cpp).
void bind_lora_slots(py::module& m);

}  // namespace prefixserve::binding
