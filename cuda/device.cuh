// Helpers shared by the CUDA codec files: launch shapes, typed element access, the canonical
// (CPU-identical) sums, and the device-side payload checks. Compiled with --fmad=false: the codec
// arithmetic is specified operation by operation, as on the CPU (-ffp-contract=off).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "codecs.h"
#include "common/half.h"
#include "common/random.h"
#include "common/reduce.h"

namespace gradcomp::cuda {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover the rest

// Blocks for a grid-stride loop over items, per_block items per block and iteration.
inline unsigned blocks_for(int64_t items, int64_t per_block = kThreads) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(kMaxBlocks, ceil_div(items, per_block))));
}

// visit_dtype (common/wire.h), plus whether there is a residual (std::true_type / std::false_type).
template <typename F>
void visit_encode(const EncodeParams& p, F&& f) {
  visit_dtype(static_cast<DType>(p.header.dtype), [&](auto* t) {
    if (p.residual) f(t, std::true_type{});
    else f(t, std::false_type{});
  });
}

template <typename T>
using Elem = std::remove_pointer_t<T>;

// The gradient plus the old residual, in fp32: what a codec compresses under error feedback. A
// finite sum beyond fp32 saturates to +-FLT_MAX (add_saturating, common/hd.h), as on the CPU.
template <bool kResidual, typename T>
__device__ __forceinline__ float compensated(const T* grad, const T* residual, int64_t i) {
  if constexpr (kResidual) return add_saturating(to_float(grad[i]), to_float(residual[i]));
  return to_float(grad[i]);
}

// m * m in double, exact (qsgd's block norms, signsgd's norm_scale): a segment_sums value.
template <typename T, bool kResidual>
struct SquareCompensated {
  const T* grad;
  const T* residual;
  __device__ double operator()(int64_t i) const {
    const double m = compensated<kResidual>(grad, residual, i);
    return m * m;
  }
};

// M = grad + residual rounded to T (topk, randomk), saturating both the sum and the rounding.
template <typename T>
__device__ __forceinline__ T compensated_value(const T* grad, const T* residual, int64_t i) {
  return from_float_saturating<T>(add_saturating(to_float(grad[i]), to_float(residual[i])));
}

// residual = m - decoded, saturating (the CPU's store_residuals).
template <typename T>
__device__ __forceinline__ T residual_value(float m, float decoded) {
  return from_float_saturating<T>(sub_saturating(m, decoded));
}

template <typename T>
__device__ __forceinline__ const T* field(const uint8_t* payload, int64_t offset) {
  return reinterpret_cast<const T*>(payload + offset);
}

template <typename T>
__device__ __forceinline__ T* field(uint8_t* payload, int64_t offset) {
  return reinterpret_cast<T*>(payload + offset);
}

// chunk_lane_sum (common/reduce.h) computed by one warp: lane j takes the elements j, j + 32, ...
// of the chunk in order, in a double, then the halving tree of shuffles. The result is in lane 0.
template <typename Value>
__device__ __forceinline__ double warp_chunk_lane_sum(int64_t begin, int64_t end, const Value& value) {
  const int lane = threadIdx.x & 31;
  double acc = 0.0;
  for (int64_t i = begin + lane; i < end; i += kLanes) acc += static_cast<double>(value(i));
  for (int width = kLanes / 2; width >= 1; width /= 2) acc = acc + __shfl_down_sync(0xFFFFFFFFu, acc, width);
  return acc;
}

// canonical_sum over segments of segment_len elements of [0, n) (the last may be shorter), in two
// launches: one warp per chunk writes its lane sum (a double), then one thread per segment adds its
// chunks in order in double precision and hands the total to finish(segment, total, segment length).
template <typename Value>
__global__ void segment_chunk_sums(int64_t n, int64_t segment_len, int64_t chunks_per_segment, Value value,
                                   double* partial) {
  const int64_t warps = ceil_div(n, segment_len) * chunks_per_segment;
  const int64_t warps_per_grid = static_cast<int64_t>(gridDim.x) * (blockDim.x / kLanes);
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes; w < warps;
       w += warps_per_grid) {
    const int64_t segment = w / chunks_per_segment, chunk = w % chunks_per_segment;
    const int64_t segment_end = min(n, (segment + 1) * segment_len);
    const int64_t begin = segment * segment_len + chunk * kReduceChunk;
    const int64_t end = min(segment_end, begin + kReduceChunk);
    const double sum = begin < end ? warp_chunk_lane_sum(begin, end, value) : 0.0;
    if ((threadIdx.x & 31) == 0) partial[w] = sum;
  }
}

template <typename Finish>
__global__ void segment_totals(int64_t n, int64_t segment_len, int64_t chunks_per_segment, const double* partial,
                               Finish finish) {
  const int64_t segments = ceil_div(n, segment_len);
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < segments;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t len = min(n, (s + 1) * segment_len) - s * segment_len;
    double total = 0.0;
    for (int64_t c = 0; c * kReduceChunk < len; ++c) total += partial[s * chunks_per_segment + c];
    finish(s, total, len);
  }
}

inline int64_t chunks_per_segment(int64_t n, int64_t segment_len) {
  return std::max<int64_t>(1, ceil_div(std::min(n, segment_len), kReduceChunk));
}

// Workspace doubles segment_sums needs.
inline int64_t segment_sum_partials(int64_t n, int64_t segment_len) {
  return n == 0 ? 0 : ceil_div(n, segment_len) * chunks_per_segment(n, segment_len);
}

template <typename Value, typename Finish>
void segment_sums(int64_t n, int64_t segment_len, const Value& value, const Finish& finish, double* partial,
                  cudaStream_t stream) {
  if (n == 0) return;
  const int64_t per_segment = chunks_per_segment(n, segment_len);
  const int64_t warps = ceil_div(n, segment_len) * per_segment;
  segment_chunk_sums<<<blocks_for(warps * kLanes), kThreads, 0, stream>>>(n, segment_len, per_segment, value, partial);
  segment_totals<<<blocks_for(ceil_div(n, segment_len)), kThreads, 0, stream>>>(n, segment_len, per_segment, partial,
                                                                                finish);
}

// Grid-stride loop over [0, count).
#define GC_GRID_LOOP(i, count)                                                            \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (count); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// out[i] = from_float_saturating<T>(sum over payloads p, in order, of decoded(payload p, i)), fp32
// add_saturating accumulation from 0: the CPU's sum_payloads, one thread per element. decoded gives the payload's
// value already multiplied by alpha (folded into its scale or step, as the CPU's add functions do).
template <typename T, typename Decoded>
__global__ void sum_decoded(const uint8_t* payloads, int64_t count, int64_t stride, int64_t n, T* out,
                            Decoded decoded) {
  GC_GRID_LOOP(i, n) {
    float acc = 0.0f;
    for (int64_t p = 0; p < count; ++p) acc = add_saturating(acc, decoded(payloads + p * stride, i));
    out[i] = from_float_saturating<T>(acc);
  }
}

template <typename T, typename Decoded>
void launch_sum_decoded(const DecodeParams& d, const Decoded& decoded, cudaStream_t stream) {
  const int64_t n = d.expected.numel;
  if (n == 0) return;
  sum_decoded<<<blocks_for(n), kThreads, 0, stream>>>(d.payloads, d.count, body_layout(d.expected).total, n,
                                                      static_cast<T*>(d.out), decoded);
}

// The stochastic codecs (terngrad, qsgd) walk the elements in super-tiles of kSuperTile = 16 random
// tiles of 64 (common/random.h): thread t owns the Philox group of lane t % 16 in tile t / 16, so one
// Philox evaluation serves its four elements (tile * 64 + 16 w + lane, w = 0..3). code(e, u) gives
// each element's code from its uniform u; the codes meet in shared memory, by position in the
// super-tile (0 past n), for packing.
constexpr int kSuperTile = 4 * kThreads;

template <typename Code>
__device__ __forceinline__ void stochastic_codes(int64_t base, int64_t n, const RandomKey& key, uint32_t* codes,
                                                 const Code& code) {
  const int t = threadIdx.x;
  const Philox4 words = rounding_block(key, static_cast<uint64_t>(base / 64 + t / 16) * 16 + t % 16);
  for (int w = 0; w < 4; ++w) {
    const int local = (t / 16) * 64 + w * 16 + t % 16;
    codes[local] = base + local < n ? code(base + local, unit_uniform(words.v[w])) : 0u;
  }
}

template <typename T>
__global__ void fill(T* out, int64_t n, T value) {
  GC_GRID_LOOP(i, n) out[i] = value;
}

// Per-codec entry points (one .cu file each), dispatched by codec.cu.
void encode_dense(const EncodeParams&, cudaStream_t);
void decode_dense(const DecodeParams&, cudaStream_t);
void encode_signsgd(const EncodeParams&, cudaStream_t);
void decode_signsgd(const DecodeParams&, cudaStream_t);
void encode_terngrad(const EncodeParams&, cudaStream_t);
void decode_terngrad(const DecodeParams&, cudaStream_t);
void encode_qsgd(const EncodeParams&, cudaStream_t);
void decode_qsgd(const DecodeParams&, cudaStream_t);
cudaError_t encode_topk(const EncodeParams&, cudaStream_t);
void decode_topk(const DecodeParams&, cudaStream_t);
// The device-side check of topk payloads' indices (and, compact, their expansion into the decode
// workspace that decode_topk then reads): kIndexInvalid into problems.
void check_topk(const DecodeParams&, uint32_t* problems, cudaStream_t);
void encode_randomk(const EncodeParams&, cudaStream_t);
void decode_randomk(const DecodeParams&, cudaStream_t);

size_t signsgd_encode_workspace(const PayloadHeader&);
size_t terngrad_encode_workspace(const PayloadHeader&);
size_t qsgd_encode_workspace(const PayloadHeader&);
size_t topk_encode_workspace(const PayloadHeader&);
size_t topk_decode_workspace(const PayloadHeader&, int64_t count);

}  // namespace gradcomp::cuda
