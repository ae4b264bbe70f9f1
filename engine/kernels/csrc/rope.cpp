// Rotary position embedding in place, the rotate-half form of Hugging Face's Llama:
//   out[i]        = x[i] * cos[i]        - x[i + half] * sin[i]
//   out[i + half] = x[i + half] * cos[i] + x[i] * sin[i]
// qk:  [tokens, heads, head_dim] with unit stride along head_dim and heads head_dim apart (the
//      query and key columns of the fused qkv activation, as a view); rotated in place
// cos, sin: [tokens, 1, head_dim] rows for each token's position; sin is the signed table of
//      engine/layers.py RotaryTables (its first half negated), so both halves are one FMA each
// One pass over the activation with float32 arithmetic and one rounding per element; torch's
// mul_ + flip + addcmul_ sequence reads it three times and rounds twice in bfloat16.

#include "vec_host.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

using namespace pdserve_vec;

template <typename T>
void rope_rows(T* qk, int64_t tokens, int64_t heads, int64_t dim, int64_t row_stride, const T* cos, const T* sin) {
  const int64_t half = dim / 2, full = half - half % kW;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qk + t * row_stride + h * dim;
        for (int64_t i = 0; i < full; i += kW) {
          const fVec a = load(x + i), b = load(x + half + i);
          const fVec lo = at::vec::fmadd(b, load(s + i), a * load(c + i));
          const fVec hi = at::vec::fmadd(a, load(s + half + i), b * load(c + half + i));
          alignas(64) float tmp[2 * kW];
          lo.store(tmp);
          hi.store(tmp + kW);
          for (int64_t l = 0; l < kW; ++l) {
            x[i + l] = static_cast<T>(tmp[l]);
            x[half + i + l] = static_cast<T>(tmp[kW + l]);
          }
        }
        for (int64_t i = full; i < half; ++i) {
          const float a = to_float(x[i]), b = to_float(x[half + i]);
          x[i] = static_cast<T>(a * to_float(c[i]) + b * to_float(s[i]));
          x[half + i] = static_cast<T>(b * to_float(c[half + i]) + a * to_float(s[half + i]));
        }
      }
    }
  });
}

void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.device().is_cpu(), "rope_ runs on CPU");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "qk must be [tokens, heads, head_dim] with unit stride and heads head_dim apart");
  TORCH_CHECK(qk.size(2) % 2 == 0, "head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->numel() == qk.size(0) * qk.size(2) && t->scalar_type() == qk.scalar_type(),
                "cos and sin must be contiguous [tokens, 1, head_dim] tensors of qk's dtype");
  }
  if (qk.scalar_type() == at::kFloat) {
    rope_rows(qk.data_ptr<float>(), qk.size(0), qk.size(1), qk.size(2), qk.stride(0), cos.data_ptr<float>(),
              sin.data_ptr<float>());
  } else if (qk.scalar_type() == at::kBFloat16) {
    rope_rows(qk.data_ptr<c10::BFloat16>(), qk.size(0), qk.size(1), qk.size(2), qk.stride(0),
              cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "rope_ supports float32 and bfloat16, got ", qk.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) { m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()"); }

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("rope_", &rope_); }
