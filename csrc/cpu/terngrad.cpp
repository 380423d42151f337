// terngrad: each element becomes q * scale with q in {-1, 0, +1} and scale = max |m| over the
// bucket; q = sign(m) with probability |m| / scale (so the decoded value is unbiased), else 0.
// Body: fp32 scale, then ceil(n / 4) bytes of 2-bit codes, element i at bits 2 * (i % 4) of byte
// i / 4: bit 0 "non-zero", bit 1 "negative". The coin of element i is
// unit_uniform(word i % 4 of rounding_block(key, i / 4)) < |m| * (1 / scale).
// A NaN or Inf anywhere makes the scale non-finite, and the whole bucket then decodes as NaN.
#include "../common/random.h"
#include "chunked.h"

namespace gradcomp::codecs {
namespace {

template <typename T>
float max_abs(const T* grad, const T* residual, int64_t n) {
  uint32_t key = 0;  // magnitude keys order like |m| and put NaN above Inf
  for (int64_t i = 0; i < n; ++i) key = std::max(key, magnitude_key(compensated(grad, residual, i)));
  return bits_float(key);
}

template <typename T>
void encode_typed(const EncodeArgs& a) {
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  const int64_t n = a.header.numel;
  const float scale = max_abs(grad, residual, n);
  const float inverse = scale > 0.0f && is_finite(scale) ? 1.0f / scale : 0.0f;
  *field<float>(a.payload, kHeaderBytes) = scale;
  uint8_t* codes = a.payload + body_layout(a.header).codes;
  const RandomKey key{a.header.seed, a.header.step, a.header.bucket, a.rank};
  for (int64_t group = 0; group * 4 < n; ++group) {
    const Philox4 random = rounding_block(key, static_cast<uint64_t>(group));
    const int64_t begin = group * 4;
    const int64_t len = std::min<int64_t>(4, n - begin);
    uint32_t packed = 0;
    for (int64_t j = 0; j < len; ++j) {
      const float m = compensated(grad, residual, begin + j);
      const bool nonzero = unit_uniform(random.v[j]) < __builtin_fabsf(m) * inverse;
      const bool negative = m < 0.0f;
      const float q = nonzero ? (negative ? -1.0f : 1.0f) : 0.0f;
      packed |= (static_cast<uint32_t>(nonzero) | (static_cast<uint32_t>(nonzero && negative) << 1)) << (2 * j);
      store_residual(residual, begin + j, m, q * scale);
    }
    codes[group] = static_cast<uint8_t>(packed);
  }
}

template <typename T>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  const int64_t offset = body_layout(h).codes;
  sum_payloads<T>(a, h.numel, [&](const uint8_t* payload, int64_t begin, int64_t len, float* acc) {
    const float scale = *field<float>(payload, kHeaderBytes);
    const uint8_t* codes = payload + offset;
    for (int64_t i = 0; i < len; ++i) {
      const int64_t e = begin + i;
      const uint32_t code = (codes[e >> 2] >> (2 * (e & 3))) & 3u;
      const float q = (code & 1u) ? ((code & 2u) ? -1.0f : 1.0f) : 0.0f;
      acc[i] += q * scale;
    }
  });
}

}  // namespace

void encode_terngrad(const EncodeArgs& a) {
  visit_dtype(static_cast<DType>(a.header.dtype),
              [&](auto* t) { encode_typed<std::remove_pointer_t<decltype(t)>>(a); });
}

void decode_terngrad(const DecodeArgs& a, const PayloadHeader& h) {
  visit_dtype(static_cast<DType>(h.dtype),
              [&](auto* t) { decode_typed<std::remove_pointer_t<decltype(t)>>(a, h); });
}

}  // namespace gradcomp::codecs
