// Paged decode attention over the block-major KV cache, read in place.
//
// cache:   [num_blocks, layers, 2, block_size, kv_heads, head_dim], contiguous, float32 or bfloat16
// q:       [seqs, heads * head_dim], unit stride along a row (a row stride is allowed: the query
//          columns of a fused qkv activation are passed as a view)
// tables:  [seqs, max_blocks] int32 block ids; lens: [seqs] int32 positions to attend (>= 1)
// returns: [seqs, heads * head_dim] of q's dtype
//
// One task per (sequence, kv head): the task's `group` queries share every K/V row it reads, so
// grouped-query attention never repeats K/V. Scores and the weighted sum of V accumulate in
// float32; the output is rounded to the cache dtype once. Inner loops run over head_dim with
// independent lanes so that the compiler vectorises them without reassociating a reduction.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t dim) {
  float acc[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += q[d + j] * to_float(k[d + j]);
  }
  float tail = 0.f;
  for (; d < dim; ++d) tail += q[d] * to_float(k[d]);
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t j = 0; j < w; ++j) acc[j] += acc[j + w];
  }
  return acc[0] + tail;
}

template <typename T>
inline void axpy(float w, const T* __restrict v, float* __restrict out, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] += w * to_float(v[d]);
}

struct Shape {
  int64_t layers, block_size, kv_heads, head_dim, group, max_blocks, q_row_stride;
  int64_t row() const { return kv_heads * head_dim; }              // one token of K (or V)
  int64_t slab() const { return block_size * row(); }              // one layer's K (or V) of a block
  int64_t block_stride() const { return layers * 2 * slab(); }      // one whole block
};

template <typename T>
void decode(const T* q, const T* cache, int64_t layer, const int32_t* tables, const int32_t* lens,
            float scale, T* out, int64_t seqs, const Shape& s) {
  const int64_t dim = s.head_dim, group = s.group, heads = s.kv_heads * group;
  const int64_t k_off = layer * 2 * s.slab(), v_off = k_off + s.slab();
  at::parallel_for(0, seqs * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.kv_heads, h = task % s.kv_heads;
      const int64_t n = lens[b];
      const int32_t* table = tables + b * s.max_blocks;
      scores.resize(group * n);
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q + b * s.q_row_stride + (h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(src[d]);
      }
      // scores[g * n + p] = (q_g . k_p) * scale
      for (int64_t p0 = 0; p0 < n; p0 += s.block_size) {
        const T* kb = cache + table[p0 / s.block_size] * s.block_stride() + k_off + h * dim;
        const int64_t m = std::min(s.block_size, n - p0);
        for (int64_t o = 0; o < m; ++o) {
          const T* k = kb + o * s.row();
          for (int64_t g = 0; g < group; ++g) scores[g * n + p0 + o] = dot(&qf[g * dim], k, dim) * scale;
        }
      }
      // softmax numerators in place; the division by their sum comes once, at the end
      std::vector<float> inv(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sc = &scores[g * n];
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < n; ++p) mx = std::max(mx, sc[p]);
        float sum = 0.f;
        for (int64_t p = 0; p < n; ++p) {
          sc[p] = std::exp(sc[p] - mx);
          sum += sc[p];
        }
        inv[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p0 = 0; p0 < n; p0 += s.block_size) {
        const T* vb = cache + table[p0 / s.block_size] * s.block_stride() + v_off + h * dim;
        const int64_t m = std::min(s.block_size, n - p0);
        for (int64_t o = 0; o < m; ++o) {
          const T* v = vb + o * s.row();
          for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + p0 + o], v, &acc[g * dim], dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out + b * heads * dim + (h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[g * dim + d] * inv[g]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                                  const at::Tensor& tables, const at::Tensor& lens, double scale) {
  TORCH_CHECK(cache.dim() == 6 && cache.size(2) == 2 && cache.is_contiguous(),
              "cache must be a contiguous [num_blocks, layers, 2, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(cache.device().is_cpu() && q.device().is_cpu(), "paged_decode_attention runs on CPU");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache must have the same dtype");
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1, "q must be [seqs, heads * head_dim] with unit column stride");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.is_contiguous(),
              "block tables must be a contiguous int32 [seqs, max_blocks] tensor");
  TORCH_CHECK(lens.scalar_type() == at::kInt && lens.dim() == 1 && lens.is_contiguous(),
              "context lengths must be a contiguous int32 [seqs] tensor");
  const int64_t seqs = q.size(0);
  TORCH_CHECK(tables.size(0) == seqs && lens.size(0) == seqs, "one block table and length per query row");
  TORCH_CHECK(layer >= 0 && layer < cache.size(1), "layer out of range");
  Shape s{cache.size(1), cache.size(3), cache.size(4), cache.size(5), 0, tables.size(1), q.stride(0)};
  TORCH_CHECK(q.size(1) % (s.kv_heads * s.head_dim) == 0, "q width must be a multiple of kv_heads * head_dim");
  s.group = q.size(1) / (s.kv_heads * s.head_dim);
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t nb = cache.size(0);
  for (int64_t b = 0; b < seqs; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= s.max_blocks * s.block_size, "context length outside its block table");
    for (int64_t i = 0; i < (lp[b] + s.block_size - 1) / s.block_size; ++i) {
      TORCH_CHECK(tp[b * s.max_blocks + i] >= 0 && tp[b * s.max_blocks + i] < nb, "block id out of range");
    }
  }
  at::Tensor out = at::empty({seqs, q.size(1)}, q.options());
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    decode(q.data_ptr<float>(), cache.data_ptr<float>(), layer, tp, lp, sc, out.data_ptr<float>(), seqs, s);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode(q.data_ptr<c10::BFloat16>(), cache.data_ptr<c10::BFloat16>(), layer, tp, lp, sc,
           out.data_ptr<c10::BFloat16>(), seqs, s);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor cache, int layer, Tensor tables, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
