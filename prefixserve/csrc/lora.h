// LoRA adapters' updates of a projection's output (lora.cpp), on raw pointers, for float32 and bf16
// rows (T); the binding (lora_slots.cpp) checks the tensors and calls these through a variant's table.
#pragma once

#include <cstdint>

namespace prefixserve {

// One adapter's update of one (fused) projection: out += ((x A^T) B^T) * scaling, as peft's LoraLayer
// computes it in float32. a_t is A transposed, [in, padded_rank] (padded_rank a multiple of 16, the
// columns past the parts' ranks zero): every part's A side by side. Each part (q, k and v of a fused qkv,
// or gate and up, or the whole projection) updates its own output columns [column, column + width) from
// its own rank values t[rank_offset, rank_offset + rank) of x A^T, with b_t its B transposed, [rank, width];
// columns no part names are never written.
struct LoRAPart {
    const float* b_t;
    int64_t rank_offset, rank, column, width;
};

constexpr int64_t LORA_MAX_PARTS = 3;

struct LoRAWeights {
    const float* a_t;
    int64_t padded_rank;
    float scaling;
    int64_t num_parts;
    LoRAPart parts[LORA_MAX_PARTS];
};

// For each row r of x [rows, in] (rows x_stride apart) whose row_weights[r] is not null:
// out[r] = T(float(out[r]) + (x[r] A^T) B^T * scaling) on each part's columns (out's rows out_stride apart,
// each part's columns within a row).
// Each row's sums run in an order fixed by the row alone (i, then j, increasing), so its bits are the
// same whatever else is in the call; a row without an adapter is never written.
template <typename T>
void lora_add_rows(const T* x, int64_t rows, int64_t x_stride, int64_t in, const LoRAWeights* const* row_weights,
                   T* out, int64_t out_stride);

}  // namespace prefixserve
