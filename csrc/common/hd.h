// Host/device portability for the codec math shared by the CPU and CUDA kernels.
// Nothing here includes torch: these headers compile under g++ and nvcc alike.
#pragma once

#if defined(__CUDACC__)
#define GC_HD __host__ __device__ __forceinline__
#else
#define GC_HD inline
#endif

#include <cstdint>
#include <cstring>

namespace gradcomp {

GC_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

GC_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// |x| as an unsigned key whose integer order is the magnitude order of IEEE floats:
// +0 == -0 < subnormals < normals < Inf < NaN (every NaN above Inf).
GC_HD uint32_t magnitude_key(float x) { return float_bits(x) & 0x7FFFFFFFu; }

GC_HD bool is_finite(float x) { return magnitude_key(x) < 0x7F800000u; }

// Saturating fp32 arithmetic: finite operands whose exact result lies beyond fp32 give +-FLT_MAX
// (0x7F7FFFFF, with the sign of the overflowed result) instead of +-Inf; any NaN or Inf operand
// gives the plain IEEE result, so a real NaN or Inf is never hidden. Branch-free selects, so
// loops using them still vectorize.
constexpr uint32_t kMaxFiniteBits = 0x7F7FFFFFu;  // FLT_MAX

// +-FLT_MAX with the sign of x.
GC_HD float max_finite_like(float x) { return bits_float((float_bits(x) & 0x80000000u) | kMaxFiniteBits); }

GC_HD float saturate_overflow(float a, float b, float result) {
  const bool overflow = is_finite(a) & is_finite(b) & !is_finite(result);
  return overflow ? max_finite_like(result) : result;
}

GC_HD float add_saturating(float a, float b) { return saturate_overflow(a, b, a + b); }
GC_HD float sub_saturating(float a, float b) { return saturate_overflow(a, b, a - b); }
GC_HD float mul_saturating(float a, float b) { return saturate_overflow(a, b, a * b); }

}  // namespace gradcomp
