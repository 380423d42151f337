// qsgd with s levels and blocks of B elements. Per block: norm = ||m_block||_2 (canonical
// summation order, fp32 result); element m becomes sign(m) * level * (norm / s) where
// r = |m| * (s / norm), level = floor(r) + (coin < r - floor(r)), 0 <= level <= s, so the decoded
// value is unbiased. Body: ceil(n / B) fp32 norms, then a little-endian bit stream of n codes of
// w = 1 + ceil(log2(s + 1)) bits: code = (level << 1) | (m < 0), element i at bits [i*w, i*w + w).
// The coin of element i is unit_uniform(word i % 4 of rounding_block(key, i / 4)).
// A block holding NaN or Inf has a non-finite norm and decodes as NaN.
#include <cmath>

#include "../common/random.h"
#include "../common/reduce.h"
#include "chunked.h"

namespace gradcomp::codecs {
namespace {

struct BitWriter {
  uint8_t* out;
  uint64_t buffer = 0;
  int filled = 0;
  void put(uint32_t code, int bits) {
    buffer |= static_cast<uint64_t>(code) << filled;
    filled += bits;
    while (filled >= 8) {
      *out++ = static_cast<uint8_t>(buffer);
      buffer >>= 8;
      filled -= 8;
    }
  }
  void flush() {
    if (filled > 0) *out++ = static_cast<uint8_t>(buffer);
  }
};

// Reads codes from a byte-aligned position; never reads past the last byte it needs.
struct BitReader {
  const uint8_t* in;
  uint64_t buffer = 0;
  int filled = 0;
  uint32_t get(int bits) {
    while (filled < bits) {
      buffer |= static_cast<uint64_t>(*in++) << filled;
      filled += 8;
    }
    const uint32_t code = static_cast<uint32_t>(buffer & ((uint64_t{1} << bits) - 1));
    buffer >>= bits;
    filled -= bits;
    return code;
  }
};

template <typename T>
void encode_typed(const EncodeArgs& a) {
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  const PayloadHeader& h = a.header;
  const int64_t n = h.numel, block = h.param1;
  const float levels = static_cast<float>(h.param0);
  const int bits = qsgd_code_bits(h.param0);
  const BodyLayout layout = body_layout(h);
  float* norms = field<float>(a.payload, layout.scales);
  BitWriter writer{a.payload + layout.codes};
  const RandomKey key{h.seed, h.step, h.bucket, a.rank};
  Philox4 random{};
  for (int64_t begin = 0, b = 0; begin < n; begin += block, ++b) {
    const int64_t len = std::min(block, n - begin);
    const double squares = canonical_sum(len, [&](int64_t i) {
      const float m = compensated(grad, residual, begin + i);
      return m * m;
    });
    const float norm = std::sqrt(static_cast<float>(squares));
    norms[b] = norm;
    const float inverse = norm > 0.0f && is_finite(norm) ? levels / norm : 0.0f;
    const float step = norm / levels;
    for (int64_t e = begin; e < begin + len; ++e) {
      if ((e & 3) == 0 || e == begin) random = rounding_block(key, static_cast<uint64_t>(e >> 2));
      const float m = compensated(grad, residual, e);
      float r = __builtin_fabsf(m) * inverse;
      if (!(r >= 0.0f)) r = 0.0f;
      if (r > levels) r = levels;
      const float floor_r = std::floor(r);
      const uint32_t level =
          static_cast<uint32_t>(floor_r) + (unit_uniform(random.v[e & 3]) < r - floor_r ? 1u : 0u);
      const bool negative = m < 0.0f;
      writer.put((level << 1) | static_cast<uint32_t>(negative), bits);
      const float magnitude = static_cast<float>(level) * step;
      store_residual(residual, e, m, negative ? -magnitude : magnitude);
    }
  }
  writer.flush();
}

template <typename T>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  const BodyLayout layout = body_layout(h);
  const int64_t block = h.param1;
  const float levels = static_cast<float>(h.param0);
  const int bits = qsgd_code_bits(h.param0);
  sum_payloads<T>(a, h.numel, [&](const uint8_t* payload, int64_t begin, int64_t len, float* acc) {
    const float* norms = field<float>(payload, layout.scales);
    BitReader reader{payload + layout.codes + begin * bits / 8};  // begin * bits is a multiple of 8
    int64_t b = begin / block;
    int64_t block_end = (b + 1) * block;
    float step = norms[b] / levels;
    for (int64_t i = 0; i < len; ++i) {
      if (begin + i == block_end) {
        ++b;
        block_end += block;
        step = norms[b] / levels;
      }
      const uint32_t code = reader.get(bits);
      const float magnitude = static_cast<float>(code >> 1) * step;
      acc[i] += (code & 1u) ? -magnitude : magnitude;
    }
  });
}

}  // namespace

void encode_qsgd(const EncodeArgs& a) {
  visit_dtype(static_cast<DType>(a.header.dtype),
              [&](auto* t) { encode_typed<std::remove_pointer_t<decltype(t)>>(a); });
}

void decode_qsgd(const DecodeArgs& a, const PayloadHeader& h) {
  visit_dtype(static_cast<DType>(h.dtype),
              [&](auto* t) { decode_typed<std::remove_pointer_t<decltype(t)>>(a, h); });
}

}  // namespace gradcomp::codecs
