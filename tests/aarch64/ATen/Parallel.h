// A serial stand-in for ATen's parallel_for (tests/aarch64/ only): the kernel sources then build and
// run as a static aarch64 program without libtorch, under qemu (test_model_kernel_variants.py).
#pragma once

#include <cstdint>

namespace at {

inline int get_num_threads() { return 1; }

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t, const F& f) {
    if (begin < end) f(begin, end);
}

}  // namespace at
