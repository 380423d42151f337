// Helpers shared by the CPU codec files: element access and the chunked decode-and-sum loop.
#pragma once

#include <algorithm>

#include "kernels.h"

namespace gradcomp {

// The gradient plus the old residual, in fp32: what a codec compresses under error feedback.
template <typename T>
inline float compensated(const T* grad, const T* residual, int64_t i) {
  return residual ? to_float(grad[i]) + to_float(residual[i]) : to_float(grad[i]);
}

template <typename T>
inline void store_residual(T* residual, int64_t i, float compensated_value, float decoded) {
  if (residual) residual[i] = from_float<T>(compensated_value - decoded);
}

constexpr int64_t kDecodeChunk = 2048;

// out[i] = alpha * sum over payloads p (in order) of decoded_p[i], accumulated in fp32.
// add(payload, begin, len, acc) adds payload's decoded values [begin, begin + len) into acc.
// The chunk start is always a multiple of kDecodeChunk (a multiple of 8, so bit codes align).
template <typename T, typename AddPayload>
void sum_payloads(const DecodeArgs& args, int64_t numel, AddPayload&& add) {
  float acc[kDecodeChunk];
  T* out = static_cast<T*>(args.out);
  for (int64_t begin = 0; begin < numel; begin += kDecodeChunk) {
    const int64_t len = std::min(kDecodeChunk, numel - begin);
    std::fill(acc, acc + len, 0.0f);
    for (int64_t p = 0; p < args.count; ++p) add(args.payloads + p * args.stride, begin, len, acc);
    for (int64_t i = 0; i < len; ++i) out[begin + i] = from_float<T>(acc[i] * args.alpha);
  }
}

template <typename T>
inline const T* field(const uint8_t* payload, int64_t offset) {
  return reinterpret_cast<const T*>(payload + offset);
}

template <typename T>
inline T* field(uint8_t* payload, int64_t offset) {
  return reinterpret_cast<T*>(payload + offset);
}

}  // namespace gradcomp
