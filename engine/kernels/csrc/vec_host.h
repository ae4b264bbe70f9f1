// at::vec compiled for the host (-march=native): the widest instruction set the compiler enables.
// CPU_CAPABILITY names at::vec's inline namespace, kept apart from libtorch's own copies.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
#define CPU_CAPABILITY pdserve_native

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

namespace pdserve_vec {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kW = fVec::size();

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline fVec load(const float* p) { return fVec::loadu(p); }
inline fVec load(const c10::BFloat16* p) {
  fVec out;
  at::vec::load_to_float(p, out);
  return out;
}

}  // namespace pdserve_vec
