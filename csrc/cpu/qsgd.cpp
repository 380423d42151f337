// qsgd with s levels and blocks of B elements. Per block: norm = saturated_norm(total) (reduce.h):
// total the canonical sum (double lanes) of the exact double squares (double)m * (double)m, norm
// the double square root rounded to fp32, FLT_MAX if it lies beyond fp32. Element m becomes
// sign(m) * mul_saturating(level, step) with step = norm / s, where r = |m| * inverse with
// inverse = s / norm (0 when norm is 0 or not finite), r = 0 if NaN, r is clamped to s,
// level = floor(r) + (u < r - floor(r)), so the decoded value is unbiased;
// u = unit_uniform(rounding_word(key, i)) for element i. Body: ceil(n / B)
// fp32 norms, then a little-endian bit stream of n codes of w = 1 + ceil(log2(s + 1)) bits:
// code = (level << 1) | (m < 0), element i at bits [i*w, i*w + w).
// A block holding NaN or Inf has a non-finite norm and decodes as NaN. For finite m nothing
// overflows: the squares and their sum are in double; |m| * inverse is at most about s (and
// clamped); a subnormal norm whose inverse overflows gives r = Inf (clamped to s) or 0 * Inf =
// NaN (taken as 0); level * step can round above FLT_MAX when norm is near FLT_MAX, and
// mul_saturating (hd.h) makes that FLT_MAX.
// decode_sum adds, per payload in order, +-mul_saturating(level, alpha * (norm / s)) (fp32
// add_saturating, from +0).
#include <cmath>
#include <cstring>

#include "../common/reduce.h"
#include "chunked.h"
#include "simd.h"

namespace gradcomp::GC_CODECS_NS {
namespace {

constexpr int64_t kPair = 2 * kTile;  // elements per batch of random words
constexpr int64_t kFusedBlock = 8192;  // blocks up to this size are normed where they are quantized

// Groups of 8 consecutive codes (from an element index that is a multiple of 8) start on a byte
// and fill exactly kBits bytes: they are packed and unpacked as one little-endian integer, with
// shifts fixed at compile time for each code width.
template <int kBits>
using CodeGroup = std::conditional_t<(kBits <= 8), uint64_t, unsigned __int128>;

template <int kBits>
void pack_codes(const uint32_t* code, int64_t count, uint8_t* out) {
  for (int64_t g = 0; g < count; g += 8) {
    const int64_t len = std::min<int64_t>(8, count - g);
    CodeGroup<kBits> packed = 0;
    for (int64_t j = 0; j < len; ++j) packed |= static_cast<CodeGroup<kBits>>(code[g + j]) << (j * kBits);
    if (len == 8) std::memcpy(out + g / 8 * kBits, &packed, kBits);  // little-endian host
    else std::memcpy(out + g / 8 * kBits, &packed, ceil_div(len * kBits, 8));
  }
}

// Unpacks count codes starting at element first (a multiple of 8).
template <int kBits>
void unpack_codes(const uint8_t* stream, int64_t first, int64_t count, uint32_t* code) {
  for (int64_t g = 0; g < count; g += 8) {
    const int64_t len = std::min<int64_t>(8, count - g);
    CodeGroup<kBits> packed = 0;
    if (len == 8) std::memcpy(&packed, stream + (first + g) / 8 * kBits, kBits);
    else std::memcpy(&packed, stream + (first + g) / 8 * kBits, ceil_div(len * kBits, 8));
    for (int64_t j = 0; j < len; ++j)
      code[g + j] = static_cast<uint32_t>(packed >> (j * kBits)) & ((1u << kBits) - 1);
  }
}

// Calls f(std::integral_constant<int, bits>) for a code width in [2, 16].
template <typename F>
void visit_code_bits(int bits, F&& f) {
  switch (bits) {
#define GRADCOMP_BITS_CASE(b) \
  case b: f(std::integral_constant<int, b>{}); break;
    GRADCOMP_BITS_CASE(2) GRADCOMP_BITS_CASE(3) GRADCOMP_BITS_CASE(4) GRADCOMP_BITS_CASE(5)
    GRADCOMP_BITS_CASE(6) GRADCOMP_BITS_CASE(7) GRADCOMP_BITS_CASE(8) GRADCOMP_BITS_CASE(9)
    GRADCOMP_BITS_CASE(10) GRADCOMP_BITS_CASE(11) GRADCOMP_BITS_CASE(12) GRADCOMP_BITS_CASE(13)
    GRADCOMP_BITS_CASE(14) GRADCOMP_BITS_CASE(15) GRADCOMP_BITS_CASE(16)
#undef GRADCOMP_BITS_CASE
  }
}

// The uniforms of one 128-element pair, regenerated only when the pair changes.
struct PairUniforms {
  explicit PairUniforms(const RandomKey& k) : key(k) {}
  RandomKey key;
  int64_t pair = -1;
  float u[kPair];
  const float* at(int64_t element) {
    if (element / kPair != pair) {
      pair = element / kPair;
      tile_uniforms_x2(key, static_cast<uint64_t>(pair), u);
    }
    return u + element % kPair;
  }
};

// Quantizes elements [piece, piece + len), all in one block and one pair of random tiles; code
// points at the piece's place in its pair. Parameters, not captures: see signsgd.cpp.
template <typename T, bool kResidual>
void quantize_piece(const T* grad, T* residual, const float* __restrict u, float inverse, float step, float levels,
                    uint32_t* __restrict code, int64_t piece, int64_t len) {
  float m[kPair], decoded[kPair];
  load_compensated<kResidual>(grad, residual, piece, len, m);
  for (int64_t i = 0; i < len; ++i) {
    float r = __builtin_fabsf(m[i]) * inverse;
    r = r >= 0.0f ? r : 0.0f;  // NaN -> 0
    r = r > levels ? levels : r;
    const int32_t floor_r = static_cast<int32_t>(r);  // truncation is floor: 0 <= r <= s
    const int32_t level = floor_r + (u[i] < r - static_cast<float>(floor_r) ? 1 : 0);
    const int32_t negative = m[i] < 0.0f ? 1 : 0;
    code[i] = static_cast<uint32_t>((level << 1) | negative);
    const float magnitude = mul_saturating(static_cast<float>(level), step);
    decoded[i] = negative ? -magnitude : magnitude;
  }
  if constexpr (kResidual) store_residuals(residual, piece, len, m, decoded);
}

template <typename T, bool kResidual>
void encode_typed(const EncodeArgs& a) {
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  const PayloadHeader& h = a.header;
  const int64_t n = h.numel, block = h.param1;
  const float levels = static_cast<float>(h.param0);
  const int bits = qsgd_code_bits(h.param0);
  const BodyLayout layout = body_layout(h);
  float* norms = field<float>(a.payload, layout.scales);
  uint8_t* stream = a.payload + layout.codes;
  const RandomKey key{h.seed, h.step, h.bucket, a.rank};
  const auto block_norm = [&](int64_t b) {
    const int64_t begin = b * block, len = std::min(block, n - begin);
    return saturated_norm(
        canonical_sum(len, [&](int64_t i) { return compensated_square<kResidual>(grad, residual, begin + i); }));
  };
  // The work goes in fixed slices of whole pairs (each pair's codes are packed by its slice). Small
  // blocks are normed where they are quantized, while in cache, except those that straddle two
  // slices: another slice may already be rewriting its half of the residual, so those are normed
  // first. Large blocks are all normed first, in parallel.
  constexpr int64_t kSlice = kElementsPerTask;  // a multiple of kPair
  const bool fused_norms = block <= kFusedBlock;
  const auto straddles = [&](int64_t b) {
    return b * block / kSlice != (std::min(b * block + block, n) - 1) / kSlice;
  };
  if (!fused_norms) {
    for_ranges(a.parallel_for, ceil_div(n, block), 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) norms[b] = block_norm(b);
    });
  } else {
    for (int64_t s = 1; s * kSlice < n; ++s)
      if (straddles(s * kSlice / block)) norms[s * kSlice / block] = block_norm(s * kSlice / block);
  }
  for_ranges(a.parallel_for, ceil_div(n, kSlice), 1, [&](int64_t first_slice, int64_t last_slice) {
    const int64_t lo = first_slice * kSlice, hi = std::min(n, last_slice * kSlice);
    PairUniforms random{key};
    uint32_t code[kPair];  // the codes of the current pair, by position in the pair
    for (int64_t b = lo / block; b * block < hi; ++b) {
      const int64_t begin = b * block, end = std::min(begin + block, n);
      const float norm = fused_norms && !straddles(b) ? (norms[b] = block_norm(b)) : norms[b];
      const float inverse = norm > 0.0f && is_finite(norm) ? levels / norm : 0.0f;
      const float step = norm / levels;
      // Pieces of the block, inside this range, that stay inside one pair of random tiles.
      for (int64_t piece = std::max(begin, lo); piece < std::min(end, hi);) {
        const int64_t len = std::min(std::min(end, hi), (piece / kPair + 1) * kPair) - piece;
        quantize_piece<T, kResidual>(grad, residual, random.at(piece), inverse, step, levels, code + piece % kPair,
                                     piece, len);
        piece += len;
        if (piece % kPair == 0 || piece == n) {  // the pair is complete: pack its codes
          const int64_t pair_begin = (piece - 1) / kPair * kPair;
          visit_code_bits(bits, [&](auto width) {
            pack_codes<decltype(width)::value>(code, piece - pair_begin, stream + pair_begin / 8 * bits);
          });
        }
      }
    }
  });
}

template <typename T>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  const BodyLayout layout = body_layout(h);
  const int64_t block = h.param1;
  const float levels = static_cast<float>(h.param0);
  const int bits = qsgd_code_bits(h.param0);
  sum_payloads<T>(a, h.numel, [&](const uint8_t* payload, int64_t begin, int64_t len, float* acc) {
    const float* norms = field<float>(payload, layout.scales);
    uint32_t code[kDecodeChunk];
    visit_code_bits(bits, [&](auto width) {
      unpack_codes<decltype(width)::value>(payload + layout.codes, begin, len, code);
    });
    for (int64_t segment = begin; segment < begin + len;) {  // runs of one block
      const int64_t b = segment / block;
      const int64_t end = std::min((b + 1) * block, begin + len);
      const float step = a.alpha * (norms[b] / levels);
      for (int64_t e = segment; e < end; ++e) {
        const float magnitude = mul_saturating(static_cast<float>(code[e - begin] >> 1), step);
        acc[e - begin] = add_saturating(acc[e - begin], (code[e - begin] & 1u) ? -magnitude : magnitude);
      }
      segment = end;
    }
  });
}

}  // namespace

GRADCOMP_TYPED_ENTRY_POINTS(qsgd)

}  // namespace gradcomp::GC_CODECS_NS
