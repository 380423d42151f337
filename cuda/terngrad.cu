// terngrad (see csrc/cpu/terngrad.cpp): the scale is the largest magnitude key (an order-free
// maximum: atomicMax), then one pass draws the ternary codes, packs four to a byte through shared
// memory and updates the residual.
#include "device.cuh"

namespace gradcomp::cuda {
namespace {

template <typename T, bool kResidual>
__global__ void max_key_kernel(const T* grad, const T* residual, int64_t n, uint32_t* max_key) {
  uint32_t key = 0;
  GC_GRID_LOOP(i, n) key = max(key, magnitude_key(compensated<kResidual>(grad, residual, i)));
  for (int width = 16; width >= 1; width /= 2) key = max(key, __shfl_down_sync(0xFFFFFFFFu, key, width));
  if ((threadIdx.x & 31) == 0 && key != 0) atomicMax(max_key, key);
}

template <typename T, bool kResidual>
__global__ void ternary_kernel(const T* grad, T* residual, int64_t n, const uint32_t* max_key, RandomKey key,
                               uint8_t* payload, int64_t codes_offset) {
  __shared__ uint32_t codes[kSuperTile];
  const float scale = bits_float(*max_key);
  const float inverse = scale > 0.0f && is_finite(scale) ? 1.0f / scale : 0.0f;
  if (blockIdx.x == 0 && threadIdx.x == 0) *field<float>(payload, kHeaderBytes) = scale;
  const int64_t code_bytes = ceil_div(n, 4);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kSuperTile; base < n;
       base += static_cast<int64_t>(gridDim.x) * kSuperTile) {
    stochastic_codes(base, n, key, codes, [&](int64_t e, float u) {
      const float m = compensated<kResidual>(grad, residual, e);
      const bool nonzero = u < fabsf(m) * inverse;
      const bool negative = m < 0.0f;
      const float q = nonzero ? (negative ? -1.0f : 1.0f) : 0.0f;
      if constexpr (kResidual) residual[e] = residual_value<T>(m, q * scale);
      return static_cast<uint32_t>(nonzero | ((nonzero & negative) << 1));
    });
    __syncthreads();
    const int t = threadIdx.x;
    if (base / 4 + t < code_bytes)
      payload[codes_offset + base / 4 + t] =
          static_cast<uint8_t>(codes[4 * t] | codes[4 * t + 1] << 2 | codes[4 * t + 2] << 4 | codes[4 * t + 3] << 6);
    __syncthreads();
  }
}

struct DecodeTernary {
  int64_t codes;
  float alpha;
  __device__ float operator()(const uint8_t* payload, int64_t i) const {
    const uint32_t code = (payload[codes + i / 4] >> (2 * (i % 4))) & 3u;
    const float q = (code & 1u) ? ((code & 2u) ? -1.0f : 1.0f) : 0.0f;
    return q * (alpha * *field<float>(payload, kHeaderBytes));
  }
};

}  // namespace

size_t terngrad_encode_workspace(const PayloadHeader&) { return sizeof(uint32_t); }

void encode_terngrad(const EncodeParams& p, cudaStream_t stream) {
  const int64_t n = p.header.numel;
  uint32_t* max_key = static_cast<uint32_t*>(p.workspace);
  cudaMemsetAsync(max_key, 0, sizeof(uint32_t), stream);
  if (n == 0) {
    cudaMemsetAsync(p.payload + kHeaderBytes, 0, sizeof(float), stream);
    return;
  }
  const RandomKey key{p.header.seed, p.header.step, p.header.bucket, p.rank};
  const int64_t codes_offset = body_layout(p.header).codes;
  visit_encode(p, [&](auto* t, auto has_residual) {
    using T = Elem<decltype(t)>;
    constexpr bool kResidual = decltype(has_residual)::value;
    const T* grad = static_cast<const T*>(p.grad);
    T* residual = static_cast<T*>(p.residual);
    max_key_kernel<T, kResidual><<<blocks_for(n), kThreads, 0, stream>>>(grad, residual, n, max_key);
    ternary_kernel<T, kResidual><<<blocks_for(n, kSuperTile), kThreads, 0, stream>>>(grad, residual, n, max_key, key,
                                                                                     p.payload, codes_offset);
  });
}

void decode_terngrad(const DecodeParams& d, cudaStream_t stream) {
  visit_dtype(static_cast<DType>(d.expected.dtype), [&](auto* t) {
    launch_sum_decoded<Elem<decltype(t)>>(d, DecodeTernary{body_layout(d.expected).codes, d.alpha}, stream);
  });
}

}  // namespace gradcomp::cuda
