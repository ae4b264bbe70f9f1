// Paged decode attention over the block-major KV cache, read in place.
//
// cache:   [num_blocks, layers, 2, block_size, kv_heads, head_dim], contiguous, float32 or bfloat16
// q:       [seqs, heads * head_dim], unit stride along a row (a row stride is allowed: the query
//          columns of a fused qkv activation are passed as a view)
// tables:  [seqs, max_blocks] int32 block ids; lens: [seqs] int32 positions to attend (>= 1)
// returns: [seqs, heads * head_dim] of q's dtype
//
// One task per (sequence, kv head), or per sequence when the batch has enough of them to fill the
// threads: a task's queries share every K/V row it reads, so grouped-query attention never
// repeats K/V. Scores and the weighted sum of V accumulate in
// float32; the output is rounded to the cache dtype once. Inner loops are at::vec vectors along
// head_dim (dot products, weighted sums of V) and along positions (the softmax's exp).

#include "vec_host.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace pdserve_vec;

inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// (q . k) for `group` queries (rows of qf, head_dim apart) against one K row; out[g * stride]
template <typename T>
inline void dots(const float* __restrict qf, const T* __restrict k, int64_t dim, int64_t group, float scale,
                 float* __restrict out, int64_t stride) {
  const int64_t full = dim - dim % kW;
  for (int64_t g = 0; g < group; ++g) {
    const float* q = qf + g * dim;
    fVec acc(0.f);
    for (int64_t d = 0; d < full; d += kW) acc = at::vec::fmadd(fVec::loadu(q + d), load(k + d), acc);
    float sum = hsum(acc);
    for (int64_t d = full; d < dim; ++d) sum += q[d] * to_float(k[d]);
    out[g * stride] = sum * scale;
  }
}

// acc[g] += w[g * stride] * v for `group` accumulators (head_dim apart)
template <typename T>
inline void axpys(const float* __restrict w, int64_t stride, const T* __restrict v, int64_t dim, int64_t group,
                  float* __restrict acc) {
  const int64_t full = dim - dim % kW;
  for (int64_t d = 0; d < full; d += kW) {
    const fVec vv = load(v + d);
    for (int64_t g = 0; g < group; ++g) {
      float* a = acc + g * dim + d;
      at::vec::fmadd(fVec(w[g * stride]), vv, fVec::loadu(a)).store(a);
    }
  }
  for (int64_t d = full; d < dim; ++d) {
    const float x = to_float(v[d]);
    for (int64_t g = 0; g < group; ++g) acc[g * dim + d] += w[g * stride] * x;
  }
}

// x[i] = exp(x[i] - mx) (the softmax kernel of torch's CPU flash attention uses the same exp_u20);
// returns their sum
inline float exp_sum(float* x, int64_t n, float mx) {
  const int64_t full = n - n % kW;
  fVec sum(0.f);
  const fVec m(mx);
  for (int64_t i = 0; i < full; i += kW) {
    const fVec e = (fVec::loadu(x + i) - m).exp_u20();
    e.store(x + i);
    sum = sum + e;
  }
  float total = hsum(sum);
  for (int64_t i = full; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    total += x[i];
  }
  return total;
}

// Ask for one head's rows of a block ahead of use: the rows of a head are kv_heads * head_dim apart,
// a stride the hardware prefetcher follows poorly, and decode attention waits on memory.
template <typename T>
inline void prefetch_rows(const T* first, int64_t rows, int64_t row_stride, int64_t dim) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(first + r * row_stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
  }
}

struct Shape {
  int64_t layers, block_size, kv_heads, head_dim, group, max_blocks, q_row_stride;
  int64_t row() const { return kv_heads * head_dim; }              // one token of K (or V)
  int64_t slab() const { return block_size * row(); }              // one layer's K (or V) of a block
  int64_t block_stride() const { return layers * 2 * slab(); }      // one whole block
};

// Fast paths for head_dim == 4 vectors and up to 4 queries per kv head (every model pdserve runs
// on AVX-512 with head_dim 64): one kv head's queries stay in registers and each K (or V) row is
// converted to float32 once for all of them; the V sums accumulate in registers across every
// position instead of a load and store of the accumulator per row. Rows are walked block by block
// (no division per position), the next block's rows are prefetched, and the dot products of four
// rows are reduced together (one shuffle tree for four scores instead of a horizontal sum each).
// Measured against the previous per-position version on this host (bf16, 30 layers' cache, cold):
// 1.5-1.6x at batch 8-64 and 170 positions, 2.2x at 600 positions.

// Blocks prefetched ahead of the one being read (blocks are scattered, so the hardware prefetcher
// cannot run ahead across them): 1 hid less of the latency, 4 measured no better than 2.
constexpr int64_t PF = 2;

template <typename T>
inline void prefetch_head_rows(const T* first, int64_t rows, int64_t row_stride) {
  constexpr int64_t kLines = (4 * kW * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(first + r * row_stride);
    for (int64_t l = 0; l < kLines; ++l) __builtin_prefetch(p + 64 * l);
  }
}

// body(rows, p0, m) for each block of a head's first n positions: rows = the block's first row of
// this head, p0 = its first position, m = its rows in use; the rows of the block PF ahead are
// prefetched before each body runs.
template <typename T, typename Body>
inline void for_each_block(const T* cache, const int32_t* table, int64_t off, int64_t n, const Shape& s,
                           Body&& body) {
  const int64_t bs = s.block_size, nblocks = (n + bs - 1) / bs;
  auto rows = [&](int64_t i) { return cache + table[i] * s.block_stride() + off; };
  for (int64_t i = 0; i < std::min(PF, nblocks); ++i) prefetch_head_rows(rows(i), bs, s.row());
  for (int64_t i = 0; i < nblocks; ++i) {
    if (i + PF < nblocks) prefetch_head_rows(rows(i + PF), bs, s.row());
    body(rows(i), i * bs, std::min(bs, n - i * bs));
  }
}

// the sums of four vectors, in order, as four floats
inline void hsum4(const fVec& a, const fVec& b, const fVec& c, const fVec& d, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 va = a, vb = b, vc = c, vd = d;
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(va, vb), _mm512_unpackhi_ps(va, vb));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(vc, vd), _mm512_unpackhi_ps(vc, vd));
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  // each 128-bit lane holds [a, b, c, d] partial sums: add the four lanes
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
#else
  out[0] = hsum(a);
  out[1] = hsum(b);
  out[2] = hsum(c);
  out[3] = hsum(d);
#endif
}

template <int G, typename T>
void qk_head(const float* qf, const T* cache, const int32_t* table, int64_t off, int64_t n, float scale,
             float* scores, const Shape& s) {
  fVec qv[G][4];
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < 4; ++k) qv[g][k] = fVec::loadu(qf + g * 4 * kW + k * kW);
  }
  const int64_t row = s.row();
  for_each_block(cache, table, off, n, s, [&](const T* base, int64_t p0, int64_t m) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
      fVec part[G][4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const T* kr = base + (r + j) * row;
        const fVec k0 = load(kr), k1 = load(kr + kW), k2 = load(kr + 2 * kW), k3 = load(kr + 3 * kW);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          part[g][j] = at::vec::fmadd(qv[g][0], k0, qv[g][1] * k1) + at::vec::fmadd(qv[g][2], k2, qv[g][3] * k3);
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        float* out = scores + g * n + p0 + r;
        hsum4(part[g][0], part[g][1], part[g][2], part[g][3], out);
        for (int j = 0; j < 4; ++j) out[j] *= scale;
      }
    }
    for (; r < m; ++r) {
      const T* kr = base + r * row;
      const fVec k0 = load(kr), k1 = load(kr + kW), k2 = load(kr + 2 * kW), k3 = load(kr + 3 * kW);
      for (int g = 0; g < G; ++g) {
        scores[g * n + p0 + r] = hsum(at::vec::fmadd(qv[g][0], k0, qv[g][1] * k1) +
                                      at::vec::fmadd(qv[g][2], k2, qv[g][3] * k3)) * scale;
      }
    }
  });
}

template <int G, typename T>
void v_head(const float* scores, const T* cache, const int32_t* table, int64_t off, int64_t n, float* acc,
            const Shape& s) {
  fVec o[G][4];
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < 4; ++k) o[g][k] = fVec(0.f);
  }
  const int64_t row = s.row();
  for_each_block(cache, table, off, n, s, [&](const T* base, int64_t p0, int64_t m) {
    for (int64_t r = 0; r < m; ++r) {
      const T* vr = base + r * row;
      const fVec v0 = load(vr), v1 = load(vr + kW), v2 = load(vr + 2 * kW), v3 = load(vr + 3 * kW);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const fVec w(scores[g * n + p0 + r]);
        o[g][0] = at::vec::fmadd(w, v0, o[g][0]);
        o[g][1] = at::vec::fmadd(w, v1, o[g][1]);
        o[g][2] = at::vec::fmadd(w, v2, o[g][2]);
        o[g][3] = at::vec::fmadd(w, v3, o[g][3]);
      }
    }
  });
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < 4; ++k) o[g][k].store(acc + g * 4 * kW + k * kW);
  }
}

template <typename T>
bool fast_head(bool v_pass, int64_t group, const float* in, const T* cache, const int32_t* table, int64_t off,
               int64_t n, float scale, float* out, const Shape& s) {
  if (s.head_dim != 4 * kW) return false;
  switch (group) {
    case 1: v_pass ? v_head<1>(in, cache, table, off, n, out, s) : qk_head<1>(in, cache, table, off, n, scale, out, s); return true;
    case 2: v_pass ? v_head<2>(in, cache, table, off, n, out, s) : qk_head<2>(in, cache, table, off, n, scale, out, s); return true;
    case 3: v_pass ? v_head<3>(in, cache, table, off, n, out, s) : qk_head<3>(in, cache, table, off, n, scale, out, s); return true;
    case 4: v_pass ? v_head<4>(in, cache, table, off, n, out, s) : qk_head<4>(in, cache, table, off, n, scale, out, s); return true;
    default: return false;
  }
}

// One task attends `hpt` consecutive kv heads of one sequence (their `hpt * group` queries): with
// every kv head in one task a sequence's K (and V) rows are read as whole contiguous slabs.
template <typename T>
void decode(const T* q, const T* cache, int64_t layer, const int32_t* tables, const int32_t* lens,
            float scale, T* out, int64_t seqs, const Shape& s) {
  const int64_t dim = s.head_dim, group = s.group, heads = s.kv_heads * group;
  const int64_t k_off = layer * 2 * s.slab(), v_off = k_off + s.slab();
  // whole sequences per task when there are enough of them to keep every thread busy
  const int64_t hpt = seqs >= 2 * at::get_num_threads() ? s.kv_heads : 1;
  const int64_t tasks_per_seq = s.kv_heads / hpt, qn = hpt * group, width = hpt * dim;
  at::parallel_for(0, seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(qn * dim), acc(qn * dim), inv(qn), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq, h0 = (task % tasks_per_seq) * hpt;
      const int64_t n = lens[b], nblocks = (n + s.block_size - 1) / s.block_size;
      const int32_t* table = tables + b * s.max_blocks;
      auto rows = [&](int64_t i, int64_t off) { return cache + table[i] * s.block_stride() + off + h0 * dim; };
      scores.resize(qn * n);
      const T* src = q + b * s.q_row_stride + h0 * group * dim;   // the task's queries are contiguous
      for (int64_t j = 0; j < qn * dim; ++j) qf[j] = to_float(src[j]);
      // scores[j * n + p] = (q_j . k_p) * scale
      bool fast = true;
      for (int64_t hh = 0; hh < hpt && fast; ++hh) {
        fast = fast_head(false, group, &qf[hh * group * dim], cache, table, k_off + (h0 + hh) * dim, n, scale,
                         &scores[hh * group * n], s);
      }
      for (int64_t i = 0; i < nblocks && !fast; ++i) {
        const T* kb = rows(i, k_off);
        const int64_t p0 = i * s.block_size, m = std::min(s.block_size, n - p0);
        // the next block's K, or the first block's V once the last K block is reached
        prefetch_rows(i + 1 < nblocks ? rows(i + 1, k_off) : rows(0, v_off), s.block_size, s.row(), width);
        for (int64_t o = 0; o < m; ++o) {
          for (int64_t hh = 0; hh < hpt; ++hh) {
            dots(&qf[hh * group * dim], kb + o * s.row() + hh * dim, dim, group, scale,
                 &scores[hh * group * n + p0 + o], n);
          }
        }
      }
      // softmax numerators in place; the division by their sum comes once, at the end
      for (int64_t j = 0; j < qn; ++j) {
        float* sc = &scores[j * n];
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < n; ++p) mx = std::max(mx, sc[p]);
        inv[j] = 1.f / exp_sum(sc, n, mx);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t hh = 0; hh < hpt && fast; ++hh) {
        fast_head(true, group, &scores[hh * group * n], cache, table, v_off + (h0 + hh) * dim, n, scale,
                  &acc[hh * group * dim], s);
      }
      for (int64_t i = 0; i < nblocks && !fast; ++i) {
        const T* vb = rows(i, v_off);
        const int64_t p0 = i * s.block_size, m = std::min(s.block_size, n - p0);
        if (i + 1 < nblocks) prefetch_rows(rows(i + 1, v_off), s.block_size, s.row(), width);
        for (int64_t o = 0; o < m; ++o) {
          for (int64_t hh = 0; hh < hpt; ++hh) {
            axpys(&scores[hh * group * n + p0 + o], n, vb + o * s.row() + hh * dim, dim, group,
                  &acc[hh * group * dim]);
          }
        }
      }
      T* dst = out + b * heads * dim + h0 * group * dim;
      for (int64_t j = 0; j < qn; ++j) {
        for (int64_t d = 0; d < dim; ++d) dst[j * dim + d] = static_cast<T>(acc[j * dim + d] * inv[j]);
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
