// none, fp16, bf16 (see csrc/cpu/dense.cpp): every element travels, in the gradient's dtype or
// rounded to 16 bits. One thread per element, one pass.
#include "device.cuh"

namespace gradcomp::cuda {
namespace {

template <typename T, typename W, bool kResidual>
__global__ void encode_dense_kernel(const T* grad, T* residual, W* wire, int64_t n) {
  GC_GRID_LOOP(i, n) {
    const float m = compensated<kResidual>(grad, residual, i);
    const W w = from_float_saturating<W>(m);
    wire[i] = w;
    if constexpr (kResidual) residual[i] = residual_value<T>(m, to_float(w));
  }
}

template <typename W>
struct DecodeWire {
  float alpha;
  __device__ float operator()(const uint8_t* payload, int64_t i) const {
    return alpha * to_float(field<W>(payload, kHeaderBytes)[i]);
  }
};

// Calls f with null pointers of (gradient type, wire type).
template <typename F>
void visit_wire(const PayloadHeader& h, F&& f) {
  visit_dtype(static_cast<DType>(h.dtype), [&](auto* grad_type) {
    switch (static_cast<Codec>(h.codec)) {
      case Codec::Fp16: f(grad_type, static_cast<f16*>(nullptr)); break;
      case Codec::Bf16: f(grad_type, static_cast<bf16*>(nullptr)); break;
      default: f(grad_type, grad_type); break;
    }
  });
}

}  // namespace

void encode_dense(const EncodeParams& p, cudaStream_t stream) {
  const int64_t n = p.header.numel;
  if (n == 0) return;
  visit_wire(p.header, [&](auto* t, auto* w) {
    using T = Elem<decltype(t)>;
    using W = Elem<decltype(w)>;
    W* wire = reinterpret_cast<W*>(p.payload + kHeaderBytes);
    if (p.residual)
      encode_dense_kernel<T, W, true><<<blocks_for(n), kThreads, 0, stream>>>(
          static_cast<const T*>(p.grad), static_cast<T*>(p.residual), wire, n);
    else
      encode_dense_kernel<T, W, false><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(p.grad),
                                                                              nullptr, wire, n);
  });
}

void decode_dense(const DecodeParams& d, cudaStream_t stream) {
  visit_wire(d.expected, [&](auto* t, auto* w) {
    launch_sum_decoded<Elem<decltype(t)>>(d, DecodeWire<Elem<decltype(w)>>{d.alpha}, stream);
  });
}

}  // namespace gradcomp::cuda
