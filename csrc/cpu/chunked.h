// Helpers shared by the CPU codec files: element access, error-feedback chunks and the chunked
// decode-and-sum loop. Loops are written branch-free over small chunks so that the compiler
// vectorizes them in each instruction-set variant (see CMakeLists.txt).
#pragma once

#include <algorithm>
#include <type_traits>

#include "kernels.h"

// The per-codec files are compiled once per instruction-set variant, each into its own namespace.
#ifndef GC_CODECS_NS
#define GC_CODECS_NS codecs_base
#endif

namespace gradcomp {

// The gradient plus the old residual, in fp32: what a codec compresses under error feedback.
template <bool kResidual, typename T>
inline float compensated(const T* grad, const T* residual, int64_t i) {
  if constexpr (kResidual) return to_float(grad[i]) + to_float(residual[i]);
  return to_float(grad[i]);
}

template <bool kResidual, typename T>
inline void load_compensated(const T* grad, const T* residual, int64_t begin, int64_t len, float* m) {
  for (int64_t i = 0; i < len; ++i) m[i] = compensated<kResidual>(grad, residual, begin + i);
}

// residual = m - decoded over one chunk.
template <typename T>
inline void store_residuals(T* residual, int64_t begin, int64_t len, const float* m, const float* decoded) {
  for (int64_t i = 0; i < len; ++i) residual[begin + i] = from_float<T>(m[i] - decoded[i]);
}

// Calls f(grad_type, std::bool_constant<has residual>) for an encode call.
template <typename F>
void visit_encode(const EncodeArgs& a, F&& f) {
  visit_dtype(static_cast<DType>(a.header.dtype), [&](auto* t) {
    if (a.residual) f(t, std::true_type{});
    else f(t, std::false_type{});
  });
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

// Decoded multipliers for every value of a code byte: signs (8 per byte, +1 for a set bit, -1
// for a clear one) and ternary codes (4 per byte: 0, +1, 0, -1 for codes 0..3).
struct ByteTables {
  float sign[256][8];
  float ternary[256][4];
  ByteTables() {
    for (int byte = 0; byte < 256; ++byte) {
      for (int j = 0; j < 8; ++j) sign[byte][j] = ((byte >> j) & 1) ? 1.0f : -1.0f;
      for (int j = 0; j < 4; ++j) {
        const int code = (byte >> (2 * j)) & 3;
        ternary[byte][j] = (code & 1) ? ((code & 2) ? -1.0f : 1.0f) : 0.0f;
      }
    }
  }
};

inline const ByteTables& byte_tables() {
  static const ByteTables tables;
  return tables;
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
