// float32 matmuls on a weight packed once by MKL (cblas_sgemm_pack / cblas_sgemm_compute).
//
// torch's mm calls MKL's sgemm, which copies the weight into its blocked layout on every call.
// At decode row counts (M = 2..64) that copy costs about as much as the products: measured here,
// the same products on a weight packed once at load run 1.1-1.5x faster at M = 8..64 and as fast
// at prefill sizes, with the same results (MKL's own kernels).
//
//   blas_pack(w [N, K])                 -> opaque float32 buffer (a linear weight, out = x @ w^T)
//   blas_packed_mm(x [M, K], wp, n, add) -> [M, n]: x @ w^T (+ add: a bias [n] or a residual [M, n],
//                                          added by MKL itself, beta = 1)
//
// The MKL entry points are looked up at run time in the torch library already loaded, so this
// library still loads on a torch built without MKL; blas_packed_available() says which.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <cstdint>
#include <mutex>

namespace {

// CBLAS enum values (mkl_cblas.h)
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
// The M a pack is made for; compute takes any M. MKL picks the packed blocking from it (measured
// 2026-12-03, Intel Xeon, small's shapes): packed for M = 32, calls of 256+ rows ran 0.6-0.8x
// torch's mm; packed for 2,048, the [1536 -> 576] projection ran 0.5x at every M on two threads;
// packed for 256, M 8-256 ran 1.05-1.5x and M 1,024 0.74-1.1x. The kernel selector times M 1,024
// too, so a call where that costs more than decode gains stays on dense.
constexpr int kPackRows = 256;

using PackGetSize = size_t (*)(int, int, int, int);
using Pack = void (*)(int, int, int, int, int, int, float, const float*, int, float*);
using Compute = void (*)(int, int, int, int, int, int, const float*, int, const float*, int, float, float*, int);

struct Blas {
  PackGetSize get_size = nullptr;
  Pack pack = nullptr;
  Compute compute = nullptr;
  bool ok() const { return get_size && pack && compute; }
};

void* find(const char* name) {
  if (void* p = dlsym(RTLD_DEFAULT, name)) return p;
  // torch's extension modules load libtorch_cpu locally: look in it by name, without loading anything
  if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)) return dlsym(lib, name);
  return nullptr;
}

const Blas& blas() {
  static Blas b;
  static std::once_flag once;
  std::call_once(once, [] {
    b.get_size = reinterpret_cast<PackGetSize>(find("cblas_sgemm_pack_get_size"));
    b.pack = reinterpret_cast<Pack>(find("cblas_sgemm_pack"));
    b.compute = reinterpret_cast<Compute>(find("cblas_sgemm_compute"));
  });
  return b;
}

bool blas_packed_available() { return blas().ok(); }

at::Tensor blas_pack(const at::Tensor& w) {
  const Blas& b = blas();
  TORCH_CHECK(b.ok(), "MKL's packed GEMM is not in this torch build");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2, "w must be a float32 [N, K]");
  const at::Tensor wc = w.contiguous();
  const int n = static_cast<int>(wc.size(0)), k = static_cast<int>(wc.size(1));
  const size_t bytes = b.get_size(kBMatrix, kPackRows, n, k);
  // the packed data must stay at the address it was packed to: the tensor never moves it
  at::Tensor out = at::empty({static_cast<int64_t>((bytes + 3) / 4)}, wc.options());
  b.pack(kRowMajor, kBMatrix, kTrans, kPackRows, n, k, 1.0f, wc.data_ptr<float>(), k, out.data_ptr<float>());
  return out;
}

at::Tensor blas_packed_mm(const at::Tensor& x, const at::Tensor& wp, int64_t n, const std::optional<at::Tensor>& add) {
  const Blas& b = blas();
  TORCH_CHECK(b.ok(), "MKL's packed GEMM is not in this torch build");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "x must be a float32 [M, K] with unit column stride");
  TORCH_CHECK(wp.scalar_type() == at::kFloat && wp.dim() == 1 && wp.is_contiguous(), "wp must come from blas_pack");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m <= 1 || x.stride(0) >= k, "x's rows must not overlap (row stride >= K)");
  TORCH_CHECK(n > 0 && static_cast<size_t>(wp.numel()) * 4 >= b.get_size(kBMatrix, kPackRows, n, k),
              "wp is smaller than a packed [", n, ", ", k, "] weight");
  at::Tensor out = at::empty({m, n}, x.options());  // always fresh: MKL writes C, never the caller's add
  float beta = 0.f;
  if (add.has_value()) {
    TORCH_CHECK(add->scalar_type() == at::kFloat, "add must be float32");
    TORCH_CHECK((add->dim() == 1 && add->size(0) == n) || (add->dim() == 2 && add->size(0) == m && add->size(1) == n),
                "add must be [n] or [M, n]");
    out.copy_(add->expand({m, n}));
    beta = 1.f;
  }
  if (m > 0) {
    b.compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              x.data_ptr<float>(), static_cast<int>(x.stride(0)), wp.data_ptr<float>(), static_cast<int>(n), beta,
              out.data_ptr<float>(), static_cast<int>(n));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("blas_packed_available() -> bool", &blas_packed_available);
  m.def("blas_pack(Tensor w) -> Tensor");
  m.def("blas_packed_mm(Tensor x, Tensor wp, int n, Tensor? add=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("blas_pack", &blas_pack);
  m.impl("blas_packed_mm", &blas_packed_mm);
}
