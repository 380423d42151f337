// qsgd with s levels and blocks of B elements. Per block: norm = ||m_block||_2 (canonical
// summation order of m * m, fp32 result); element m becomes sign(m) * level * (norm / s) where
// r = |m| * (s / norm), level = floor(r) + (u < r - floor(r)), 0 <= level <= s, so the decoded
// value is unbiased; u = unit_uniform(rounding_word(key, i)) for element i. Body: ceil(n / B)
// fp32 norms, then a little-endian bit stream of n codes of w = 1 + ceil(log2(s + 1)) bits:
// code = (level << 1) | (m < 0), element i at bits [i*w, i*w + w).
// A block holding NaN or Inf has a non-finite norm and decodes as NaN.
#include <cmath>

#include "../common/reduce.h"
#include "chunked.h"
#include "simd.h"

namespace gradcomp::GC_CODECS_NS {
namespace {

constexpr int64_t kPair = 2 * kTile;  // elements per batch of random words

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
  BitWriter writer{a.payload + layout.codes};
  PairUniforms random{RandomKey{h.seed, h.step, h.bucket, a.rank}};
  float m[kPair], decoded[kPair];
  uint32_t code[kPair];
  for (int64_t begin = 0, b = 0; begin < n; begin += block, ++b) {
    const int64_t end = std::min(begin + block, n);
    const double squares = canonical_sum(end - begin, [&](int64_t i) {
      const float v = compensated<kResidual>(grad, residual, begin + i);
      return v * v;
    });
    const float norm = std::sqrt(static_cast<float>(squares));
    norms[b] = norm;
    const float inverse = norm > 0.0f && is_finite(norm) ? levels / norm : 0.0f;
    const float step = norm / levels;
    // Pieces of the block that stay inside one pair of random tiles.
    for (int64_t piece = begin; piece < end;) {
      const int64_t len = std::min(end, (piece / kPair + 1) * kPair) - piece;
      const float* u = random.at(piece);
      load_compensated<kResidual>(grad, residual, piece, len, m);
      for (int64_t i = 0; i < len; ++i) {
        float r = __builtin_fabsf(m[i]) * inverse;
        r = r >= 0.0f ? r : 0.0f;  // NaN -> 0
        r = r > levels ? levels : r;
        const float floor_r = std::floor(r);
        const uint32_t level = static_cast<uint32_t>(floor_r) + (u[i] < r - floor_r ? 1u : 0u);
        const bool negative = m[i] < 0.0f;
        code[i] = (level << 1) | static_cast<uint32_t>(negative);
        const float magnitude = static_cast<float>(level) * step;
        decoded[i] = negative ? -magnitude : magnitude;
      }
      for (int64_t i = 0; i < len; ++i) writer.put(code[i], bits);
      if constexpr (kResidual) store_residuals(residual, piece, len, m, decoded);
      piece += len;
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
  visit_encode(a, [&](auto* t, auto has_residual) {
    encode_typed<std::remove_pointer_t<decltype(t)>, decltype(has_residual)::value>(a);
  });
}

void decode_qsgd(const DecodeArgs& a, const PayloadHeader& h) {
  visit_dtype(static_cast<DType>(h.dtype),
              [&](auto* t) { decode_typed<std::remove_pointer_t<decltype(t)>>(a, h); });
}

}  // namespace gradcomp::GC_CODECS_NS
