// The variant's float32 multiply-add peak, measured: a loop of independent multiply-adds on
// registers only (no memory), run by every thread. The kernels' GFLOP/s are reported against it
// (benchmarks/cpu_variants.py), so a figure says how close to this CPU's own ceiling a kernel runs.
#include "peak.h"

#include "simd.h"

#include <ATen/Parallel.h>

namespace prefixserve {

namespace {

constexpr int CHAINS = 12;  // independent sums: enough to cover a multiply-add's latency on two units

float chains(int64_t iterations, float seed) {
    simd::vf sum[CHAINS];
    for (int c = 0; c < CHAINS; ++c) sum[c] = simd::set1(seed * static_cast<float>(c + 1));
    const simd::vf a = simd::set1(0.999999f), b = simd::set1(1e-7f);
    for (int64_t i = 0; i < iterations; ++i) {
        for (int c = 0; c < CHAINS; ++c) sum[c] = simd::fmadd(sum[c], a, b);
    }
    simd::vf total = sum[0];
    for (int c = 1; c < CHAINS; ++c) total = simd::add(total, sum[c]);
    return simd::sum_lanes(total);
}

}  // namespace

int64_t multiply_add_flops(int64_t iterations) {
    const int64_t threads = at::get_num_threads();
    std::vector<float> results(threads);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) results[t] = chains(iterations, 1.f + static_cast<float>(t));
    });
    float checksum = 0.f;  // read, so that no loop is dropped as dead
    for (float r : results) checksum += r;
    return checksum == 0.12345f ? 0 : 2 * iterations * CHAINS * simd::W * threads;
}

}  // namespace prefixserve
