// Helpers shared by the CPU codec files: element access, error-feedback chunks and the chunked
// decode-and-sum loop. Loops are written branch-free over small chunks so that the compiler
// vectorizes them in each instruction-set variant (see CMakeLists.txt).
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/reduce.h"

#include "kernels.h"

// The per-codec files are compiled once per instruction-set variant, each into its own namespace.
#ifndef GC_CODECS_NS
#define GC_CODECS_NS codecs_base
#endif

namespace gradcomp {

// Work items per parallel task: small buckets stay on the calling thread.
constexpr int64_t kElementsPerTask = 1 << 16;

// body over [0, count) items, in ranges of at least grain items (see ParallelFor).
inline void for_ranges(ParallelFor parallel_for, int64_t count, int64_t grain, const RangeBody& body) {
  if (count <= 0) return;
  if (parallel_for && count > grain) parallel_for(count, grain, body);
  else body(0, count);
}

// for_ranges over the chunks of chunk elements that cover n elements.
inline void for_chunks(ParallelFor parallel_for, int64_t n, int64_t chunk, const RangeBody& chunk_range) {
  for_ranges(parallel_for, ceil_div(n, chunk), std::max<int64_t>(1, kElementsPerTask / chunk), chunk_range);
}

// f(begin, len) for every chunk of `chunk` elements covering [0, n), on parallel ranges of chunks.
template <typename F>
void parallel_chunks(ParallelFor parallel_for, int64_t n, int64_t chunk, F&& f) {
  for_chunks(parallel_for, n, chunk, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) f(c * chunk, std::min(chunk, n - c * chunk));
  });
}

// canonical_sum (reduce.h) with its chunks summed in parallel, then added in chunk order.
template <typename Value>
double parallel_canonical_sum(ParallelFor parallel_for, int64_t len, Value&& value) {
  std::vector<double> partial(ceil_div(len, kReduceChunk));
  parallel_chunks(parallel_for, len, kReduceChunk,
                  [&](int64_t begin, int64_t n) { partial[begin / kReduceChunk] = chunk_lane_sum(begin, begin + n, value); });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

// The gradient plus the old residual, in fp32: what a codec compresses under error feedback. A
// finite sum beyond fp32 saturates to +-FLT_MAX (add_saturating, hd.h).
template <bool kResidual, typename T>
inline float compensated(const T* grad, const T* residual, int64_t i) {
  if constexpr (kResidual) return add_saturating(to_float(grad[i]), to_float(residual[i]));
  return to_float(grad[i]);
}

// m * m in double, m the compensated value: exact, a float's square fits a double's mantissa (the
// sums of squares of qsgd's block norms and signsgd's norm_scale).
template <bool kResidual, typename T>
inline double compensated_square(const T* grad, const T* residual, int64_t i) {
  const double m = compensated<kResidual>(grad, residual, i);
  return m * m;
}

template <bool kResidual, typename T>
inline void load_compensated(const T* grad, const T* residual, int64_t begin, int64_t len, float* m) {
  for (int64_t i = 0; i < len; ++i) m[i] = compensated<kResidual>(grad, residual, begin + i);
}

// wire[i] = from_float_saturating<W>(m[i]) over one chunk, as two loops: the plain rounding, then a
// branch-free pass that turns an Inf rounded from a finite m into the largest finite value (the
// fused form has control flow that keeps the compiler from vectorizing either part).
template <typename W>
inline void store_saturating(W* wire, const float* m, int64_t len) {
  for (int64_t i = 0; i < len; ++i) wire[i] = from_float<W>(m[i]);
  if constexpr (!std::is_same_v<W, float>) {
    constexpr uint16_t kInf = std::is_same_v<W, f16> ? 0x7C00u : 0x7F80u;
    constexpr uint16_t kMax = kInf - 1;  // 0x7BFF (fp16 65504), 0x7F7F (bf16)
    for (int64_t i = 0; i < len; ++i) {
      const uint16_t bits = wire[i].bits;
      const bool overflow = (bits & 0x7FFFu) == kInf && is_finite(m[i]);
      wire[i].bits = overflow ? static_cast<uint16_t>((bits & 0x8000u) | kMax) : bits;
    }
  }
}

// residual = m - decoded over one chunk, saturating: the fp32 difference (sub_saturating) and its
// rounding to T (from_float_saturating).
template <typename T>
inline void store_residuals(T* residual, int64_t begin, int64_t len, const float* m, const float* decoded) {
  for (int64_t i = 0; i < len; ++i) residual[begin + i] = from_float_saturating<T>(sub_saturating(m[i], decoded[i]));
}

// M = grad + residual rounded to T (topk, randomk), saturating both the sum and the rounding.
template <typename T>
inline T compensated_value(const T* grad, const T* residual, int64_t i) {
  return from_float_saturating<T>(add_saturating(to_float(grad[i]), to_float(residual[i])));
}

// Calls f(grad_type, std::bool_constant<has residual>) for an encode call.
template <typename F>
void visit_encode(const EncodeArgs& a, F&& f) {
  visit_dtype(static_cast<DType>(a.header.dtype), [&](auto* t) {
    if (a.residual) f(t, std::true_type{});
    else f(t, std::false_type{});
  });
}

// Defines encode_<codec> and decode_<codec> for a file whose templates are
// encode_typed<T, kResidual>(args) and decode_typed<T>(args, header).
#define GRADCOMP_TYPED_ENTRY_POINTS(codec)                                                        \
  void encode_##codec(const EncodeArgs& a) {                                                      \
    visit_encode(a, [&](auto* t, auto has_residual) {                                             \
      encode_typed<std::remove_pointer_t<decltype(t)>, decltype(has_residual)::value>(a);         \
    });                                                                                           \
  }                                                                                               \
  void decode_##codec(const DecodeArgs& a, const PayloadHeader& h) {                              \
    visit_dtype(static_cast<DType>(h.dtype),                                                      \
                [&](auto* t) { decode_typed<std::remove_pointer_t<decltype(t)>>(a, h); });         \
  }

constexpr int64_t kDecodeChunk = 2048;

// out[i] = sum over payloads p (in order) of alpha * decoded_p[i], accumulated in fp32 from +0 with
// add_saturating and stored with from_float_saturating<T>. alpha is applied to each payload's
// contribution before it is added (folded into the payload's scale or step where the codec has
// one), so ranks whose mean is representable do not overflow the sum; where rounding alone would
// still carry a sum of finite contributions past FLT_MAX, it saturates. add(payload, begin, len,
// acc) adds payload's alpha-weighted decoded values [begin, begin + len) into acc that way.
// The chunk start is always a multiple of kDecodeChunk (a multiple of 8, so bit codes align).
template <typename T, typename AddPayload>
void sum_payloads(const DecodeArgs& args, int64_t numel, AddPayload&& add) {
  T* out = static_cast<T*>(args.out);
  for_chunks(args.parallel_for, numel, kDecodeChunk, [&](int64_t first, int64_t last) {
    float acc[kDecodeChunk];
    for (int64_t begin = first * kDecodeChunk; begin < std::min(numel, last * kDecodeChunk); begin += kDecodeChunk) {
      const int64_t len = std::min(kDecodeChunk, numel - begin);
      std::fill(acc, acc + len, 0.0f);
      for (int64_t p = 0; p < args.count; ++p) add(args.payloads + p * args.stride, begin, len, acc);
      for (int64_t i = 0; i < len; ++i) out[begin + i] = from_float_saturating<T>(acc[i]);
    }
  });
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

// acc[i] = add_saturating(acc[i], table[code i] * scale) for len codes packed kPerByte to a byte,
// from a byte boundary.
template <int kPerByte, bool kSaturate = true>
inline void add_byte_codes(const float (*table)[kPerByte], const uint8_t* bytes, int64_t len, float scale,
                           float* acc) {
  const auto add = [](float a, float b) { return kSaturate ? add_saturating(a, b) : a + b; };
  int64_t i = 0;
  for (; i + kPerByte <= len; i += kPerByte)
    for (int j = 0; j < kPerByte; ++j) acc[i + j] = add(acc[i + j], table[bytes[i / kPerByte]][j] * scale);
  for (; i < len; ++i) acc[i] = add(acc[i], table[bytes[i / kPerByte]][i % kPerByte] * scale);
}

// Whether summing one multiplier per payload (each element's largest contribution from it, e.g.
// alpha * scale) could overflow fp32. Only then can saturating adds differ from plain ones, so the
// decoders take the plain, faster adds otherwise, with the same bits. Non-finite multipliers are
// left out: after one, both kinds of add give the plain IEEE result. The bound leaves room for
// the rounding of any realistic count of additions.
template <typename Multiplier>
bool sum_may_overflow(const DecodeArgs& a, Multiplier&& multiplier) {
  double bound = 0.0;
  for (int64_t p = 0; p < a.count; ++p) {
    const float m = multiplier(a.payloads + p * a.stride);
    if (is_finite(m)) bound += static_cast<double>(m < 0.0f ? -m : m);
  }
  return bound > 0x1.0p+126;
}

// sum_payloads with add(payload, begin, len, acc, saturate), saturate std::true_type only where
// sum_may_overflow(a, multiplier) says plain adds could give other bits than saturating ones, else
// std::false_type (the plain, faster adds).
template <typename T, typename Multiplier, typename AddPayload>
void sum_payloads_overflow_checked(const DecodeArgs& a, int64_t numel, Multiplier&& multiplier, AddPayload&& add) {
  const auto sum = [&](auto saturate) {
    sum_payloads<T>(a, numel, [&](const uint8_t* payload, int64_t begin, int64_t len, float* acc) {
      add(payload, begin, len, acc, saturate);
    });
  };
  if (sum_may_overflow(a, multiplier)) sum(std::true_type{});
  else sum(std::false_type{});
}

template <typename T>
inline const T* field(const uint8_t* payload, int64_t offset) {
  return reinterpret_cast<const T*>(payload + offset);
}

template <typename T>
inline T* field(uint8_t* payload, int64_t offset) {
  return reinterpret_cast<T*>(payload + offset);
}

// The decode of terngrad (one scale per payload): out = the sum over payloads of alpha * scale *
// table[code], the codes packed kPerByte to a byte from byte codes_offset, scale the fp32 right
// after the header. Plain adds where sum_may_overflow says saturating ones give the same bits.
template <typename T, int kPerByte>
void sum_scaled_byte_codes(const DecodeArgs& a, int64_t numel, const float (*table)[kPerByte], int64_t codes_offset) {
  const auto multiplier = [&](const uint8_t* payload) { return a.alpha * *field<float>(payload, kHeaderBytes); };
  sum_payloads_overflow_checked<T>(
      a, numel, multiplier, [&](const uint8_t* payload, int64_t begin, int64_t len, float* acc, auto saturate) {
        add_byte_codes<kPerByte, decltype(saturate)::value>(table, payload + codes_offset + begin / kPerByte, len,
                                                            multiplier(payload), acc);
      });
}

}  // namespace gradcomp
