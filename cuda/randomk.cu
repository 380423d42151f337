// randomk (see csrc/cpu/randomk.cpp): every rank takes the values at pi(0), ..., pi(k - 1), pi the
// shared keyed permutation (common/random.h); one thread per chosen value.
#include "device.cuh"

namespace gradcomp::cuda {
namespace {

template <typename T>
__global__ void add_residual_kernel(const T* grad, T* residual, int64_t n) {
  GC_GRID_LOOP(i, n) residual[i] = compensated_value(grad, residual, i);
}

// pi is a bijection: each j owns its element, so the residual is zeroed without races.
template <typename T>
__global__ void take_kernel(const T* m, T* residual, int64_t k, IndexPermutation pi, T* values) {
  GC_GRID_LOOP(j, k) {
    const uint32_t i = pi(static_cast<uint32_t>(j));
    values[j] = m[i];
    if (residual) residual[i] = from_float<T>(0.0f);
  }
}

// The permutation's key comes from payload 0's header, on the device (every payload's is checked to
// match it); its size is the expected one, so a corrupted header cannot send a write out of bounds.
template <typename T>
__global__ void scatter_sums_kernel(const uint8_t* payloads, int64_t count, int64_t stride, int64_t n, int64_t k,
                                    float alpha, T* out) {
  const PayloadHeader& h = *reinterpret_cast<const PayloadHeader*>(payloads);
  const IndexPermutation pi(static_cast<uint32_t>(n), RandomKey{h.seed, h.step, h.bucket, 0});
  GC_GRID_LOOP(j, k) {
    float sum = 0.0f;
    for (int64_t p = 0; p < count; ++p)
      sum = add_saturating(sum, alpha * to_float(field<T>(payloads + p * stride, kHeaderBytes)[j]));
    out[pi(static_cast<uint32_t>(j))] = from_float_saturating<T>(sum);
  }
}

}  // namespace

void encode_randomk(const EncodeParams& p, cudaStream_t stream) {
  const int64_t n = p.header.numel, k = p.header.param0;
  if (n == 0) return;
  const IndexPermutation pi(static_cast<uint32_t>(n), RandomKey{p.header.seed, p.header.step, p.header.bucket, 0});
  visit_dtype(static_cast<DType>(p.header.dtype), [&](auto* t) {
    using T = Elem<decltype(t)>;
    const T* grad = static_cast<const T*>(p.grad);
    T* residual = static_cast<T*>(p.residual);
    if (residual) add_residual_kernel<<<blocks_for(n), kThreads, 0, stream>>>(grad, residual, n);
    take_kernel<<<blocks_for(k), kThreads, 0, stream>>>(residual ? residual : grad, residual, k, pi,
                                                        reinterpret_cast<T*>(p.payload + kHeaderBytes));
  });
}

void decode_randomk(const DecodeParams& d, cudaStream_t stream) {
  const PayloadHeader& h = d.expected;
  const int64_t n = h.numel, k = h.param0;
  if (n == 0) return;
  visit_dtype(static_cast<DType>(h.dtype), [&](auto* t) {
    using T = Elem<decltype(t)>;
    T* out = static_cast<T*>(d.out);
    fill<<<blocks_for(n), kThreads, 0, stream>>>(out, n, from_float<T>(0.0f));
    scatter_sums_kernel<<<blocks_for(k), kThreads, 0, stream>>>(d.payloads, d.count, body_layout(h).total, n, k,
                                                                d.alpha, out);
  });
}

}  // namespace gradcomp::cuda
