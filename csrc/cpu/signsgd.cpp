// signsgd: one sign bit per element and one fp32 scale, the mean |m| of the bucket
// (m = gradient + residual). Body: scale, then ceil(n / 8) bytes; element i is bit (i % 8) of
// byte i / 8, 1 for "+" (m >= 0, or NaN) and 0 for "-" (m < 0). Element i decodes to +scale or
// -scale. With vote, decode-and-sum gives alpha * (sum of scales) * sign(sum of signs), 0 on a tie.
#include <vector>

#include "../common/reduce.h"
#include "chunked.h"

namespace gradcomp::codecs {
namespace {

template <typename T>
float mean_abs(const T* grad, const T* residual, int64_t n) {
  const double total =
      canonical_sum(n, [&](int64_t i) { return __builtin_fabsf(compensated(grad, residual, i)); });
  return n > 0 ? static_cast<float>(total / static_cast<double>(n)) : 0.0f;
}

template <typename T>
void encode_typed(const EncodeArgs& a) {
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  const int64_t n = a.header.numel;
  const float scale = mean_abs(grad, residual, n);
  *field<float>(a.payload, kHeaderBytes) = scale;
  uint8_t* bits = a.payload + body_layout(a.header).codes;
  for (int64_t byte = 0; byte * 8 < n; ++byte) {
    const int64_t begin = byte * 8;
    const int64_t len = std::min<int64_t>(8, n - begin);
    uint32_t packed = 0;
    for (int64_t j = 0; j < len; ++j) {
      const float m = compensated(grad, residual, begin + j);
      const bool positive = !(m < 0.0f);
      packed |= static_cast<uint32_t>(positive) << j;
      store_residual(residual, begin + j, m, positive ? scale : -scale);
    }
    bits[byte] = static_cast<uint8_t>(packed);
  }
}

inline bool sign_bit(const uint8_t* bits, int64_t i) { return (bits[i >> 3] >> (i & 7)) & 1; }

template <typename T>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  const int64_t codes = body_layout(h).codes;
  if (!a.vote) {
    sum_payloads<T>(a, h.numel, [&](const uint8_t* payload, int64_t begin, int64_t len, float* acc) {
      const float scale = *field<float>(payload, kHeaderBytes);
      const uint8_t* bits = payload + codes;
      for (int64_t i = 0; i < len; ++i) acc[i] += sign_bit(bits, begin + i) ? scale : -scale;
    });
    return;
  }
  float scale_sum = 0.0f;
  for (int64_t p = 0; p < a.count; ++p) scale_sum += *field<float>(a.payloads + p * a.stride, kHeaderBytes);
  const float magnitude = a.alpha * scale_sum;
  T* out = static_cast<T*>(a.out);
  std::vector<int32_t> votes(std::min(kDecodeChunk, h.numel));
  for (int64_t begin = 0; begin < h.numel; begin += kDecodeChunk) {
    const int64_t len = std::min(kDecodeChunk, h.numel - begin);
    std::fill(votes.begin(), votes.begin() + len, 0);
    for (int64_t p = 0; p < a.count; ++p) {
      const uint8_t* bits = a.payloads + p * a.stride + codes;
      for (int64_t i = 0; i < len; ++i) votes[i] += sign_bit(bits, begin + i) ? 1 : -1;
    }
    for (int64_t i = 0; i < len; ++i)
      out[begin + i] = from_float<T>(votes[i] > 0 ? magnitude : votes[i] < 0 ? -magnitude : 0.0f);
  }
}

}  // namespace

void encode_signsgd(const EncodeArgs& a) {
  visit_dtype(static_cast<DType>(a.header.dtype),
              [&](auto* t) { encode_typed<std::remove_pointer_t<decltype(t)>>(a); });
}

void decode_signsgd(const DecodeArgs& a, const PayloadHeader& h) {
  visit_dtype(static_cast<DType>(h.dtype),
              [&](auto* t) { decode_typed<std::remove_pointer_t<decltype(t)>>(a, h); });
}

}  // namespace gradcomp::codecs
