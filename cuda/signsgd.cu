// signsgd (see csrc/cpu/signsgd.cpp): each block's scale is the canonical sum of |m| over the block
// divided by its length (with norm_scale: of m * m, divided by the length, then the square root), in
// two launches as the CPU sums it; then one pass writes the signs: each warp packs its 32 elements
// with a ballot into one 32-bit word of the bit field, and updates the residual.
#include "device.cuh"

namespace gradcomp::cuda {
namespace {

template <typename T, bool kResidual>
struct AbsCompensated {
  const T* grad;
  const T* residual;
  __device__ double operator()(int64_t i) const {
    return static_cast<double>(fabsf(compensated<kResidual>(grad, residual, i)));
  }
};

struct MeanScale {
  float* scales;
  bool root;  // norm_scale: the square root of the mean of squares
  __device__ void operator()(int64_t block, double total, int64_t len) const {
    const double mean = total / static_cast<double>(len);
    scales[block] = static_cast<float>(root ? sqrt(mean) : mean);
  }
};

// The code field starts 4-byte aligned (header 48 + 4 per scale) and each warp's word covers 32
// elements from a multiple of 32, so whole words are written; a last partial word ends inside the
// payload's padding, and its bits past n are zero, as the padding is.
template <typename T, bool kResidual>
__global__ void signs_kernel(const T* grad, T* residual, int64_t n, int64_t block, const float* scales,
                             uint32_t* words) {
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x; base < n;
       base += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = base + threadIdx.x;
    bool positive = false;
    if (i < n) {
      const float m = compensated<kResidual>(grad, residual, i);
      positive = !(m < 0.0f);
      if constexpr (kResidual) {
        const float scale = scales[i / block];
        residual[i] = residual_value<T>(m, positive ? scale : -scale);
      }
    }
    const uint32_t word = __ballot_sync(0xFFFFFFFFu, positive);
    if ((threadIdx.x & 31) == 0 && i < n) words[i / 32] = word;
  }
}

struct DecodeSign {
  int64_t codes;
  int64_t block;
  float alpha;
  __device__ float operator()(const uint8_t* payload, int64_t i) const {
    const float scale = alpha * field<float>(payload, kHeaderBytes)[i / block];
    return ((payload[codes + i / 8] >> (i % 8)) & 1) ? scale : -scale;
  }
};

template <typename T>
__global__ void vote_kernel(const uint8_t* payloads, int64_t count, int64_t stride, int64_t codes, int64_t n,
                            int64_t block, float alpha, T* out) {
  GC_GRID_LOOP(i, n) {
    float magnitude = 0.0f;  // the CPU's order: sum over payloads of alpha * the block's scale, from +0
    for (int64_t p = 0; p < count; ++p)
      magnitude = add_saturating(magnitude, alpha * field<float>(payloads + p * stride, kHeaderBytes)[i / block]);
    const float tie = 0.0f * magnitude;
    float votes = 0.0f;  // each sign counts +1 or -1
    for (int64_t p = 0; p < count; ++p) votes += ((payloads[p * stride + codes + i / 8] >> (i % 8)) & 1) ? 1.0f : -1.0f;
    out[i] = from_float_saturating<T>(votes > 0 ? magnitude : votes < 0 ? -magnitude : tie);
  }
}

}  // namespace

size_t signsgd_encode_workspace(const PayloadHeader& h) {
  return sizeof(double) * segment_sum_partials(h.numel, h.param1);
}

void encode_signsgd(const EncodeParams& p, cudaStream_t stream) {
  const int64_t n = p.header.numel, block = p.header.param1;
  if (n == 0) return;  // no blocks, no scales
  float* scales = reinterpret_cast<float*>(p.payload + kHeaderBytes);
  uint32_t* words = reinterpret_cast<uint32_t*>(p.payload + body_layout(p.header).codes);
  visit_encode(p, [&](auto* t, auto has_residual) {
    using T = Elem<decltype(t)>;
    constexpr bool kResidual = decltype(has_residual)::value;
    const T* grad = static_cast<const T*>(p.grad);
    T* residual = static_cast<T*>(p.residual);
    double* partial = static_cast<double*>(p.workspace);
    if (p.norm_scale)
      segment_sums(n, block, SquareCompensated<T, kResidual>{grad, residual}, MeanScale{scales, true}, partial, stream);
    else
      segment_sums(n, block, AbsCompensated<T, kResidual>{grad, residual}, MeanScale{scales, false}, partial, stream);
    signs_kernel<T, kResidual><<<blocks_for(n), kThreads, 0, stream>>>(grad, residual, n, block, scales, words);
  });
}

void decode_signsgd(const DecodeParams& d, cudaStream_t stream) {
  const int64_t codes = body_layout(d.expected).codes, n = d.expected.numel, block = d.expected.param1;
  visit_dtype(static_cast<DType>(d.expected.dtype), [&](auto* t) {
    using T = Elem<decltype(t)>;
    if (!d.vote) {
      launch_sum_decoded<T>(d, DecodeSign{codes, block, d.alpha}, stream);
    } else if (n > 0) {
      vote_kernel<<<blocks_for(n), kThreads, 0, stream>>>(d.payloads, d.count, body_layout(d.expected).total, codes, n,
                                                          block, d.alpha, static_cast<T*>(d.out));
    }
  });
}

}  // namespace gradcomp::cuda
