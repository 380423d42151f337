// randomk: the k elements at indices pi(0), ..., pi(k - 1) of M = gradient + residual (fp32 sum
// rounded to the gradient's dtype), where pi is the IndexPermutation keyed by (seed, step,
// bucket): every rank picks the same indices, so the payloads can be summed by an allreduce.
// Body: the k values, in that order, in the gradient's dtype; no indices travel.
// Error feedback leaves M in the residual with the sent elements zeroed. M saturates: the fp32
// sum with add_saturating and its rounding with from_float_saturating (hd.h, half.h).
// decode_sum: per chosen element, an fp32 sum from +0 adding alpha * value per payload in order
// with add_saturating, stored with from_float_saturating; the other elements are 0.
#include "chunked.h"

namespace gradcomp::GC_CODECS_NS {
namespace {

template <typename T>
void encode_typed(const EncodeArgs& a) {
  const int64_t n = a.header.numel, k = a.header.param0;
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  T* values = field<T>(a.payload, kHeaderBytes);
  const IndexPermutation pi(static_cast<uint32_t>(n), RandomKey{a.header.seed, a.header.step, a.header.bucket, 0});
  if (residual) {
    parallel_chunks(a.parallel_for, n, 1024, [&](int64_t begin, int64_t len) {
      for (int64_t i = begin; i < begin + len; ++i)
        residual[i] = compensated_value(grad, residual, i);
    });
  }
  const T* m = residual ? residual : grad;
  for_ranges(a.parallel_for, k, kElementsPerTask / 8, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {  // pi is a bijection: each j owns its element
      const uint32_t i = pi(static_cast<uint32_t>(j));
      values[j] = m[i];
      if (residual) residual[i] = from_float<T>(0.0f);
    }
  });
}

template <typename T>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  const int64_t n = h.numel, k = h.param0;
  T* out = static_cast<T*>(a.out);
  parallel_chunks(a.parallel_for, n, 1024,
                  [&](int64_t begin, int64_t len) { std::fill(out + begin, out + begin + len, from_float<T>(0.0f)); });
  const IndexPermutation pi(static_cast<uint32_t>(n), RandomKey{h.seed, h.step, h.bucket, 0});
  for_ranges(a.parallel_for, k, kElementsPerTask / 8, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      float sum = 0.0f;
      for (int64_t p = 0; p < a.count; ++p)
        sum = add_saturating(sum, a.alpha * to_float(field<T>(a.payloads + p * a.stride, kHeaderBytes)[j]));
      out[pi(static_cast<uint32_t>(j))] = from_float_saturating<T>(sum);
    }
  });
}

}  // namespace

void encode_randomk(const EncodeArgs& a) {
  visit_dtype(static_cast<DType>(a.header.dtype),
              [&](auto* t) { encode_typed<std::remove_pointer_t<decltype(t)>>(a); });
}

void decode_randomk(const DecodeArgs& a, const PayloadHeader& h) {
  visit_dtype(static_cast<DType>(h.dtype),
              [&](auto* t) { decode_typed<std::remove_pointer_t<decltype(t)>>(a, h); });
}

}  // namespace gradcomp::GC_CODECS_NS
