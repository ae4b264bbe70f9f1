// Few-row matmul that streams the weight once: out = add + x @ w, for decode batch 1 (M <= 8).
//
// x:   [M, K] float32 or bfloat16 (unit column stride)
// w:   [K, N] contiguous, x's dtype (the transposed [in, out] weight DenseLinear keeps)
// add: optional [N] (a bias) or [M, N] (a residual), x's dtype
// returns [M, N] of x's dtype; products accumulate in float32.
//
// The K rows are split among the threads (split-K): each thread streams one contiguous run of the
// weight, four rows at a time, into its own float32 partial [M, N]; the partials are summed once.

#include "vec_host.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace pdserve_vec;

constexpr int64_t kMaxRows = 8;

template <typename T>
void rows_into(const float* x, int64_t m_rows, int64_t k0, int64_t k1, int64_t kdim, const T* w, int64_t n,
               float* part) {
  const int64_t full = n - n % kW;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const T* w0 = w + k * n;
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xm = x + m * kdim + k;
      const fVec a0(xm[0]), a1(xm[1]), a2(xm[2]), a3(xm[3]);
      float* p = part + m * n;
      for (int64_t j = 0; j < full; j += kW) {
        fVec acc = fVec::loadu(p + j);
        acc = at::vec::fmadd(a0, load(w0 + j), acc);
        acc = at::vec::fmadd(a1, load(w0 + n + j), acc);
        acc = at::vec::fmadd(a2, load(w0 + 2 * n + j), acc);
        acc = at::vec::fmadd(a3, load(w0 + 3 * n + j), acc);
        acc.store(p + j);
      }
      for (int64_t j = full; j < n; ++j) {
        p[j] += xm[0] * to_float(w0[j]) + xm[1] * to_float(w0[n + j]) + xm[2] * to_float(w0[2 * n + j]) +
                xm[3] * to_float(w0[3 * n + j]);
      }
    }
  }
  for (; k < k1; ++k) {
    for (int64_t m = 0; m < m_rows; ++m) {
      const float a = x[m * kdim + k];
      float* p = part + m * n;
      for (int64_t j = 0; j < n; ++j) p[j] += a * to_float(w[k * n + j]);
    }
  }
}

template <typename T>
void gemv(const T* x, int64_t x_stride, int64_t m_rows, int64_t kdim, const T* w, int64_t n, const T* add,
          int64_t add_row_stride, T* out) {
  std::vector<float> xf(m_rows * kdim);
  for (int64_t m = 0; m < m_rows; ++m) {
    for (int64_t k = 0; k < kdim; ++k) xf[m * kdim + k] = to_float(x[m * x_stride + k]);
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), kdim / 64));
  std::vector<float> parts(threads * m_rows * n, 0.f);
  const int64_t chunk = (kdim + threads - 1) / threads;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t k0 = t * chunk, k1 = std::min(kdim, k0 + chunk);
      if (k0 < k1) rows_into(xf.data(), m_rows, k0, k1, kdim, w, n, &parts[t * m_rows * n]);
    }
  });
  for (int64_t m = 0; m < m_rows; ++m) {
    for (int64_t j = 0; j < n; ++j) {
      float s = add ? to_float(add[m * add_row_stride + j]) : 0.f;
      for (int64_t t = 0; t < threads; ++t) s += parts[(t * m_rows + m) * n + j];
      out[m * n + j] = static_cast<T>(s);
    }
  }
}

at::Tensor gemv_add(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& add) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv runs on CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with unit column stride");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "gemv takes 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(0) == x.size(1), "w must be a contiguous [K, N] tensor");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "x and w must have the same dtype");
  const int64_t m_rows = x.size(0), kdim = x.size(1), n = w.size(1);
  const void* add_ptr = nullptr;
  int64_t add_stride = 0;
  at::Tensor add_c;
  if (add.has_value()) {
    add_c = add->contiguous();
    TORCH_CHECK(add_c.scalar_type() == x.scalar_type(), "add must have x's dtype");
    TORCH_CHECK((add_c.dim() == 1 && add_c.size(0) == n) ||
                    (add_c.dim() == 2 && add_c.size(0) == m_rows && add_c.size(1) == n),
                "add must be [N] or [M, N]");
    add_ptr = add_c.data_ptr();
    add_stride = add_c.dim() == 2 ? n : 0;
  }
  at::Tensor out = at::empty({m_rows, n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    gemv(x.data_ptr<float>(), x.stride(0), m_rows, kdim, w.data_ptr<float>(), n,
         static_cast<const float*>(add_ptr), add_stride, out.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    gemv(x.data_ptr<c10::BFloat16>(), x.stride(0), m_rows, kdim, w.data_ptr<c10::BFloat16>(), n,
         static_cast<const c10::BFloat16*>(add_ptr), add_stride, out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "gemv supports float32 and bfloat16, got ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) { m.def("gemv(Tensor x, Tensor w, Tensor? add=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("gemv", &gemv_add); }
