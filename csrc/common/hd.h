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

}  // namespace gradcomp
