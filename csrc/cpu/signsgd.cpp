// signsgd with blocks of B = param1 elements: one sign bit per element and one fp32 scale per block,
// the mean |m| of the block (m = gradient + residual): scale = (float)(total / len), total the
// canonical sum (reduce.h, double lanes) of (double)|m| over the block's len elements (B, or what is
// left for the last block) and the division in double; it cannot overflow for finite m (the mean is
// at most max |m| <= FLT_MAX). With norm_scale (the two-phase owner re-encoding a sum of signs),
// scale = (float)sqrt(total / len) of the canonical sum of (double)m * m instead: the root mean
// square, so that the signs carry the norm of m. Body: ceil(n / B) fp32 scales, then ceil(n / 8)
// bytes; element i is bit (i % 8) of byte i / 8, 1 for "+" (m >= 0, or NaN) and 0 for "-" (m < 0).
// Element i decodes to +scale[i / B] or -scale[i / B]. decode_sum adds, per payload in order,
// +-(alpha * scale[i / B]) (fp32 add_saturating, from +0). With vote: element i's magnitude = sum
// over payloads in order of (alpha * scale[i / B]), fp32 add_saturating from +0, and the element is
// +magnitude, -magnitude or, on a tie, 0.0f * magnitude (+0 for a finite magnitude, NaN for a
// non-finite one). A block of n elements or more is one scale for the bucket, signSGD's original form.
#include <cmath>

#include "chunked.h"

namespace gradcomp::GC_CODECS_NS {
namespace {

constexpr int64_t kChunk = 256;        // a multiple of 8: chunks start on whole bytes
constexpr int64_t kFusedBlock = 8192;  // blocks up to this size are summed where they are encoded

// f(first, end, b) for each run [first, end) of one block b inside [begin, begin + len).
template <typename F>
inline void for_block_runs(int64_t begin, int64_t len, int64_t block, F&& f) {
  for (int64_t first = begin; first < begin + len;) {
    const int64_t b = first / block, end = std::min((b + 1) * block, begin + len);
    f(first, end, b);
    first = end;
  }
}

// One chunk of the sign pass. A function of its own, with the scales and pointers as parameters:
// inside a lambda capturing them by reference, each byte stored could alias them (char stores
// alias anything) and the compiler would reload them and give up vectorizing.
template <typename T, bool kResidual>
void encode_chunk(const T* grad, T* residual, const float* scales, int64_t block, uint8_t* bits, int64_t begin,
                  int64_t len) {
  float m[kChunk], decoded[kChunk];
  uint8_t positive[kChunk];
  load_compensated<kResidual>(grad, residual, begin, len, m);
  for (int64_t i = 0; i < len; ++i) positive[i] = !(m[i] < 0.0f);
  for (int64_t i = len; i < ceil_div(len, 8) * 8; ++i) positive[i] = 0;
  for (int64_t byte = 0; byte < ceil_div(len, 8); ++byte) {
    const uint8_t* p = positive + 8 * byte;
    bits[begin / 8 + byte] = static_cast<uint8_t>(p[0] | p[1] << 1 | p[2] << 2 | p[3] << 3 | p[4] << 4 |
                                                  p[5] << 5 | p[6] << 6 | p[7] << 7);
  }
  if constexpr (kResidual) {
    for_block_runs(begin, len, block, [&](int64_t first, int64_t end, int64_t b) {
      const float scale = scales[b];
      for (int64_t i = first - begin; i < end - begin; ++i) decoded[i] = positive[i] ? scale : -scale;
    });
    store_residuals(residual, begin, len, m, decoded);
  }
}

template <typename T, bool kResidual>
void encode_typed(const EncodeArgs& a) {
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  const int64_t n = a.header.numel, block = a.header.param1;
  const BodyLayout layout = body_layout(a.header);
  float* scales = field<float>(a.payload, layout.scales);
  uint8_t* bits = a.payload + layout.codes;
  const auto scale_of = [&](double total, int64_t len) {
    const double mean = total / static_cast<double>(len);
    return static_cast<float>(a.norm_scale ? std::sqrt(mean) : mean);
  };
  // The summand of element i: |m| or, with norm_scale, m * m (both exact in double).
  const auto summand = [&](int64_t i) {
    return a.norm_scale ? compensated_square<kResidual>(grad, residual, i)
                        : static_cast<double>(__builtin_fabsf(compensated<kResidual>(grad, residual, i)));
  };
  const auto block_scale = [&](int64_t b) {
    const int64_t begin = b * block, len = std::min(block, n - begin);
    return scale_of(canonical_sum(len, [&](int64_t i) { return summand(begin + i); }), len);
  };
  if (block <= kFusedBlock) {
    // Slices of whole blocks, a multiple of 8 elements (whole bytes of signs): each block is summed
    // and then signed while it is in cache, and no block straddles two slices.
    const int64_t slice = block * ceil_div(ceil_div(kElementsPerTask, block), 8) * 8;
    for_ranges(a.parallel_for, ceil_div(n, slice), 1, [&](int64_t first, int64_t last) {
      for (int64_t s = first; s < last; ++s) {
        const int64_t lo = s * slice, hi = std::min(n, lo + slice);
        for (int64_t b = lo / block; b * block < hi; ++b) scales[b] = block_scale(b);
        for (int64_t begin = lo; begin < hi; begin += kChunk)
          encode_chunk<T, kResidual>(grad, residual, scales, block, bits, begin, std::min(kChunk, hi - begin));
      }
    });
    return;
  }
  // Large blocks: every scale first (a block's chunks in parallel when it is large enough, else
  // blocks in parallel), then the signs.
  const int64_t blocks = ceil_div(n, block);
  if (block >= kElementsPerTask) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * block, len = std::min(block, n - begin);
      scales[b] = scale_of(parallel_canonical_sum(a.parallel_for, len, [&](int64_t i) { return summand(begin + i); }),
                           len);
    }
  } else {
    for_ranges(a.parallel_for, blocks, ceil_div(kElementsPerTask, block), [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) scales[b] = block_scale(b);
    });
  }
  parallel_chunks(a.parallel_for, n, kChunk, [&](int64_t begin, int64_t len) {
    encode_chunk<T, kResidual>(grad, residual, scales, block, bits, begin, len);
  });
}

// The largest finite |alpha * scale| of a payload: what one payload adds to an element at most.
inline float largest_finite_multiplier(const uint8_t* payload, int64_t blocks, float alpha) {
  const float* scales = field<float>(payload, kHeaderBytes);
  float largest = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const float m = __builtin_fabsf(alpha * scales[b]);
    if (is_finite(m) && m > largest) largest = m;
  }
  return largest;
}

template <typename T>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  const int64_t codes = body_layout(h).codes, block = h.param1, blocks = ceil_div(h.numel, block);
  const auto scale_at = [&](const uint8_t* payload, int64_t b) { return a.alpha * field<float>(payload, kHeaderBytes)[b]; };
  if (!a.vote) {
    const auto largest = [&](const uint8_t* payload) { return largest_finite_multiplier(payload, blocks, a.alpha); };
    sum_payloads_overflow_checked<T>(
        a, h.numel, largest, [&](const uint8_t* payload, int64_t begin, int64_t len, float* acc, auto saturate) {
          constexpr bool kSaturate = decltype(saturate)::value;
          float signs[kDecodeChunk] = {};  // +1 or -1 (exact), then scaled per block run
          add_byte_codes<8, false>(byte_tables().sign, payload + codes + begin / 8, len, 1.0f, signs);
          for_block_runs(begin, len, block, [&](int64_t first, int64_t end, int64_t b) {
            const float scale = scale_at(payload, b);
            for (int64_t i = first - begin; i < end - begin; ++i)
              acc[i] = kSaturate ? add_saturating(acc[i], signs[i] * scale) : acc[i] + signs[i] * scale;
          });
        });
    return;
  }
  T* out = static_cast<T*>(a.out);
  parallel_chunks(a.parallel_for, h.numel, kDecodeChunk, [&](int64_t begin, int64_t len) {
    float votes[kDecodeChunk] = {};
    for (int64_t p = 0; p < a.count; ++p)  // each sign counts +1 or -1: small integers, exact
      add_byte_codes<8, false>(byte_tables().sign, a.payloads + p * a.stride + codes + begin / 8, len, 1.0f, votes);
    for_block_runs(begin, len, block, [&](int64_t first, int64_t end, int64_t b) {
      float magnitude = 0.0f;
      for (int64_t p = 0; p < a.count; ++p) magnitude = add_saturating(magnitude, scale_at(a.payloads + p * a.stride, b));
      const float tie = 0.0f * magnitude;
      for (int64_t i = first; i < end; ++i) {
        const float v = votes[i - begin];
        out[i] = from_float_saturating<T>(v > 0 ? magnitude : v < 0 ? -magnitude : tie);
      }
    });
  });
}

}  // namespace

GRADCOMP_TYPED_ENTRY_POINTS(signsgd)

}  // namespace gradcomp::GC_CODECS_NS
