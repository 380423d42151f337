// signsgd: one sign bit per element and one fp32 scale, the mean |m| of the bucket
// (m = gradient + residual): scale = (float)(total / n), total the canonical sum (reduce.h, double
// lanes) of (double)|m| and the division in double; it cannot overflow for finite m (the mean is
// at most max |m| <= FLT_MAX). With norm_scale (the two-phase owner re-encoding a sum of signs),
// scale = (float)sqrt(total / n) of the canonical sum of (double)m * m instead: the root mean square,
// so that the signs carry the norm of m. Body: scale, then ceil(n / 8) bytes; element i is bit (i % 8) of
// byte i / 8, 1 for "+" (m >= 0, or NaN) and 0 for "-" (m < 0). Element i decodes to +scale or
// -scale. decode_sum adds, per payload in order, +-(alpha * scale) (fp32 add_saturating, from +0).
// With vote: magnitude = sum over payloads in order of (alpha * scale), fp32 add_saturating from
// +0, and the
// element is +magnitude, -magnitude or, on a tie, 0.0f * magnitude (+0 for a finite magnitude,
// NaN for a non-finite one).
#include <cmath>

#include "chunked.h"

namespace gradcomp::GC_CODECS_NS {
namespace {

constexpr int64_t kChunk = 256;  // a multiple of 8: chunks start on whole bytes

// One chunk of the second pass. A function of its own, with the scale and pointers as parameters:
// inside a lambda capturing them by reference, each byte stored could alias them (char stores
// alias anything) and the compiler would reload them and give up vectorizing.
template <typename T, bool kResidual>
void encode_chunk(const T* grad, T* residual, float scale, uint8_t* bits, int64_t begin, int64_t len) {
  float m[kChunk], decoded[kChunk];
  uint8_t positive[kChunk];
  load_compensated<kResidual>(grad, residual, begin, len, m);
  for (int64_t i = 0; i < len; ++i) {
    positive[i] = !(m[i] < 0.0f);
    decoded[i] = positive[i] ? scale : -scale;
  }
  for (int64_t i = len; i < ceil_div(len, 8) * 8; ++i) positive[i] = 0;
  for (int64_t byte = 0; byte < ceil_div(len, 8); ++byte) {
    const uint8_t* p = positive + 8 * byte;
    bits[begin / 8 + byte] = static_cast<uint8_t>(p[0] | p[1] << 1 | p[2] << 2 | p[3] << 3 | p[4] << 4 |
                                                  p[5] << 5 | p[6] << 6 | p[7] << 7);
  }
  if constexpr (kResidual) store_residuals(residual, begin, len, m, decoded);
}

template <typename T, bool kResidual>
void encode_typed(const EncodeArgs& a) {
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  const int64_t n = a.header.numel;
  double total;
  if (a.norm_scale) {
    total = parallel_canonical_sum(a.parallel_for, n,
                                   [&](int64_t i) { return compensated_square<kResidual>(grad, residual, i); });
  } else {
    total = parallel_canonical_sum(a.parallel_for, n, [&](int64_t i) {
      return static_cast<double>(__builtin_fabsf(compensated<kResidual>(grad, residual, i)));
    });
  }
  const double mean = n > 0 ? total / static_cast<double>(n) : 0.0;
  const float scale = static_cast<float>(a.norm_scale ? std::sqrt(mean) : mean);
  *field<float>(a.payload, kHeaderBytes) = scale;
  uint8_t* bits = a.payload + body_layout(a.header).codes;
  parallel_chunks(a.parallel_for, n, kChunk, [&](int64_t begin, int64_t len) {
    encode_chunk<T, kResidual>(grad, residual, scale, bits, begin, len);
  });
}

template <typename T>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  const int64_t codes = body_layout(h).codes;
  if (!a.vote) {
    sum_scaled_byte_codes<T, 8>(a, h.numel, byte_tables().sign, codes);
    return;
  }
  float magnitude = 0.0f;
  for (int64_t p = 0; p < a.count; ++p)
    magnitude = add_saturating(magnitude, a.alpha * *field<float>(a.payloads + p * a.stride, kHeaderBytes));
  const float tie = 0.0f * magnitude;
  T* out = static_cast<T*>(a.out);
  parallel_chunks(a.parallel_for, h.numel, kDecodeChunk, [&, magnitude, tie](int64_t begin, int64_t len) {
    float votes[kDecodeChunk] = {};
    for (int64_t p = 0; p < a.count; ++p)  // each sign counts +1 or -1: small integers, exact
      add_byte_codes<8, false>(byte_tables().sign, a.payloads + p * a.stride + codes + begin / 8, len, 1.0f, votes);
    for (int64_t i = 0; i < len; ++i)
      out[begin + i] = from_float_saturating<T>(votes[i] > 0 ? magnitude : votes[i] < 0 ? -magnitude : tie);
  });
}

}  // namespace

GRADCOMP_TYPED_ENTRY_POINTS(signsgd)

}  // namespace gradcomp::GC_CODECS_NS
