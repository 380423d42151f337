// qsgd (see csrc/cpu/qsgd.cpp): block norms as canonical sums of squares (two launches, as the CPU
// sums them), then one pass draws the levels, packs the w-bit codes through shared memory (eight
// codes fill exactly w bytes) and updates the residual.
#include "device.cuh"

namespace gradcomp::cuda {
namespace {

struct BlockNorm {
  float* norms;
  __device__ void operator()(int64_t block, double total, int64_t) const {
    norms[block] = saturated_norm(total);
  }
};

template <typename T, bool kResidual>
__global__ void levels_kernel(const T* grad, T* residual, int64_t n, int64_t block, int64_t levels_count, int bits,
                              const float* norms, RandomKey key, uint8_t* stream) {
  __shared__ uint32_t codes[kSuperTile];
  const float levels = static_cast<float>(levels_count);
  const int64_t stream_bytes = ceil_div(n * bits, 8);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kSuperTile; base < n;
       base += static_cast<int64_t>(gridDim.x) * kSuperTile) {
    stochastic_codes(base, n, key, codes, [&](int64_t e, float u) {
      const float norm = norms[e / block];
      const float inverse = norm > 0.0f && is_finite(norm) ? levels / norm : 0.0f;
      const float step = norm / levels;
      const float m = compensated<kResidual>(grad, residual, e);
      float r = fabsf(m) * inverse;
      r = r >= 0.0f ? r : 0.0f;  // NaN -> 0
      r = r > levels ? levels : r;
      const int32_t floor_r = static_cast<int32_t>(r);
      const int32_t level = floor_r + (u < r - static_cast<float>(floor_r) ? 1 : 0);
      const int32_t negative = m < 0.0f ? 1 : 0;
      const float magnitude = mul_saturating(static_cast<float>(level), step);
      if constexpr (kResidual) residual[e] = residual_value<T>(m, negative ? -magnitude : magnitude);
      return static_cast<uint32_t>((level << 1) | negative);
    });
    __syncthreads();
    // Eight codes from a multiple of 8 fill exactly `bits` bytes of the little-endian stream.
    const int t = threadIdx.x;
    if (t < kSuperTile / 8) {
      uint64_t lo = 0, hi = 0;
      for (int j = 0; j < 8; ++j) {
        const uint64_t code = codes[8 * t + j];
        const int at = j * bits;
        if (at < 64) {
          lo |= code << at;
          if (at + bits > 64) hi |= code >> (64 - at);
        } else {
          hi |= code << (at - 64);
        }
      }
      const int64_t first = (base / 8 + t) * bits;
      for (int b = 0; b < bits && first + b < stream_bytes; ++b)
        stream[first + b] = static_cast<uint8_t>(b < 8 ? lo >> (8 * b) : hi >> (8 * (b - 8)));
    }
    __syncthreads();
  }
}

struct DecodeLevels {
  int64_t codes, stream_bytes, block;
  int bits;
  float levels;
  float alpha;
  __device__ float operator()(const uint8_t* payload, int64_t i) const {
    const uint8_t* stream = payload + codes;
    const int64_t at = i * bits, byte = at / 8;
    uint32_t window = stream[byte];
    if (byte + 1 < stream_bytes) window |= static_cast<uint32_t>(stream[byte + 1]) << 8;
    if (byte + 2 < stream_bytes) window |= static_cast<uint32_t>(stream[byte + 2]) << 16;
    const uint32_t code = (window >> (at % 8)) & ((1u << bits) - 1u);
    const float step = alpha * (field<float>(payload, kHeaderBytes)[i / block] / levels);
    const float magnitude = mul_saturating(static_cast<float>(code >> 1), step);
    return (code & 1u) ? -magnitude : magnitude;
  }
};

}  // namespace

size_t qsgd_encode_workspace(const PayloadHeader& h) {
  return sizeof(double) * segment_sum_partials(h.numel, h.param1);
}

void encode_qsgd(const EncodeParams& p, cudaStream_t stream) {
  const PayloadHeader& h = p.header;
  const int64_t n = h.numel;
  if (n == 0) return;
  const BodyLayout layout = body_layout(h);
  float* norms = reinterpret_cast<float*>(p.payload + layout.scales);
  const RandomKey key{h.seed, h.step, h.bucket, p.rank};
  visit_encode(p, [&](auto* t, auto has_residual) {
    using T = Elem<decltype(t)>;
    constexpr bool kResidual = decltype(has_residual)::value;
    const T* grad = static_cast<const T*>(p.grad);
    T* residual = static_cast<T*>(p.residual);
    segment_sums(n, h.param1, SquareCompensated<T, kResidual>{grad, residual}, BlockNorm{norms},
                 static_cast<double*>(p.workspace), stream);
    levels_kernel<T, kResidual><<<blocks_for(n, kSuperTile), kThreads, 0, stream>>>(
        grad, residual, n, h.param1, h.param0, qsgd_code_bits(h.param0), norms, key, p.payload + layout.codes);
  });
}

void decode_qsgd(const DecodeParams& d, cudaStream_t stream) {
  const PayloadHeader& h = d.expected;
  const BodyLayout layout = body_layout(h);
  const DecodeLevels decoded{layout.codes, layout.end - layout.codes, h.param1, qsgd_code_bits(h.param0),
                             static_cast<float>(h.param0), d.alpha};
  visit_dtype(static_cast<DType>(h.dtype),
              [&](auto* t) { launch_sum_decoded<Elem<decltype(t)>>(d, decoded, stream); });
}

}  // namespace gradcomp::cuda
