// Causal prefill attention over the block-major KV cache, read in place.
//
// cache:   [num_blocks, layers, 2, block_size, kv_heads, head_dim], contiguous, float32 or bfloat16;
//          this layer's K/V of every chunk token is already written (``AttentionPlan.attend``)
// q:       [tokens, heads * head_dim], unit column stride (a view into the fused qkv activation);
//          chunk c owns rows [rows[c], rows[c] + lens[c])
// tables:  [chunks, max_blocks] int32 block ids; starts: [chunks] int32 position of each chunk's
//          first token (0 for a fresh prompt, the cached prefix length otherwise); lens: [chunks]
// returns: [tokens, heads * head_dim] of q's dtype
//
// The query at position p attends positions 0..p: the cached context and the chunk itself, one
// code path for both (no gather of the context, no mask tensor). A task is one chunk, one kv head
// and a tile of kTile consecutive query positions: its kTile * group queries share every K/V row it
// reads. Keys are taken kW positions at a time (one vector of scores per query): the tile's K rows
// are converted to float32 and transposed so that a query's kW scores are head_dim FMAs with no
// horizontal sum (bf16 on a CPU with AVX512-BF16: K stays bf16, in pairs, and vdpbf16ps takes
// two dimensions at once), then an online softmax (running max and sum, float32, exp_u20 as torch's CPU
// flash attention) folds them into the query's output accumulator. The output is rounded to the
// cache dtype once.
//
// Tasks differ in cost (later tiles attend more keys), so threads take them from a shared counter,
// longest first: the threads finish together, and a thread the OS takes off its core for a while
// leaves its share to the others instead of holding up the whole call.

#include "vec_host.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace pdserve_vec;

constexpr int64_t kTile = 32;  // query positions per task

// bf16 scores by vdpbf16ps where the CPU has it: pairs of bf16 products, each exact in float32,
// summed in float32 (the same arithmetic as converting K and Q and using FMAs, in another order),
// with no conversion of K at all; needs an even head_dim. Measured on an AMD EPYC (Zen 5) host:
// 1.45x the FMA path at 512 and 2,048 tokens.
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define PD_BF16_DOT 1
template <typename T>
constexpr bool kCanPair = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool kCanPair = false;
#endif
constexpr int64_t kQB = 6;     // query vectors whose scores are computed together

struct Task {
  int32_t chunk, head, first;  // query rows [first, min(first + kTile, len)) of the chunk
  int64_t cost;                // keys attended, summed over the tile's positions
};

struct Shape {
  int64_t layers, block_size, kv_heads, head_dim, group, max_blocks, q_row_stride;
  int64_t row() const { return kv_heads * head_dim; }
  int64_t slab() const { return block_size * row(); }
  int64_t block_stride() const { return layers * 2 * slab(); }
};

template <typename T, bool kPairs>
void tile(const Task& t, const T* q, const T* cache, int64_t layer, const int32_t* tables, const int32_t* starts,
          const int32_t* lens, const int32_t* rows, float scale, T* out, const Shape& s,
          std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& kt, std::vector<float>& vf,
          std::vector<uint32_t>& kt2, std::vector<uint32_t>& qp) {
  const int64_t dim = s.head_dim, group = s.group, heads = s.kv_heads * group;
  const int64_t start = starts[t.chunk], len = lens[t.chunk];
  const int64_t nq = std::min<int64_t>(kTile, len - t.first);
  const int64_t nvec = nq * group;                       // query vectors of the tile
  const int32_t* table = tables + static_cast<int64_t>(t.chunk) * s.max_blocks;
  const int64_t k_off = layer * 2 * s.slab() + t.head * dim, v_off = k_off + s.slab();
  auto key_row = [&](int64_t pos, int64_t off) {
    return cache + table[pos / s.block_size] * s.block_stride() + off + (pos % s.block_size) * s.row();
  };
  // queries, float32, pre-scaled; qf[(i * group + g) * dim + d]
  for (int64_t i = 0; i < nq; ++i) {
    const T* src = q + (rows[t.chunk] + t.first + i) * s.q_row_stride + t.head * group * dim;
    if constexpr (kPairs) {   // bf16 pairs as they are (exact); the scale is applied to the scores
      const uint32_t* sp = reinterpret_cast<const uint32_t*>(src);
      for (int64_t j = 0; j < group * dim / 2; ++j) qp[i * group * dim / 2 + j] = sp[j];
    } else {
      for (int64_t j = 0; j < group * dim; ++j) qf[i * group * dim + j] = to_float(src[j]) * scale;
    }
  }
  std::fill(acc.begin(), acc.begin() + nvec * dim, 0.f);
  std::vector<float> mx(nvec, -std::numeric_limits<float>::infinity()), sum(nvec, 0.f);
  const int64_t last = start + t.first + nq - 1;         // the tile's last query position
  alignas(64) float probs[kQB * kW];
  float corr[kQB];
  for (int64_t p0 = 0; p0 <= last; p0 += kW) {
    const int64_t m = std::min<int64_t>(kW, last + 1 - p0);
    // K of positions p0..p0+m-1 transposed: kt[d * kW + lane]; V as rows: vf[lane * dim + d]
    const int64_t vfull = dim - dim % kW;
    for (int64_t l = 0; l < m; ++l) {
      const T* kr = key_row(p0 + l, k_off);
      const T* vr = key_row(p0 + l, v_off);
      if constexpr (kPairs) {
        const uint32_t* kp = reinterpret_cast<const uint32_t*>(kr);
        for (int64_t d = 0; d < dim / 2; ++d) kt2[d * kW + l] = kp[d];
      } else {
        for (int64_t d = 0; d < dim; ++d) kt[d * kW + l] = to_float(kr[d]);
      }
      for (int64_t d = 0; d < vfull; d += kW) load(vr + d).store(&vf[l * dim + d]);
      for (int64_t d = vfull; d < dim; ++d) vf[l * dim + d] = to_float(vr[d]);
    }
    for (int64_t l = m; l < kW; ++l) {
      if constexpr (kPairs) {
        for (int64_t d = 0; d < dim / 2; ++d) kt2[d * kW + l] = 0u;
      } else {
        for (int64_t d = 0; d < dim; ++d) kt[d * kW + l] = 0.f;
      }
    }
    // query vectors in blocks of kQB: their score chains (and V sums) are independent, so the
    // FMAs pipeline instead of waiting on one accumulator
    for (int64_t j0 = 0; j0 < nvec; j0 += kQB) {
      const int64_t nb = std::min<int64_t>(kQB, nvec - j0);
      if (p0 > start + t.first + (j0 + nb - 1) / group) continue;   // no query of the block sees a key here
      const float* qb[kQB];
      for (int64_t b = 0; b < kQB; ++b) qb[b] = &qf[(j0 + std::min<int64_t>(b, nb - 1)) * dim];
      fVec sv[kQB];
      if constexpr (kPairs) {
#if defined(PD_BF16_DOT)
        const uint32_t* qpb[kQB];
        for (int64_t b = 0; b < kQB; ++b) qpb[b] = &qp[(j0 + std::min<int64_t>(b, nb - 1)) * (dim / 2)];
        __m512 acc2[kQB];
        for (int64_t b = 0; b < kQB; ++b) acc2[b] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim / 2; ++d) {
          const __m512bh k = (__m512bh)_mm512_loadu_si512(&kt2[d * kW]);
#pragma GCC unroll 6
          for (int64_t b = 0; b < kQB; ++b) {
            acc2[b] = _mm512_dpbf16_ps(acc2[b], (__m512bh)_mm512_set1_epi32(static_cast<int>(qpb[b][d])), k);
          }
        }
        for (int64_t b = 0; b < kQB; ++b) sv[b] = fVec(acc2[b]) * fVec(scale);
#endif
      } else {
        for (int64_t b = 0; b < kQB; ++b) sv[b] = fVec(0.f);
        for (int64_t d = 0; d < dim; ++d) {
          const fVec k = fVec::loadu(&kt[d * kW]);
#pragma GCC unroll 6
          for (int64_t b = 0; b < kQB; ++b) sv[b] = at::vec::fmadd(fVec(qb[b][d]), k, sv[b]);
        }
      }
      int64_t vmax = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t j = j0 + b, qpos = start + t.first + j / group;
        const int64_t visible = p0 > qpos ? 0 : std::min<int64_t>(m, qpos + 1 - p0);   // lanes that attend
        float* pr = &probs[b * kW];
        if (visible == 0) {
          std::fill(pr, pr + kW, 0.f);
          corr[b] = 1.f;
          continue;
        }
        vmax = std::max(vmax, visible);
        fVec s0 = sv[b];
        if (visible < kW) s0 = fVec::set(fVec(-std::numeric_limits<float>::infinity()), s0, visible);
        const float tile_max =
            at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, s0);
        const float new_max = std::max(mx[j], tile_max);
        corr[b] = std::exp(mx[j] - new_max);              // 0 on the first tile (mx = -inf)
        mx[j] = new_max;
        const fVec e = (s0 - fVec(new_max)).exp_u20();    // masked lanes: exp(-inf) = 0
        e.store(pr);
        sum[j] = sum[j] * corr[b] + at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, e);
      }
      if (dim == 4 * kW && nb == kQB) {
        fVec o[kQB][4];
#pragma GCC unroll 6
        for (int64_t b = 0; b < kQB; ++b) {
          const fVec c(corr[b]);
          float* a = &acc[(j0 + b) * dim];
          for (int64_t k = 0; k < 4; ++k) o[b][k] = fVec::loadu(a + k * kW) * c;
        }
        for (int64_t l = 0; l < vmax; ++l) {
          const float* vr = &vf[l * dim];
          const fVec v0 = fVec::loadu(vr), v1 = fVec::loadu(vr + kW), v2 = fVec::loadu(vr + 2 * kW),
                     v3 = fVec::loadu(vr + 3 * kW);
#pragma GCC unroll 6
          for (int64_t b = 0; b < kQB; ++b) {
            const fVec w(probs[b * kW + l]);
            o[b][0] = at::vec::fmadd(w, v0, o[b][0]);
            o[b][1] = at::vec::fmadd(w, v1, o[b][1]);
            o[b][2] = at::vec::fmadd(w, v2, o[b][2]);
            o[b][3] = at::vec::fmadd(w, v3, o[b][3]);
          }
        }
#pragma GCC unroll 6
        for (int64_t b = 0; b < kQB; ++b) {
          float* a = &acc[(j0 + b) * dim];
          for (int64_t k = 0; k < 4; ++k) o[b][k].store(a + k * kW);
        }
        continue;
      }
      for (int64_t b = 0; b < nb; ++b) {                  // any head_dim: one query at a time
        float* a = &acc[(j0 + b) * dim];
        const float* pr = &probs[b * kW];
        const int64_t full = dim - dim % kW;
        const fVec c(corr[b]);
        for (int64_t d = 0; d < full; d += kW) {
          fVec o = fVec::loadu(a + d) * c;
          for (int64_t l = 0; l < vmax; ++l) o = at::vec::fmadd(fVec(pr[l]), fVec::loadu(&vf[l * dim + d]), o);
          o.store(a + d);
        }
        for (int64_t d = full; d < dim; ++d) {
          float o = a[d] * corr[b];
          for (int64_t l = 0; l < vmax; ++l) o += pr[l] * vf[l * dim + d];
          a[d] = o;
        }
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    T* dst = out + (rows[t.chunk] + t.first + i) * heads * dim + t.head * group * dim;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t j = i * group + g;
      const float inv = 1.f / sum[j];
      for (int64_t d = 0; d < dim; ++d) dst[g * dim + d] = static_cast<T>(acc[j * dim + d] * inv);
    }
  }
}

template <typename T>
void prefill(const T* q, const T* cache, int64_t layer, const int32_t* tables, const int32_t* starts,
             const int32_t* lens, const int32_t* rows, int64_t chunks, float scale, T* out, const Shape& s) {
  std::vector<Task> tasks;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t first = 0; first < lens[c]; first += kTile) {
      const int64_t nq = std::min<int64_t>(kTile, lens[c] - first);
      const int64_t cost = nq * (starts[c] + first + 1) + nq * (nq - 1) / 2;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        tasks.push_back(Task{static_cast<int32_t>(c), static_cast<int32_t>(h), static_cast<int32_t>(first), cost});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const bool pairs = kCanPair<T> && s.head_dim % 2 == 0;
  std::atomic<int64_t> next{0};
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntasks));
  at::parallel_for(0, nthreads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kTile * s.group * s.head_dim), acc(kTile * s.group * s.head_dim);
    std::vector<float> kt(s.head_dim * kW), vf(kW * s.head_dim);
    std::vector<uint32_t> kt2(s.head_dim / 2 * kW), qp(kTile * s.group * s.head_dim / 2);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < ntasks; i = next.fetch_add(1)) {
        if (pairs) {
          tile<T, kCanPair<T>>(tasks[i], q, cache, layer, tables, starts, lens, rows, scale, out, s, qf, acc, kt, vf,
                               kt2, qp);
        } else {
          tile<T, false>(tasks[i], q, cache, layer, tables, starts, lens, rows, scale, out, s, qf, acc, kt, vf, kt2,
                         qp);
        }
      }
    }
  });
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                                   const at::Tensor& tables, const at::Tensor& starts, const at::Tensor& lens,
                                   const at::Tensor& rows, double scale) {
  TORCH_CHECK(cache.dim() == 6 && cache.size(2) == 2 && cache.is_contiguous(),
              "cache must be a contiguous [num_blocks, layers, 2, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(cache.device().is_cpu() && q.device().is_cpu(), "paged_prefill_attention runs on CPU");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache must have the same dtype");
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1, "q must be [tokens, heads * head_dim] with unit column stride");
  for (const at::Tensor* t : {&starts, &lens, &rows}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous(),
                "starts, lens and rows must be contiguous int32 [chunks] tensors");
  }
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.is_contiguous(),
              "block tables must be a contiguous int32 [chunks, max_blocks] tensor");
  const int64_t chunks = tables.size(0);
  TORCH_CHECK(starts.size(0) == chunks && lens.size(0) == chunks && rows.size(0) == chunks,
              "one start, length and first row per block table");
  TORCH_CHECK(layer >= 0 && layer < cache.size(1), "layer out of range");
  Shape s{cache.size(1), cache.size(3), cache.size(4), cache.size(5), 0, tables.size(1), q.stride(0)};
  TORCH_CHECK(q.size(1) % (s.kv_heads * s.head_dim) == 0, "q width must be a multiple of kv_heads * head_dim");
  s.group = q.size(1) / (s.kv_heads * s.head_dim);
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* rp = rows.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t nb = cache.size(0);
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(sp[c] >= 0 && lp[c] >= 1, "chunk start must be >= 0 and length >= 1");
    TORCH_CHECK(rp[c] >= 0 && rp[c] + lp[c] <= q.size(0), "chunk rows outside q");
    const int64_t ctx = static_cast<int64_t>(sp[c]) + lp[c];
    TORCH_CHECK(ctx <= s.max_blocks * s.block_size, "chunk context outside its block table");
    for (int64_t i = 0; i < (ctx + s.block_size - 1) / s.block_size; ++i) {
      TORCH_CHECK(tp[c * s.max_blocks + i] >= 0 && tp[c * s.max_blocks + i] < nb, "block id out of range");
    }
  }
  at::Tensor out = at::empty({q.size(0), q.size(1)}, q.options());
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    prefill(q.data_ptr<float>(), cache.data_ptr<float>(), layer, tp, sp, lp, rp, chunks, sc, out.data_ptr<float>(), s);
  } else if (q.scalar_type() == at::kBFloat16) {
    prefill(q.data_ptr<c10::BFloat16>(), cache.data_ptr<c10::BFloat16>(), layer, tp, sp, lp, rp, chunks, sc,
            out.data_ptr<c10::BFloat16>(), s);
  } else {
    TORCH_CHECK(false, "paged_prefill_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor cache, int layer, Tensor tables, Tensor starts, Tensor lens, "
        "Tensor rows, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
