// topk: the k elements of largest magnitude of M = gradient + residual (computed in fp32, then
// rounded to the gradient's dtype). Magnitude order is that of magnitude_key: NaN above Inf above
// every finite value, -0 equal to +0; among equal magnitudes the lower index wins.
// Body: k int32 indices in ascending order, then their k values of M in the gradient's dtype.
// Error feedback leaves M in the residual with the sent elements zeroed.
//
// Selection is a radix select on the magnitude keys in two passes over M: the first builds a
// histogram of the top 11 key bits, which gives the bin holding the k-th largest key; the second
// gathers every element of that bin or above (index and key, in index order). The exact threshold
// is found among the gathered keys of that bin, and the gathered list, already in index order,
// yields every element above the threshold plus the first ones equal to it.
#include <algorithm>
#include <functional>
#include <vector>

#include "chunked.h"

namespace gradcomp::GC_CODECS_NS {
namespace {

constexpr int kBinShift = 20;  // keys are below 2^31: 11 bits of exponent and leading mantissa
constexpr int kBins = 1 << (31 - kBinShift);
constexpr int64_t kChunk = 512;

template <typename T>
uint32_t key_of(const T* m, int64_t i) { return magnitude_key(to_float(m[i])); }

template <typename T>
void encode_typed(const EncodeArgs& a) {
  const int64_t n = a.header.numel, k = a.header.param0;
  if (n == 0) return;
  const BodyLayout layout = body_layout(a.header);
  int32_t* indices = field<int32_t>(a.payload, layout.codes);
  T* values = field<T>(a.payload, layout.values);
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);

  // Pass 1: M (kept in the residual under error feedback) and the histogram of its keys, kept as
  // four interleaved histograms so that runs of equal bins do not serialize on one counter.
  std::vector<int64_t> histograms(4 * kBins, 0);
  uint32_t bins[kChunk];
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t len = std::min(kChunk, n - begin);
    if (residual) {
      for (int64_t i = 0; i < len; ++i) {
        residual[begin + i] = from_float<T>(to_float(grad[begin + i]) + to_float(residual[begin + i]));
        bins[i] = key_of(residual, begin + i) >> kBinShift;
      }
    } else {
      for (int64_t i = 0; i < len; ++i) bins[i] = key_of(grad, begin + i) >> kBinShift;
    }
    for (int64_t i = 0; i < len; ++i) ++histograms[(i & 3) * kBins + bins[i]];
  }
  const T* m = residual ? residual : grad;
  auto bin_count = [&](uint32_t bin) {
    return histograms[bin] + histograms[kBins + bin] + histograms[2 * kBins + bin] + histograms[3 * kBins + bin];
  };

  // The bin holding the k-th largest key, and how many elements lie above it.
  int64_t above = 0;
  uint32_t bin = kBins - 1;
  while (above + bin_count(bin) < k) above += bin_count(bin--);

  // Pass 2: every element in that bin or above, in index order, with its key.
  std::vector<int32_t> candidate_index;
  std::vector<uint32_t> candidate_key;
  candidate_index.reserve(above + bin_count(bin));
  candidate_key.reserve(above + bin_count(bin));
  const uint32_t lowest_key = bin << kBinShift;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = key_of(m, i);
    if (key >= lowest_key) {
      candidate_index.push_back(static_cast<int32_t>(i));
      candidate_key.push_back(key);
    }
  }

  // The exact threshold is the (k - above)-th largest key of the bin.
  std::vector<uint32_t> in_bin;
  in_bin.reserve(bin_count(bin));
  for (uint32_t key : candidate_key)
    if ((key >> kBinShift) == bin) in_bin.push_back(key);
  const int64_t rank_in_bin = k - above;  // >= 1
  std::nth_element(in_bin.begin(), in_bin.begin() + (rank_in_bin - 1), in_bin.end(), std::greater<uint32_t>());
  const uint32_t threshold = in_bin[rank_in_bin - 1];
  int64_t ties_left =
      rank_in_bin - std::count_if(in_bin.begin(), in_bin.end(), [&](uint32_t key) { return key > threshold; });

  // Emit in index order: every key above the threshold and the first ties.
  int64_t emitted = 0;
  for (size_t c = 0; c < candidate_key.size() && emitted < k; ++c) {
    const uint32_t key = candidate_key[c];
    if (key > threshold || (key == threshold && ties_left-- > 0)) {
      const int32_t i = candidate_index[c];
      indices[emitted] = i;
      values[emitted] = m[i];
      if (residual) residual[i] = from_float<T>(0.0f);
      ++emitted;
    }
  }
}

template <typename T>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  const int64_t n = h.numel, k = h.param0;
  const BodyLayout layout = body_layout(h);
  T* out = static_cast<T*>(a.out);
  std::fill(out, out + n, from_float<T>(0.0f));
  if (a.count == 1) {  // each index written once: (0 + v) * alpha
    const int32_t* indices = field<int32_t>(a.payloads, layout.codes);
    const T* values = field<T>(a.payloads, layout.values);
    for (int64_t j = 0; j < k; ++j)
      out[indices[j]] = from_float<T>((0.0f + to_float(values[j])) * a.alpha);
    return;
  }
  std::vector<float> scratch;  // fp32 sums: in out itself when out is fp32
  float* sums = reinterpret_cast<float*>(out);
  if constexpr (!std::is_same_v<T, float>) {
    scratch.assign(n, 0.0f);
    sums = scratch.data();
  }
  for (int64_t p = 0; p < a.count; ++p) {
    const int32_t* indices = field<int32_t>(a.payloads + p * a.stride, layout.codes);
    const T* values = field<T>(a.payloads + p * a.stride, layout.values);
    for (int64_t j = 0; j < k; ++j) sums[indices[j]] += to_float(values[j]);
  }
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(sums[i] * a.alpha);
}

}  // namespace

void encode_topk(const EncodeArgs& a) {
  visit_dtype(static_cast<DType>(a.header.dtype),
              [&](auto* t) { encode_typed<std::remove_pointer_t<decltype(t)>>(a); });
}

void decode_topk(const DecodeArgs& a, const PayloadHeader& h) {
  visit_dtype(static_cast<DType>(h.dtype),
              [&](auto* t) { decode_typed<std::remove_pointer_t<decltype(t)>>(a, h); });
}

}  // namespace gradcomp::GC_CODECS_NS
