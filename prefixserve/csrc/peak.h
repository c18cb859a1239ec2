// The measured float32 multiply-add peak of a variant (peak.cpp).
#pragma once

#include <cstdint>

namespace prefixserve {

// Runs `iterations` rounds of independent vector multiply-adds on every thread; returns the
// floating-point operations done (2 per lane per multiply-add), for the caller to time.
int64_t multiply_add_flops(int64_t iterations);

}  // namespace prefixserve
