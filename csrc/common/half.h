// IEEE fp16 and bfloat16 storage types with round-to-nearest-even conversions, identical on the
// host and the device and to torch's for every non-NaN value. A NaN becomes a canonical quiet NaN:
// 0x7E00 with its sign for fp16, 0x7FC0 for bf16 (torch's own NaN bits vary by conversion path).
// from_float_saturating<T> rounds the same way except that a finite value that would round to
// +-Inf is stored as the type's largest finite value with its sign (fp16 65504 = 0x7BFF, bf16
// 0x7F7F = 3.3895314e38, fp32 FLT_MAX, which no finite fp32 exceeds); NaN and Inf stay NaN and Inf.
// Every residual store, the fp16/bf16 wire values of the dense codecs and every decode_sum output
// store saturate.
#pragma once

#include "hd.h"

namespace gradcomp {

struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

GC_HD float to_float(float x) { return x; }

GC_HD float to_float(f16 h) {
  // Branch-light widening (after Maratos, as in the FP16 library that c10 uses).
  const uint32_t w = static_cast<uint32_t>(h.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude = two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized);
  return bits_float(sign | magnitude);
}

GC_HD float to_float(bf16 b) { return bits_float(static_cast<uint32_t>(b.bits) << 16); }

template <typename T> GC_HD T from_float(float x);

template <> GC_HD float from_float<float>(float x) { return x; }

template <> GC_HD f16 from_float<f16>(float f) {
  // Rounds through float arithmetic: scaling to Inf and back leaves the rounded mantissa.
  float base = (bits_float(float_bits(f) & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return f16{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

template <> GC_HD bf16 from_float<bf16>(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{0x7FC0};
  return bf16{static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

template <typename T> GC_HD T from_float_saturating(float x);

template <> GC_HD float from_float_saturating<float>(float x) { return x; }

template <> GC_HD f16 from_float_saturating<f16>(float x) {
  const uint16_t bits = from_float<f16>(x).bits;
  const bool overflow = (bits & 0x7FFFu) == 0x7C00u && is_finite(x);
  return f16{static_cast<uint16_t>(overflow ? (bits & 0x8000u) | 0x7BFFu : bits)};
}

template <> GC_HD bf16 from_float_saturating<bf16>(float x) {
  const uint16_t bits = from_float<bf16>(x).bits;
  const bool overflow = (bits & 0x7FFFu) == 0x7F80u && is_finite(x);
  return bf16{static_cast<uint16_t>(overflow ? (bits & 0x8000u) | 0x7F7Fu : bits)};
}

}  // namespace gradcomp
