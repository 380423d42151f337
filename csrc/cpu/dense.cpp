// none, fp16, bf16: every element travels, in the gradient's dtype or rounded to 16 bits
// (round-to-nearest-even). Body: n values of the wire type.
// The wire value is from_float_saturating<W>(m): a finite m beyond the wire type's range travels
// as +-its largest finite value (an fp32 1e5 under fp16 travels as 65504), and with error
// feedback the rest stays in the residual. NaN and Inf travel as themselves.
// decode_sum adds, per payload in order, alpha * value (fp32 add_saturating, from +0).
#include "chunked.h"

namespace gradcomp::GC_CODECS_NS {
namespace {

constexpr int64_t kChunk = 256;

// One chunk; parameters, not captures: see signsgd.cpp.
template <typename T, typename W, bool kResidual>
void encode_chunk(const T* grad, T* residual, W* wire, int64_t begin, int64_t len) {
  float m[kChunk], decoded[kChunk];
  load_compensated<kResidual>(grad, residual, begin, len, m);
  store_saturating(wire + begin, m, len);
  for (int64_t i = 0; i < len; ++i) decoded[i] = to_float(wire[begin + i]);
  if constexpr (kResidual) store_residuals(residual, begin, len, m, decoded);
}

template <typename T, typename W, bool kResidual>
void encode_as(const EncodeArgs& a) {
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  W* wire = field<W>(a.payload, kHeaderBytes);
  parallel_chunks(a.parallel_for, a.header.numel, kChunk, [&](int64_t begin, int64_t len) {
    encode_chunk<T, W, kResidual>(grad, residual, wire, begin, len);
  });
}

template <typename T, typename W>
void decode_as(const DecodeArgs& a, const PayloadHeader& h) {
  const float alpha = a.alpha;
  sum_payloads<T>(a, h.numel, [alpha](const uint8_t* payload, int64_t begin, int64_t len, float* acc) {
    const W* wire = field<W>(payload, kHeaderBytes) + begin;
    for (int64_t i = 0; i < len; ++i) acc[i] = add_saturating(acc[i], alpha * to_float(wire[i]));
  });
}

// Calls f with null pointers of (gradient type, wire type).
template <typename F>
void visit_wire(const PayloadHeader& h, F&& f) {
  visit_dtype(static_cast<DType>(h.dtype), [&](auto* grad_type) {
    using T = std::remove_pointer_t<decltype(grad_type)>;
    switch (static_cast<Codec>(h.codec)) {
      case Codec::Fp16: f(grad_type, static_cast<f16*>(nullptr)); break;
      case Codec::Bf16: f(grad_type, static_cast<bf16*>(nullptr)); break;
      default: f(grad_type, static_cast<T*>(nullptr)); break;
    }
  });
}

}  // namespace

void encode_dense(const EncodeArgs& a) {
  visit_wire(a.header, [&](auto* t, auto* w) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_pointer_t<decltype(w)>;
    if (a.residual) encode_as<T, W, true>(a);
    else encode_as<T, W, false>(a);
  });
}

void decode_dense(const DecodeArgs& a, const PayloadHeader& h) {
  visit_wire(h, [&](auto* t, auto* w) {
    decode_as<std::remove_pointer_t<decltype(t)>, std::remove_pointer_t<decltype(w)>>(a, h);
  });
}

}  // namespace gradcomp::GC_CODECS_NS
