// The gradcomp wire format: one contiguous byte payload per rank per bucket.
//
//   offset  size  field
//        0     4  magic "GCMP" (0x504D4347, little-endian)
//        4     1  format version (1)
//        5     1  codec id (Codec)
//        6     1  gradient dtype (DType)
//        7     1  reserved, 0
//        8     8  element count n (int64)
//       16     8  param0: k for topk/randomk, levels s for qsgd, else 0
//       24     8  param1: block for qsgd and signsgd, the index layout for topk, else 0
//       32     8  seed (uint64)
//       40     4  step (uint32)
//       44     4  bucket (uint32)
//       48     .  body (see body_layout), then zero padding to a multiple of 16 bytes
//
// Every rank of a step writes the same header, so a decoder can refuse payloads that disagree.
// The rank is not in the header: it only keys the stochastic rounding of each rank's own body.
#pragma once

#include <type_traits>

#include "half.h"
#include "hd.h"

namespace gradcomp {

constexpr uint32_t kMagic = 0x504D4347u;  // "GCMP"
constexpr uint8_t kFormatVersion = 1;
constexpr int64_t kHeaderBytes = 48;
constexpr int64_t kPayloadAlign = 16;
constexpr int64_t kMaxLevels = 32767;          // qsgd codes stay within 16 bits
constexpr int64_t kMaxIndexedNumel = 0x7FFFFFFF;  // topk / randomk indices are int32
constexpr int64_t kMaxStochasticNumel = int64_t{1} << 34;  // Philox group counter is 32-bit
constexpr int64_t kMaxNumel = int64_t{1} << 40;              // keeps every size computation far from overflow
constexpr int64_t kMaxBlock = kMaxNumel;

// topk's param1: its body's layout.
//   wide (0):    k int32 indices, then k values in the gradient's dtype (8 bytes a value for fp32).
//   compact (1): one uint32 count per span of 65536 elements (how many indices fall in it), then each
//                index's low 16 bits, then the values as 16-bit floats: bf16 for an fp32 gradient
//                (its range, so no finite value becomes Inf), the gradient's own dtype otherwise.
//                4 bytes a value plus 4 per 65536 elements: half of wide's for fp32.
constexpr int64_t kTopkWide = 0, kTopkCompact = 1;
constexpr int64_t kCompactSpan = int64_t{1} << 16;

enum class Codec : uint8_t { None = 0, Fp16 = 1, Bf16 = 2, SignSGD = 3, TernGrad = 4, QSGD = 5, TopK = 6, RandomK = 7 };
constexpr int kNumCodecs = 8;

enum class DType : uint8_t { F32 = 0, F16 = 1, BF16 = 2 };
constexpr int kNumDTypes = 3;

struct PayloadHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t codec;
  uint8_t dtype;
  uint8_t reserved;
  int64_t numel;
  int64_t param0;
  int64_t param1;
  uint64_t seed;
  uint32_t step;
  uint32_t bucket;
};
static_assert(sizeof(PayloadHeader) == kHeaderBytes, "the header is 48 bytes on the wire");

GC_HD int64_t dtype_bytes(DType d) { return d == DType::F32 ? 4 : 2; }

GC_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bits of one qsgd code: a sign bit and the level 0..s in ceil(log2(s + 1)) bits.
GC_HD int qsgd_code_bits(int64_t levels) {
  int bits = 0;
  while ((int64_t{1} << bits) <= levels) ++bits;
  return 1 + bits;
}

// Byte offsets of a codec's fields from the start of the payload.
struct BodyLayout {
  int64_t scales = kHeaderBytes;  // terngrad: one fp32 scale; signsgd: one per block; qsgd: one fp32 norm per
                                  // block; compact topk: its uint32 counts per span
  int64_t codes = kHeaderBytes;   // sign bits, ternary codes, qsgd codes, or topk indices (int32, or uint16 compact)
  int64_t values = kHeaderBytes;  // dense values (none/fp16/bf16/randomk) or topk values
  int64_t end = kHeaderBytes;     // end of the body, before padding
  int64_t total = kHeaderBytes;   // payload bytes including padding
};

GC_HD BodyLayout body_layout(const PayloadHeader& h) {
  BodyLayout l;
  const int64_t n = h.numel;
  const int64_t value_bytes = dtype_bytes(static_cast<DType>(h.dtype));
  const int64_t b = kHeaderBytes;
  switch (static_cast<Codec>(h.codec)) {
    case Codec::None: l.end = b + n * value_bytes; break;
    case Codec::Fp16:
    case Codec::Bf16: l.end = b + n * 2; break;
    case Codec::SignSGD: l.codes = b + 4 * ceil_div(n, h.param1); l.end = l.codes + ceil_div(n, 8); break;
    case Codec::TernGrad: l.codes = b + 4; l.end = l.codes + ceil_div(n, 4); break;
    case Codec::QSGD:
      l.codes = b + 4 * ceil_div(n, h.param1);
      l.end = l.codes + ceil_div(n * qsgd_code_bits(h.param0), 8);
      break;
    case Codec::TopK:
      if (h.param1 == kTopkCompact) {
        l.codes = b + 4 * ceil_div(n, kCompactSpan);
        l.values = l.codes + 2 * h.param0;
        l.end = l.values + 2 * h.param0;
      } else {
        l.values = b + 4 * h.param0;
        l.end = l.values + h.param0 * value_bytes;
      }
      break;
    case Codec::RandomK: l.end = b + h.param0 * value_bytes; break;
  }
  l.total = ceil_div(l.end, kPayloadAlign) * kPayloadAlign;
  return l;
}

// The dtype of topk's values on the wire: compact sends an fp32 gradient's values as bf16.
GC_HD DType topk_value_dtype(const PayloadHeader& h) {
  const auto dtype = static_cast<DType>(h.dtype);
  return h.param1 == kTopkCompact && dtype == DType::F32 ? DType::BF16 : dtype;
}

// What a sent element of M loses on the wire when its value goes as `sent`, which error feedback
// keeps in its residual: m - sent, exact in fp32 for a 16-bit rounding of m; 0 where m is not finite.
GC_HD float sent_loss(float m, float sent) { return is_finite(m) ? m - sent : 0.0f; }

// A topk value of M, of the gradient's type T, as the wire's type V (topk_value_dtype).
template <typename V, typename T>
GC_HD V topk_wire_value(T m) {
  if constexpr (std::is_same_v<T, V>) return m;
  else return from_float_saturating<V>(to_float(m));
}

// What a device-side check of payloads can find; CUDA decodes OR these bits into a status word,
// which the host reads when it chooses (the CPU path raises at once instead).
enum DecodeProblem : uint32_t {
  kHeaderNotExpected = 1,  // not a gradcomp payload, or another codec, dtype, size or parameters
  kHeadersDiffer = 2,      // a payload's random key (seed, step, bucket) differs from payload 0's
  kIndexInvalid = 4,       // a topk index out of range or not strictly ascending, or compact counts that do not
                           // add up to k
};

// Calls f with a null pointer of the C++ element type for a wire dtype (host side; CPU and CUDA
// dispatch alike).
template <typename F>
void visit_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32: f(static_cast<float*>(nullptr)); break;
    case DType::F16: f(static_cast<f16*>(nullptr)); break;
    case DType::BF16: f(static_cast<bf16*>(nullptr)); break;
  }
}

// Calls f with a null pointer of the type topk's values travel as for a gradient of type T
// (topk_value_dtype): bf16 for a compact fp32 gradient, T itself otherwise (host side).
template <typename T, typename F>
void visit_topk_value_type(const PayloadHeader& h, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    if (topk_value_dtype(h) == DType::BF16) return f(static_cast<bf16*>(nullptr));
  }
  f(static_cast<T*>(nullptr));
}

constexpr const char* kCodecNames[kNumCodecs] = {"none", "fp16", "bf16", "signsgd", "terngrad", "qsgd", "topk", "randomk"};
constexpr const char* kValidCodecNames = "none, fp16, bf16, signsgd, terngrad, qsgd, topk, randomk";

// The codec id for a wire name, or -1 when the name is unknown.
inline int codec_from_name(const char* name) {
  for (int i = 0; i < kNumCodecs; ++i)
    if (std::strcmp(kCodecNames[i], name) == 0) return i;
  return -1;
}

// Why a header cannot be decoded, or nullptr when it is well formed. The payload size is
// checked against body_layout by the caller, which knows how many bytes arrived.
inline const char* header_problem(const PayloadHeader& h) {
  if (h.magic != kMagic) return "bad magic: not a gradcomp payload";
  if (h.version != kFormatVersion) return "unsupported wire format version (this build reads version 1)";
  if (h.codec >= kNumCodecs) return "unknown codec id";
  if (h.dtype >= kNumDTypes) return "unknown dtype id (valid: 0 float32, 1 float16, 2 bfloat16)";
  if (h.reserved != 0) return "reserved header byte is not zero";
  if (h.numel < 0) return "negative element count";
  const auto codec = static_cast<Codec>(h.codec);
  const bool has_k = codec == Codec::TopK || codec == Codec::RandomK;
  if (has_k) {
    if (h.numel > kMaxIndexedNumel) return "element count above 2^31 - 1 for an indexed codec";
    if (h.param0 < 0 || h.param0 > h.numel || (h.numel > 0 && h.param0 == 0))
      return "k outside [1, numel]";
  } else if (codec == Codec::QSGD) {
    if (h.param0 < 1 || h.param0 > kMaxLevels) return "qsgd levels outside [1, 32767]";
    if (h.param1 < 1 || h.param1 > kMaxBlock) return "qsgd block outside [1, 2^40]";
  } else if (h.param0 != 0) {
    return "unexpected parameter for this codec";
  }
  if (codec == Codec::SignSGD && (h.param1 < 1 || h.param1 > kMaxBlock)) return "signsgd block outside [1, 2^40]";
  if (codec == Codec::TopK && h.param1 != kTopkWide && h.param1 != kTopkCompact)
    return "topk index layout is neither 0 (wide) nor 1 (compact)";
  if (codec != Codec::QSGD && codec != Codec::SignSGD && codec != Codec::TopK && h.param1 != 0)
    return "unexpected parameter for this codec";
  if ((codec == Codec::TernGrad || codec == Codec::QSGD) && h.numel > kMaxStochasticNumel)
    return "element count above 2^34 for a stochastic codec";
  if (h.numel > kMaxNumel) return "element count above 2^40";
  return nullptr;
}

}  // namespace gradcomp
