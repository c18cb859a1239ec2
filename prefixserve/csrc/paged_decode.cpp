// Decode attention read in place from the paged KV cache: no gather, one pass over each key.
//
// For decode row i and KV head h, the group of query heads h*G .. h*G+G-1 attends over the keys at
// positions [first[i], last[i]) of its sequence, found through its block table:
//
//     position p -> block tables[i][p / block_size], offset p % block_size
//
// Keys are taken in tiles of TILE positions aligned to multiples of TILE; each tile's scores update a
// running max and sum (online softmax, float32), then its values are accumulated in float32. The
// order of every sum depends on the row's own key range only, never on the other rows of the step.
// Returns (out [D, H, d] in q's dtype, log-sum-exp [D, H] float32 of the scaled scores), the pair
// the cascade's merge takes. The pure-PyTorch reference is attention.py's _attend_decodes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 16;   // keys per online-softmax step
constexpr int64_t LANES = 16;  // float32 accumulators a dot product keeps (one AVX-512 register)

inline float load(const float* p, int64_t j) { return p[j]; }

inline float load(const at::BFloat16* p, int64_t j) {
    uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[j]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

// sum_j q[j] * k[j] over d elements, in LANES running sums then a fixed tree.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
    float acc[LANES] = {0.f};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES) {
        for (int64_t l = 0; l < LANES; ++l) acc[l] += q[j + l] * load(k, j + l);
    }
    for (int64_t l = 0; j < d; ++j, ++l) acc[l] += q[j] * load(k, j);
    for (int64_t width = LANES / 2; width > 0; width /= 2) {
        for (int64_t l = 0; l < width; ++l) acc[l] += acc[l + width];
    }
    return acc[0];
}

template <typename T>
inline void axpy(float* out, float a, const T* v, int64_t d) {
    for (int64_t j = 0; j < d; ++j) out[j] += a * load(v, j);
}

#if defined(__AVX512F__)
// AVX-512 tile: head_dim a multiple of 16. Same online softmax as the portable one below.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// e^x for x <= 0 (scores minus their max): 2^n * e^r, |r| <= ln2/2, e^r by its degree-6 Taylor
// polynomial (relative error under 2e-7); a fixed sequence of operations, so bit-reproducible.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

template <typename T>
inline void tile_portable(const float* query, const T* const* key_of, const T* const* value_of, int64_t n,
                          int64_t group, int64_t head_dim, float* scores, float* running_max, float* running_sum,
                          float* acc) {
    for (int64_t g = 0; g < group; ++g) {
        float* s = scores + g * TILE;
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) {
            s[t] = dot(query + g * head_dim, key_of[t], head_dim);
            tile_max = std::max(tile_max, s[t]);
        }
        const float new_max = std::max(running_max[g], tile_max);
        const float correction = std::exp(running_max[g] - new_max);
        float total = running_sum[g] * correction;
        for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - new_max);
            total += s[t];
        }
        running_sum[g] = total;
        running_max[g] = new_max;
        float* a = acc + g * head_dim;
        for (int64_t j = 0; j < head_dim; ++j) a[j] *= correction;
    }
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t g = 0; g < group; ++g) axpy(acc + g * head_dim, scores[g * TILE + t], value_of[t], head_dim);
    }
}

#if defined(__AVX512F__)
template <typename T>
inline void tile_avx512(const float* query, const T* const* key_of, const T* const* value_of, int64_t n,
                        int64_t group, int64_t head_dim, float* scores, float* running_max, float* running_sum,
                        float* acc) {
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t g = 0; g < group; ++g) {
        const float* qg = query + g * head_dim;
        float* s = scores + g * TILE;
        for (int64_t t = 0; t < n; ++t) {
            __m512 sum = _mm512_mul_ps(load16(qg), load16(key_of[t]));
            for (int64_t j = 16; j < head_dim; j += 16) sum = _mm512_fmadd_ps(load16(qg + j), load16(key_of[t] + j), sum);
            s[t] = _mm512_reduce_add_ps(sum);
        }
        const __m512 tile = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, s);
        const float new_max = std::max(running_max[g], _mm512_reduce_max_ps(tile));
        const float correction = running_max[g] == new_max ? 1.f
                                 : _mm512_cvtss_f32(exp16(_mm512_set1_ps(running_max[g] - new_max)));
        const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(tile, _mm512_set1_ps(new_max))));
        _mm512_storeu_ps(s, p);
        running_sum[g] = running_sum[g] * correction + _mm512_reduce_add_ps(p);
        running_max[g] = new_max;
        if (correction != 1.f) {
            float* a = acc + g * head_dim;
            const __m512 c = _mm512_set1_ps(correction);
            for (int64_t j = 0; j < head_dim; j += 16) _mm512_storeu_ps(a + j, _mm512_mul_ps(load16(a + j), c));
        }
    }
    for (int64_t j = 0; j < head_dim; j += 16) {
        for (int64_t g = 0; g < group; ++g) {
            float* a = acc + g * head_dim + j;
            const float* p = scores + g * TILE;
            __m512 sum = load16(a);
            for (int64_t t = 0; t < n; ++t) sum = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load16(value_of[t] + j), sum);
            _mm512_storeu_ps(a, sum);
        }
    }
}
#endif

template <typename T>
void decode_kernel(const T* q, int64_t q_row_stride, int64_t q_head_stride, const int64_t* rows,
                   const T* k_cache, const T* v_cache, int64_t block_size, int64_t num_kv_heads,
                   const int64_t* tables, int64_t table_stride, const int64_t* first, const int64_t* last,
                   int64_t num_decodes, int64_t num_heads, int64_t head_dim, float scale, T* out,
                   float* lse) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive positions
    int64_t block_shift = 0;  // block_size is a power of two (the engine's config requires it)
    while ((int64_t{1} << block_shift) < block_size) ++block_shift;
    const int64_t block_mask = block_size - 1;
#if defined(__AVX512F__)
    const bool vectorized = head_dim % 16 == 0;
#else
    const bool vectorized = false;
#endif
    at::parallel_for(0, num_decodes * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> query(group * head_dim), acc(group * head_dim), scores(group * TILE);
        std::vector<float> running_max(group), running_sum(group);
        for (int64_t item = begin; item < end; ++item) {
            const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
            const T* q_row = q + rows[i] * q_row_stride;
            for (int64_t g = 0; g < group; ++g) {
                const T* head = q_row + (h * group + g) * q_head_stride;
                for (int64_t j = 0; j < head_dim; ++j) query[g * head_dim + j] = load(head, j) * scale;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
            std::fill(running_sum.begin(), running_sum.end(), 0.f);
            const int64_t* table = tables + i * table_stride;
            const T* key_of[TILE];
            const T* value_of[TILE];
            for (int64_t start = first[i]; start < last[i];) {
                const int64_t stop = std::min(last[i], (start / TILE + 1) * TILE);
                const int64_t n = stop - start;
                for (int64_t t = 0; t < n; ++t) {
                    const int64_t p = start + t;
                    const int64_t slot = (table[p >> block_shift] << block_shift) | (p & block_mask);
                    key_of[t] = k_cache + slot * slot_stride + h * head_dim;
                    value_of[t] = v_cache + slot * slot_stride + h * head_dim;
                }
#if defined(__AVX512F__)
                if (vectorized) {
                    tile_avx512(query.data(), key_of, value_of, n, group, head_dim, scores.data(), running_max.data(),
                                running_sum.data(), acc.data());
                } else
#endif
                {
                    tile_portable(query.data(), key_of, value_of, n, group, head_dim, scores.data(), running_max.data(),
                                  running_sum.data(), acc.data());
                }
                start = stop;
            }
            for (int64_t g = 0; g < group; ++g) {
                const int64_t head = h * group + g;
                T* o = out + (i * num_heads + head) * head_dim;
                const float total = running_sum[g];
                const float inverse = total > 0.f ? 1.f / total : 0.f;
                for (int64_t j = 0; j < head_dim; ++j) o[j] = static_cast<T>(acc[g * head_dim + j] * inverse);
                lse[i * num_heads + head] = total > 0.f ? running_max[g] + std::log(total)
                                                        : -std::numeric_limits<float>::infinity();
            }
        }
    });
}

std::vector<torch::Tensor> paged_decode(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& k_cache,
                                        const torch::Tensor& v_cache, const torch::Tensor& tables,
                                        const torch::Tensor& first, const torch::Tensor& last, double scale) {
    TORCH_CHECK(q.dim() == 3, "q must be [tokens, heads, head_dim]");
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                "k_cache and v_cache must both be [blocks, block_size, kv_heads, head_dim]");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                "q and the caches must share a dtype");
    TORCH_CHECK(q.stride(2) == 1, "q's head_dim must be contiguous");
    TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode runs on CPU tensors");
    for (const auto* index : {&rows, &tables, &first, &last}) {
        TORCH_CHECK(index->scalar_type() == torch::kInt64 && index->is_contiguous(), "index tensors must be contiguous int64");
    }
    const int64_t num_decodes = rows.size(0), num_heads = q.size(1), head_dim = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0, "block_size must be a power of two");
    TORCH_CHECK(k_cache.size(3) == head_dim, "q and the caches differ in head_dim");
    TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of KV heads");
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_decodes && first.size(0) == num_decodes &&
                    last.size(0) == num_decodes, "one block table, first and last per decode");
    {  // every block a decode reads must exist: a bad table is an error, never a stray read
        const int64_t* table = tables.data_ptr<int64_t>();
        const int64_t* lo = first.data_ptr<int64_t>();
        const int64_t* hi = last.data_ptr<int64_t>();
        const int64_t* row = rows.data_ptr<int64_t>();
        for (int64_t i = 0; i < num_decodes; ++i) {
            TORCH_CHECK(row[i] >= 0 && row[i] < q.size(0), "decode row out of range");
            TORCH_CHECK(lo[i] >= 0 && lo[i] <= hi[i] && (hi[i] == 0 || (hi[i] - 1) / block_size < tables.size(1)),
                        "key range [first, last) outside the block table");
            for (int64_t b = lo[i] / block_size; b * block_size < hi[i]; ++b) {
                const int64_t id = table[i * tables.stride(0) + b];
                TORCH_CHECK(id >= 0 && id < k_cache.size(0), "block id out of range");
            }
        }
    }
    auto out = torch::empty({num_decodes, num_heads, head_dim}, q.options());
    auto lse = torch::empty({num_decodes, num_heads}, q.options().dtype(torch::kFloat32));
    AT_DISPATCH_SWITCH(q.scalar_type(), "paged_decode",
        AT_DISPATCH_CASE(torch::kFloat32, [&] {
            decode_kernel<float>(q.data_ptr<float>(), q.stride(0), q.stride(1), rows.data_ptr<int64_t>(),
                                 k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_size, num_kv_heads,
                                 tables.data_ptr<int64_t>(), tables.stride(0), first.data_ptr<int64_t>(),
                                 last.data_ptr<int64_t>(), num_decodes, num_heads, head_dim,
                                 static_cast<float>(scale), out.data_ptr<float>(), lse.data_ptr<float>());
        })
        AT_DISPATCH_CASE(torch::kBFloat16, [&] {
            decode_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), rows.data_ptr<int64_t>(),
                                        k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), block_size,
                                        num_kv_heads, tables.data_ptr<int64_t>(), tables.stride(0),
                                        first.data_ptr<int64_t>(), last.data_ptr<int64_t>(), num_decodes, num_heads,
                                        head_dim, static_cast<float>(scale), out.data_ptr<at::BFloat16>(),
                                        lse.data_ptr<float>());
        }));
    return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "prefixserve's compiled CPU kernels (the pure-PyTorch paths in prefixserve.model are their reference)";
    m.def("paged_decode", &paged_decode, "decode attention read in place from the paged KV cache");
}
