// paged_causal and the row-wise kernels built for aarch64 (the neon or portable backend), run under
// qemu by test_model_kernel_variants.py: every row against attention in double precision, in float32
// and with bf16 keys and values, without and with a sliding window and a soft cap on the scores, and each decode
// alone bit for bit as in the batch; the LoRA kernel's rows against double precision, each alone as in the
// batch, the base's rows untouched. Exit 0 when all hold.
#include "kernels.h"
#include "lora.h"
#include "quantized.h"
#include "rowwise.h"
#include "simd.h"

#include <c10/util/Half.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using namespace prefixserve;

namespace {

constexpr int64_t BLOCK = 16, KV_HEADS = 2, HEAD_DIM = 64, HEADS = 4, BLOCKS = 40, WIDTH = 10;
const std::vector<int64_t> LENGTHS = {45, 100, 1, 130, 77}, QUERY_LENS = {45, 7, 1, 1, 1};

template <typename T>
std::vector<T> converted(const std::vector<float>& values) {
    std::vector<T> out(values.size());
    for (size_t i = 0; i < values.size(); ++i) out[i] = static_cast<T>(values[i]);
    return out;
}

template <typename T>
double as_double(T value) {
    return static_cast<double>(static_cast<float>(value));
}

struct Case {
    std::vector<float> keys, values, queries;
    std::vector<int64_t> tables, query_start;
};

template <typename T>
std::vector<T> attend(const Case& c, const std::vector<T>& keys, const std::vector<T>& values,
                      const std::vector<T>& queries, const std::vector<int64_t>& seqs, int64_t window, float softcap) {
    // The rows of the sequences in `seqs`, computed in one call.
    std::vector<T> q;
    std::vector<int64_t> starts = {0}, lens, tables;
    for (int64_t s : seqs) {
        q.insert(q.end(), queries.begin() + c.query_start[s] * HEADS * HEAD_DIM,
                 queries.begin() + c.query_start[s + 1] * HEADS * HEAD_DIM);
        starts.push_back(starts.back() + QUERY_LENS[s]);
        lens.push_back(LENGTHS[s]);
        tables.insert(tables.end(), c.tables.begin() + s * WIDTH, c.tables.begin() + (s + 1) * WIDTH);
    }
    std::vector<T> out(q.size());
    const Queries<T> view{q.data(), HEADS * HEAD_DIM, HEAD_DIM, HEADS};
    const PagedKV<T> kv{keys.data(), values.data(), BLOCK, KV_HEADS, HEAD_DIM, tables.data(), WIDTH};
    causal_kernel<T>(view, kv, starts.data(), lens.data(), static_cast<int64_t>(seqs.size()), 0.125f, window,
                     softcap, out.data());
    return out;
}

template <typename T>
double worst_error(const Case& c, const std::vector<T>& keys, const std::vector<T>& values,
                   const std::vector<T>& queries, const std::vector<T>& out, int64_t window, float softcap) {
    double worst = 0;
    for (size_t s = 0; s < LENGTHS.size(); ++s) {
        for (int64_t r = c.query_start[s]; r < c.query_start[s + 1]; ++r) {
            const int64_t position = LENGTHS[s] - QUERY_LENS[s] + (r - c.query_start[s]);
            const int64_t first = window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0;
            for (int64_t h = 0; h < HEADS; ++h) {
                const int64_t g = h / (HEADS / KV_HEADS);
                std::vector<double> scores(position + 1, 0.0);
                double top = -1e300, total = 0;
                auto slot = [&](int64_t p) { return c.tables[s * WIDTH + p / BLOCK] * BLOCK + p % BLOCK; };
                for (int64_t p = first; p <= position; ++p) {
                    double dot = 0;
                    for (int64_t j = 0; j < HEAD_DIM; ++j) {
                        dot += as_double(queries[(r * HEADS + h) * HEAD_DIM + j]) *
                               as_double(keys[(slot(p) * KV_HEADS + g) * HEAD_DIM + j]);
                    }
                    scores[p] = softcap > 0 ? std::tanh(dot * 0.125 / softcap) * softcap : dot * 0.125;
                    top = std::max(top, scores[p]);
                }
                for (int64_t p = first; p <= position; ++p) total += (scores[p] = std::exp(scores[p] - top));
                for (int64_t j = 0; j < HEAD_DIM; ++j) {
                    double sum = 0;
                    for (int64_t p = first; p <= position; ++p) {
                        sum += scores[p] * as_double(values[(slot(p) * KV_HEADS + g) * HEAD_DIM + j]);
                    }
                    worst = std::max(worst, std::fabs(sum / total - as_double(out[(r * HEADS + h) * HEAD_DIM + j])));
                }
            }
        }
    }
    return worst;
}

template <typename T>
bool check(const Case& c, const char* name, double tolerance, int64_t window, float softcap) {
    const auto keys = converted<T>(c.keys), values = converted<T>(c.values), queries = converted<T>(c.queries);
    std::vector<int64_t> all(LENGTHS.size());
    for (size_t s = 0; s < all.size(); ++s) all[s] = static_cast<int64_t>(s);
    const std::vector<T> together = attend(c, keys, values, queries, all, window, softcap);
    const double worst = worst_error(c, keys, values, queries, together, window, softcap);
    bool alike = true;
    for (size_t s = 0; s < all.size(); ++s) {  // each sequence alone: the same bits as in the batch
        const std::vector<T> alone = attend(c, keys, values, queries, {static_cast<int64_t>(s)}, window, softcap);
        alike = alike && std::memcmp(alone.data(), together.data() + c.query_start[s] * HEADS * HEAD_DIM,
                                     alone.size() * sizeof(T)) == 0;
    }
    std::printf("%s %s, window %lld, soft cap %g: max error %.3g, each sequence alone as in the batch: %s\n",
                simd::BACKEND, name, static_cast<long long>(window), softcap, worst, alike ? "yes" : "NO");
    return worst < tolerance && alike;
}

bool check_rowwise() {
#if PREFIXSERVE_SIMD_FUSED
    std::vector<float> gate_up(2 * 64), out(64), x(64), weight(64, 1.5f), normed(64);
    for (int j = 0; j < 128; ++j) gate_up[j] = std::sin(0.37f * j) * 4.f;
    for (int j = 0; j < 64; ++j) x[j] = std::cos(0.11f * j);
    silu_mul_rows(gate_up.data(), 1, 64, out.data());
    rms_norm_rows(x.data(), 1, 64, weight.data(), 1e-6f, normed.data());
    double worst = 0, sum_of_squares = 0;
    for (int j = 0; j < 64; ++j) sum_of_squares += double(x[j]) * x[j];
    for (int j = 0; j < 64; ++j) {
        const double g = gate_up[j];
        worst = std::max(worst, std::fabs(g / (1 + std::exp(-g)) * gate_up[64 + j] - out[j]));
        worst = std::max(worst, std::fabs(x[j] / std::sqrt(sum_of_squares / 64 + 1e-6) * 1.5 - normed[j]));
    }
    std::printf("%s row-wise: max error %.3g\n", simd::BACKEND, worst);
    return worst < 1e-5;
#else
    return true;
#endif
}

}  // namespace

// The quantized matmul (int8, int5 and int4 codes, float16 scales and offsets): every output against double precision
// over the decoded weight, and each row alone bit for bit as in the batch.
bool check_quantized(std::mt19937& generator) {
    constexpr int64_t ROWS = 7, OUT = 10, IN = 96, GROUPS = IN / 32;
    std::uniform_int_distribution<int> byte(0, 255);
    std::vector<c10::Half> scales(OUT * GROUPS), offsets(OUT * GROUPS);
    for (auto& value : scales) value = static_cast<c10::Half>(0.001f * (1 + byte(generator) % 50));
    for (auto& value : offsets) value = static_cast<c10::Half>(0.002f * (byte(generator) - 128));
    std::vector<float> x(ROWS * IN), decoded(OUT * IN), out(ROWS * OUT), alone(OUT);
    std::normal_distribution<float> normal;
    for (float& value : x) value = normal(generator);
    bool ok = true;
    for (int bits : {8, 5, 4}) {
        std::vector<uint8_t> codes(OUT * IN * bits / 8);
        for (auto& code : codes) code = static_cast<uint8_t>(byte(generator));
        const QuantizedWeight weight{codes.data(), bits, bits == 4 ? 8 : bits == 5 ? 16 : 0, OUT, IN, 32, scales.data(),
                                     bits == 4 ? offsets.data() : nullptr, true};
        dequantize_rows(weight, 0, OUT, decoded.data());
        quantized_matmul(weight, x.data(), ROWS, IN, nullptr, out.data(), OUT);
        double worst = 0;
        bool same = true;
        for (int64_t r = 0; r < ROWS; ++r) {
            quantized_matmul(weight, x.data() + r * IN, 1, IN, nullptr, alone.data(), OUT);
            for (int64_t n = 0; n < OUT; ++n) {
                double exact = 0, size = 0;
                for (int64_t k = 0; k < IN; ++k) {
                    exact += static_cast<double>(x[r * IN + k]) * decoded[n * IN + k];
                    size += std::fabs(static_cast<double>(x[r * IN + k]) * decoded[n * IN + k]);
                }
                worst = std::max(worst, std::fabs(out[r * OUT + n] - exact) / (size + 1e-30));
                same = same && std::memcmp(&alone[n], &out[r * OUT + n], sizeof(float)) == 0;
            }
        }
        std::printf("quantized int%d: worst relative error %.2e; rows alone as in the batch: %s\n", bits, worst,
                    same ? "yes" : "NO");
        ok = ok && same && worst < 1e-5;
    }
    return ok;
}

// `rows` random rows times the weight, each alone and all at once: whether every row has the same bits both ways.
bool rows_alone_as_in_batch(const QuantizedWeight& weight, int64_t rows, std::mt19937& generator) {
    std::vector<float> x(rows * weight.cols), out(rows * weight.rows), alone(weight.rows);
    std::normal_distribution<float> normal;
    for (float& value : x) value = normal(generator);
    quantized_matmul(weight, x.data(), rows, weight.cols, nullptr, out.data(), weight.rows);
    bool same = true;
    for (int64_t r = 0; r < rows; ++r) {
        quantized_matmul(weight, x.data() + r * weight.cols, 1, weight.cols, nullptr, alone.data(), weight.rows);
        same = same && std::memcmp(alone.data(), out.data() + r * weight.rows, weight.rows * sizeof(float)) == 0;
    }
    return same;
}

// 4-bit codes standing for levels (IQ4_NL: float16 scales, llama.cpp's 16 non-uniform int8 levels): the
// decoded weight against scale * levels[code], bit for bit (an exact product), and each row alone as in the batch.
bool check_levels(std::mt19937& generator) {
    constexpr int64_t ROWS = 5, OUT = 6, IN = 128, GROUPS = IN / 32;
    const int8_t levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    std::uniform_int_distribution<int> byte(0, 255);
    std::vector<c10::Half> scales(OUT * GROUPS);
    for (auto& value : scales) value = static_cast<c10::Half>(0.0001f * (1 + byte(generator) % 50));
    std::vector<uint8_t> codes(OUT * IN / 2);
    for (auto& code : codes) code = static_cast<uint8_t>(byte(generator));
    QuantizedWeight weight{codes.data(), 4, 0, OUT, IN, 32, scales.data(), nullptr, true};
    weight.levels = levels;
    std::vector<float> decoded(OUT * IN);
    dequantize_rows(weight, 0, OUT, decoded.data());
    bool same = true;
    for (int64_t n = 0; n < OUT; ++n) {
        for (int64_t k = 0; k < IN; ++k) {
            const int64_t e = k % 32;
            const int code = (codes[n * IN / 2 + k / 32 * 16 + e % 16] >> (e >= 16 ? 4 : 0)) & 0xF;
            const float expected = static_cast<float>(scales[n * GROUPS + k / 32]) * static_cast<float>(levels[code]);
            same = same && expected == decoded[n * IN + k];
        }
    }
    same = rows_alone_as_in_batch(weight, ROWS, generator) && same;
    std::printf("quantized IQ4_NL: decoded as its layout says and rows alone as in the batch: %s\n",
                same ? "yes" : "NO");
    return same;
}

// Q6_K and Q3_K (6- and 3-bit codes, an int8 scale per 16 values times a float16 d per 256) and Q2_K (2-bit
// codes, a 4-bit scale and minimum per 16 values times float16 d and dmin per 256): the decoded weight
// against a decoding written here from quantized.h's layouts, bit for bit, and each row alone as in the batch.
bool check_half_group_scales(std::mt19937& generator, int bits) {
    constexpr int64_t ROWS = 5, OUT = 6, IN = 512, SUBS = IN / 16;
    const int zero_point = bits == 6 ? 32 : bits == 3 ? 4 : 0;
    const int64_t group_bytes = 32 * bits / 8, factors = bits == 2 ? 2 : 1;  // d (and dmin) per 256 values
    const int64_t row_bytes = SUBS + SUBS / 8 * factors;
    std::uniform_int_distribution<int> byte(0, 255);
    std::vector<uint8_t> codes(OUT * IN * bits / 8), scales(OUT * row_bytes);
    for (auto& code : codes) code = static_cast<uint8_t>(byte(generator));
    for (int64_t n = 0; n < OUT; ++n) {
        uint8_t* row = scales.data() + n * row_bytes;
        for (int64_t s = 0; s < SUBS; ++s) row[s] = static_cast<uint8_t>(byte(generator));
        for (int64_t f = 0; f < IN / 256 * factors; ++f) {
            const c10::Half d = static_cast<c10::Half>(0.0001f * (1 + byte(generator) % 50));
            std::memcpy(row + SUBS + 2 * f, &d, 2);
        }
    }
    const QuantizedWeight weight{codes.data(), bits, zero_point, OUT, IN, 32, scales.data(), nullptr, false};
    std::vector<float> decoded(OUT * IN);
    dequantize_rows(weight, 0, OUT, decoded.data());
    bool same = true;
    for (int64_t n = 0; n < OUT; ++n) {
        const uint8_t* row = scales.data() + n * row_bytes;
        for (int64_t k = 0; k < IN; ++k) {
            const uint8_t* group = codes.data() + n * IN * bits / 8 + k / 32 * group_bytes;
            const int64_t e = k % 32;
            int code;
            if (bits == 6) {
                code = ((group[e % 16] >> (e >= 16 ? 4 : 0)) & 0xF) | ((group[16 + e % 8] >> (2 * (e / 8))) & 3) << 4;
            } else {
                code = (group[e % 8] >> (2 * (e / 8))) & 3;
                if (bits == 3) code |= ((group[8 + e / 8] >> (e % 8)) & 1) << 2;
            }
            c10::Half d, dmin;
            std::memcpy(&d, row + SUBS + 2 * factors * (k / 256), 2);
            std::memcpy(&dmin, row + SUBS + 2 * factors * (k / 256) + 2, 2);
            const float expected =
                bits == 2 ? static_cast<float>(d) * static_cast<float>(row[k / 16] & 0xF) * code -
                                static_cast<float>(dmin) * static_cast<float>(row[k / 16] >> 4)
                          : static_cast<float>(d) * static_cast<float>(static_cast<int8_t>(row[k / 16])) *
                                (code - zero_point);
            same = same && expected == decoded[n * IN + k];
        }
    }
    same = rows_alone_as_in_batch(weight, ROWS, generator) && same;
    std::printf("quantized %s: decoded as its layout says and rows alone as in the batch: %s\n",
                bits == 6 ? "Q6_K" : bits == 3 ? "Q3_K" : "Q2_K", same ? "yes" : "NO");
    return same;
}

// Rows of three kinds (an adapter of one part of rank 3, one of two parts of ranks 20 and 4 as gate and up,
// and none), 72 columns (each part's whole vectors and a tail): each adapted row against its update in double
// precision, each row alone bit for bit as in the batch, the rest untouched.
bool check_lora(std::mt19937& generator) {
    constexpr int64_t ROWS = 6, IN = 40, WIDTH_OUT = 72;
    std::normal_distribution<float> normal;
    const int64_t padded[2] = {16, 32};
    const std::vector<std::vector<int64_t>> ranks = {{3}, {20, 4}}, columns = {{0}, {0, 24}}, widths = {{72}, {24, 48}};
    std::vector<float> a_t[2], b_t[2][2];
    LoRAWeights weights[2];
    for (int k = 0; k < 2; ++k) {
        a_t[k].assign(IN * padded[k], 0.f);
        weights[k] = {nullptr, padded[k], k == 0 ? 2.f : 0.5f, static_cast<int64_t>(ranks[k].size()), {}};
        int64_t offset = 0;
        for (size_t p = 0; p < ranks[k].size(); ++p) {
            for (int64_t i = 0; i < IN; ++i)
                for (int64_t j = offset; j < offset + ranks[k][p]; ++j) a_t[k][i * padded[k] + j] = normal(generator) / 8;
            b_t[k][p].resize(ranks[k][p] * widths[k][p]);
            for (float& value : b_t[k][p]) value = normal(generator);
            weights[k].parts[p] = {b_t[k][p].data(), offset, ranks[k][p], columns[k][p], widths[k][p]};
            offset += ranks[k][p];
        }
        weights[k].a_t = a_t[k].data();
    }
    const LoRAWeights* row_weights[ROWS] = {&weights[0], nullptr, &weights[1], &weights[1], nullptr, &weights[0]};
    std::vector<float> x(ROWS * IN), base(ROWS * WIDTH_OUT);
    for (float& value : x) value = normal(generator);
    for (float& value : base) value = normal(generator);
    std::vector<float> out = base;
    lora_add_rows<float>(x.data(), ROWS, IN, IN, row_weights, out.data(), WIDTH_OUT);
    double worst = 0;
    bool same = true;
    for (int64_t r = 0; r < ROWS; ++r) {
        std::vector<float> alone(base.begin() + r * WIDTH_OUT, base.begin() + (r + 1) * WIDTH_OUT);
        lora_add_rows<float>(x.data() + r * IN, 1, IN, IN, &row_weights[r], alone.data(), WIDTH_OUT);
        same = same && std::memcmp(alone.data(), out.data() + r * WIDTH_OUT, WIDTH_OUT * sizeof(float)) == 0;
        const LoRAWeights* w = row_weights[r];
        if (w == nullptr) {
            same = same && std::memcmp(base.data() + r * WIDTH_OUT, out.data() + r * WIDTH_OUT, WIDTH_OUT * 4) == 0;
            continue;
        }
        for (int64_t p = 0; p < w->num_parts; ++p) {
            const LoRAPart& part = w->parts[p];
            for (int64_t c = 0; c < part.width; ++c) {
                double sum = 0;
                for (int64_t j = 0; j < part.rank; ++j) {
                    double t = 0;
                    for (int64_t i = 0; i < IN; ++i)
                        t += double(x[r * IN + i]) * w->a_t[i * w->padded_rank + part.rank_offset + j];
                    sum += t * part.b_t[j * part.width + c];
                }
                const int64_t at = r * WIDTH_OUT + part.column + c;
                const double expected = base[at] + sum * w->scaling;
                worst = std::max(worst, std::abs(out[at] - expected) / (1 + std::abs(expected)));
            }
        }
    }
    std::printf("lora: worst relative error %.3g, rows alone as in the batch: %s\n", worst, same ? "yes" : "NO");
    return same && worst < 1e-5;
}

int main() {
    std::mt19937 generator(1);
    std::normal_distribution<float> normal;
    Case c;
    c.keys.resize(BLOCKS * BLOCK * KV_HEADS * HEAD_DIM);
    c.values.resize(c.keys.size());
    for (float& value : c.keys) value = normal(generator);
    for (float& value : c.values) value = normal(generator);
    c.tables.resize(LENGTHS.size() * WIDTH);
    for (size_t i = 0; i < c.tables.size(); ++i) c.tables[i] = static_cast<int64_t>((i * 7 + i / WIDTH) % BLOCKS);
    c.query_start = {0};
    for (int64_t n : QUERY_LENS) c.query_start.push_back(c.query_start.back() + n);
    c.queries.resize(c.query_start.back() * HEADS * HEAD_DIM);
    for (float& value : c.queries) value = normal(generator);
    bool ok = check_rowwise() & check_quantized(generator) & check_levels(generator) & check_lora(generator);
    for (int bits : {6, 3, 2}) ok = check_half_group_scales(generator, bits) & ok;
    for (int64_t window : {0, 33}) {  // 33: windows that begin inside a 32-key step
        for (float softcap : {0.f, 1.5f}) {
            ok = check<float>(c, "float32", 1e-5, window, softcap) &
                 check<at::BFloat16>(c, "bfloat16", 2e-2, window, softcap) & ok;
        }
    }
    return ok ? 0 : 1;
}
