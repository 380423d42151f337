// terngrad: each element becomes q * scale with q in {-1, 0, +1} and scale = max |m| over the
// bucket; q = sign(m) with probability |m| / scale (so the decoded value is unbiased), else 0.
// Body: fp32 scale, then ceil(n / 4) bytes of 2-bit codes, element i at bits 2 * (i % 4) of byte
// i / 4: bit 0 "non-zero", bit 1 "negative". Element i is non-zero when
// unit_uniform(rounding_word(key, i)) < |m| * (1 / scale).
// A NaN or Inf anywhere makes the scale non-finite, and the whole bucket then decodes as NaN.
// For finite m (at most FLT_MAX, compensated() saturates) nothing overflows: q * scale is exact,
// and a subnormal scale whose inverse overflows to Inf sends every non-zero element as +-scale
// (|m| * Inf = Inf) and no zero one (0 * Inf = NaN): still finite.
// decode_sum adds, per payload in order, q * (alpha * scale) (fp32 add_saturating, from +0).
#include "chunked.h"
#include "simd.h"

namespace gradcomp::GC_CODECS_NS {
namespace {

constexpr int64_t kChunk = 2 * kTile;  // one pair of random tiles

template <typename T, bool kResidual>
float max_abs(ParallelFor parallel_for, const T* grad, const T* residual, int64_t n) {
  // Magnitude keys order like |m| and put NaN above Inf; the maximum does not depend on order.
  std::vector<uint32_t> partial(ceil_div(n, kReduceChunk), 0);
  parallel_chunks(parallel_for, n, kReduceChunk, [&](int64_t begin, int64_t len) {
    uint32_t key = 0;
    for (int64_t i = begin; i < begin + len; ++i) key = std::max(key, magnitude_key(compensated<kResidual>(grad, residual, i)));
    partial[begin / kReduceChunk] = key;
  });
  return bits_float(partial.empty() ? 0u : *std::max_element(partial.begin(), partial.end()));
}

// One chunk (a pair of random tiles) of the second pass; parameters, not captures: see signsgd.cpp.
template <typename T, bool kResidual>
void encode_chunk(const T* grad, T* residual, float scale, float inverse, RandomKey key, uint8_t* codes,
                  int64_t begin, int64_t len) {
  float m[kChunk], uniform[kChunk], decoded[kChunk];
  uint8_t code[kChunk];
  load_compensated<kResidual>(grad, residual, begin, len, m);
  tile_uniforms_x2(key, static_cast<uint64_t>(begin / kChunk), uniform);
  for (int64_t i = 0; i < len; ++i) {
    const bool nonzero = uniform[i] < __builtin_fabsf(m[i]) * inverse;
    const bool negative = m[i] < 0.0f;
    const float q = nonzero ? (negative ? -1.0f : 1.0f) : 0.0f;
    decoded[i] = q * scale;
    code[i] = static_cast<uint8_t>(nonzero | ((nonzero & negative) << 1));
  }
  for (int64_t i = len; i < ceil_div(len, 4) * 4; ++i) code[i] = 0;
  for (int64_t byte = 0; byte < ceil_div(len, 4); ++byte) {
    const uint8_t* c = code + 4 * byte;
    codes[begin / 4 + byte] = static_cast<uint8_t>(c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6);
  }
  if constexpr (kResidual) store_residuals(residual, begin, len, m, decoded);
}

template <typename T, bool kResidual>
void encode_typed(const EncodeArgs& a) {
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  const int64_t n = a.header.numel;
  const float scale = max_abs<T, kResidual>(a.parallel_for, grad, residual, n);
  const float inverse = scale > 0.0f && is_finite(scale) ? 1.0f / scale : 0.0f;
  *field<float>(a.payload, kHeaderBytes) = scale;
  uint8_t* codes = a.payload + body_layout(a.header).codes;
  const RandomKey key{a.header.seed, a.header.step, a.header.bucket, a.rank};
  parallel_chunks(a.parallel_for, n, kChunk, [&](int64_t begin, int64_t len) {
    encode_chunk<T, kResidual>(grad, residual, scale, inverse, key, codes, begin, len);
  });
}

template <typename T>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  sum_scaled_byte_codes<T, 4>(a, h.numel, byte_tables().ternary, body_layout(h).codes);
}

}  // namespace

GRADCOMP_TYPED_ENTRY_POINTS(terngrad)

}  // namespace gradcomp::GC_CODECS_NS
