// topk: the k elements of largest magnitude of M = gradient + residual (computed in fp32, then
// rounded to the gradient's dtype). Magnitude order is that of magnitude_key: NaN above Inf above
// every finite value, -0 equal to +0; among equal magnitudes the lower index wins.
// Body (wire.h): k indices in ascending order, then their k values of M. Wide: int32 indices and
// the gradient's dtype. Compact: per span of 65536 elements a uint32 count, each index's low 16
// bits, and the values as bf16 for an fp32 gradient (from_float_saturating), else in its dtype.
// Error feedback leaves M in the residual with each sent element replaced by what its value lost
// on the wire: 0, or M - bf16(M) for compact fp32 (exact in fp32; 0 where M is not finite). M
// saturates: the fp32 sum with add_saturating and its rounding with from_float_saturating.
// decode_sum: out = 0 + alpha * value for one payload; for several, fp32 sums from +0 adding
// alpha * value per payload in order with add_saturating; stored with from_float_saturating.
//
// Selection works on magnitude keys (bins = their top 11 bits) in one pass over the data: a
// sample of 2^16 keys (256 evenly spaced runs of 256, cheap to read) estimates a bin that at
// least k elements reach, with a safety margin; the pass computes M (writing it to the residual under error feedback) and gathers
// every element at or above that bin, with its key, in index order (about 2k of them). The exact
// k-th largest key is found among the gathered keys, and the gathered list yields every element
// above it plus the first ones equal to it. Should the sample have aimed too high (fewer than k
// gathered), or found too few keys above the lowest bin, a histogram pass over M finds the exact bin
// and the gathering is redone.
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "chunked.h"

namespace gradcomp::GC_CODECS_NS {
namespace {

constexpr int kBinShift = 20;  // keys are below 2^31: 11 bits of exponent and leading mantissa
constexpr int kBins = 1 << (31 - kBinShift);
constexpr int64_t kSampleRuns = 256, kSampleRun = 256;
constexpr int64_t kSample = kSampleRuns * kSampleRun;

template <typename T>
uint32_t key_of(const T* m, int64_t i) { return magnitude_key(to_float(m[i])); }

struct Candidates {
  std::vector<int32_t> index;
  std::vector<uint32_t> key;
  void clear() { index.clear(); key.clear(); }
  void add(int64_t i, uint32_t k) {
    index.push_back(static_cast<int32_t>(i));
    key.push_back(k);
  }
};

// A lowest key no key reaches (keys are below 2^31): gathers nothing, so the exact pass runs.
constexpr uint32_t kAboveEveryKey = 0xFFFFFFFFu;

// The lowest key of the bin that, by a sample of the keys, at least k elements reach, lowered by a
// margin of about four standard deviations of the sample count. Where the sample reaches the lowest
// bin, kAboveEveryKey: M is then mostly zeros (a sparse gradient, or the two-phase owner's sum of a
// few top-k payloads), and gathering at bin 0 would gather every element and select among them all
// (7x the exact passes' time on the 2-rank MLP's owner chunk: 13.0 against 1.8 ms).
template <typename KeyAt>
uint32_t estimated_lowest_key(int64_t n, int64_t k, KeyAt&& key_at) {
  if (n <= kSample) return 0;  // small tensors: gather everything
  std::vector<int64_t> histogram(kBins, 0);
  for (int64_t run = 0; run < kSampleRuns; ++run)
    for (int64_t j = run * (n / kSampleRuns); j < run * (n / kSampleRuns) + kSampleRun; ++j)
      ++histogram[key_at(j) >> kBinShift];
  const double expected = static_cast<double>(k) * kSample / n;
  const double wanted = expected + 4.0 * std::sqrt(expected) + 16.0;
  int64_t reached = 0;
  int bin = kBins - 1;
  while (bin > 0 && reached + histogram[bin] < wanted) reached += histogram[bin--];
  return bin == 0 ? kAboveEveryKey : static_cast<uint32_t>(bin) << kBinShift;
}

// The lowest key of the bin holding the k-th largest key of m, by a histogram of all of m.
template <typename T>
uint32_t exact_lowest_key(const T* m, int64_t n, int64_t k) {
  std::vector<int64_t> histogram(kBins, 0);
  for (int64_t i = 0; i < n; ++i) ++histogram[key_of(m, i) >> kBinShift];
  int64_t above = 0;
  int bin = kBins - 1;
  while (above + histogram[bin] < k) above += histogram[bin--];
  return static_cast<uint32_t>(bin) << kBinShift;
}

// Gathers, in index order, the elements of [begin, end) whose key reaches lowest_key. With a
// residual, first replaces it by M = grad + residual (rounded to T), the pass error feedback needs.
template <typename T>
void gather_range(const T* grad, T* residual, int64_t begin, int64_t end, uint32_t lowest_key, Candidates& out) {
  constexpr int64_t kChunk = 512;
  uint32_t keys[kChunk];
  for (int64_t first = begin; first < end; first += kChunk) {
    const int64_t len = std::min(kChunk, end - first);
    if (residual) {
      for (int64_t i = 0; i < len; ++i) {
        residual[first + i] = compensated_value(grad, residual, first + i);
        keys[i] = key_of(residual, first + i);
      }
    } else {
      for (int64_t i = 0; i < len; ++i) keys[i] = key_of(grad, first + i);
    }
    for (int64_t i = 0; i < len; ++i)
      if (keys[i] >= lowest_key) out.add(first + i, keys[i]);
  }
}

// gather_range over all n elements, in fixed slices that may run in parallel, joined in order.
template <typename T>
void gather(ParallelFor parallel_for, const T* grad, T* residual, int64_t n, uint32_t lowest_key, Candidates& out) {
  std::vector<Candidates> slices(ceil_div(n, kElementsPerTask));
  for_ranges(parallel_for, static_cast<int64_t>(slices.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s)
      gather_range(grad, residual, s * kElementsPerTask, std::min(n, (s + 1) * kElementsPerTask), lowest_key, slices[s]);
  });
  out.clear();
  for (const Candidates& slice : slices) {
    out.index.insert(out.index.end(), slice.index.begin(), slice.index.end());
    out.key.insert(out.key.end(), slice.key.begin(), slice.key.end());
  }
}

// Where encode writes the k selected elements, in ascending index order (wire.h's two layouts).
template <typename V>
struct BodyWriter {
  int32_t* wide_indices = nullptr;
  uint32_t* span_counts = nullptr;  // compact: zeroed here, counted as the indices are written
  uint16_t* low_bits = nullptr;
  V* values = nullptr;

  BodyWriter(uint8_t* payload, const PayloadHeader& h) {
    const BodyLayout layout = body_layout(h);
    values = field<V>(payload, layout.values);
    if (h.param1 != kTopkCompact) {
      wide_indices = field<int32_t>(payload, layout.codes);
      return;
    }
    span_counts = field<uint32_t>(payload, layout.scales);
    low_bits = field<uint16_t>(payload, layout.codes);
    std::fill(span_counts, span_counts + ceil_div(h.numel, kCompactSpan), 0u);
  }

  void put(int64_t j, int64_t index, V value) {
    values[j] = value;
    if (wide_indices) {
      wide_indices[j] = static_cast<int32_t>(index);
      return;
    }
    ++span_counts[index / kCompactSpan];
    low_bits[j] = static_cast<uint16_t>(index % kCompactSpan);
  }
};

// T the gradient's dtype, V its values' on the wire (topk_value_dtype).
template <typename T, typename V>
void encode_typed(const EncodeArgs& a) {
  const int64_t n = a.header.numel, k = a.header.param0;
  if (n == 0) return;
  BodyWriter<V> body(a.payload, a.header);
  const T* grad = static_cast<const T*>(a.grad);
  T* residual = static_cast<T*>(a.residual);
  const T* m = residual ? residual : grad;  // M, once the pass below has run

  const uint32_t lowest_key = estimated_lowest_key(n, k, [&](int64_t i) {
    return magnitude_key(to_float(residual ? compensated_value(grad, residual, i) : grad[i]));
  });
  Candidates candidates;
  gather(a.parallel_for, grad, residual, n, lowest_key, candidates);
  if (static_cast<int64_t>(candidates.key.size()) < k)  // the sample aimed too high: M is in place now
    gather(a.parallel_for, m, static_cast<T*>(nullptr), n, exact_lowest_key(m, n, k), candidates);

  // The k-th largest gathered key, and how many of the keys equal to it are taken.
  std::vector<uint32_t> keys(candidates.key);
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  const uint32_t threshold = keys[k - 1];
  int64_t ties_left = k - std::count_if(keys.begin(), keys.begin() + k, [&](uint32_t key) { return key > threshold; });

  // Emit in index order: every key above the threshold and the first ties.
  int64_t emitted = 0;
  for (size_t c = 0; c < candidates.key.size() && emitted < k; ++c) {
    const uint32_t key = candidates.key[c];
    if (key > threshold || (key == threshold && ties_left-- > 0)) {
      const int32_t i = candidates.index[c];
      const V value = topk_wire_value<V>(m[i]);
      body.put(emitted++, i, value);
      if (residual) residual[i] = from_float<T>(sent_loss(to_float(m[i]), to_float(value)));
    }
  }
}

// The k indices of a validated payload: the wide layout's own int32 array, or the compact layout's
// expanded into scratch.
const int32_t* indices_of(const uint8_t* payload, const PayloadHeader& h, std::vector<int32_t>& scratch) {
  if (h.param1 != kTopkCompact) return field<int32_t>(payload, body_layout(h).codes);
  read_topk_indices(payload, h, scratch);
  scratch.resize(h.param0, -1);  // only a race after validation leaves it short; -1 fails the bound check
  return scratch.data();
}

template <typename T, typename V>
void decode_typed(const DecodeArgs& a, const PayloadHeader& h) {
  const int64_t n = h.numel, k = h.param0;
  const int64_t values_at = body_layout(h).values;
  T* out = static_cast<T*>(a.out);
  std::fill(out, out + n, from_float<T>(0.0f));
  std::vector<int32_t> expanded;  // validated already; the bound checks keep any race in bounds
  if (a.count == 1) {  // each index written once: 0 + alpha * v
    const int32_t* indices = indices_of(a.payloads, h, expanded);
    const V* values = field<V>(a.payloads, values_at);
    for (int64_t j = 0; j < k; ++j)
      if (static_cast<uint32_t>(indices[j]) < static_cast<uint64_t>(n))
        out[indices[j]] = from_float_saturating<T>(0.0f + a.alpha * to_float(values[j]));
    return;
  }
  std::vector<float> scratch;  // fp32 sums: in out itself when out is fp32
  float* sums = reinterpret_cast<float*>(out);
  if constexpr (!std::is_same_v<T, float>) {
    scratch.assign(n, 0.0f);
    sums = scratch.data();
  }
  for (int64_t p = 0; p < a.count; ++p) {
    const int32_t* indices = indices_of(a.payloads + p * a.stride, h, expanded);
    const V* values = field<V>(a.payloads + p * a.stride, values_at);
    for (int64_t j = 0; j < k; ++j)
      if (static_cast<uint32_t>(indices[j]) < static_cast<uint64_t>(n)) sums[indices[j]] = add_saturating(sums[indices[j]], a.alpha * to_float(values[j]));
  }
  if constexpr (!std::is_same_v<T, float>)  // fp32 sums are already in out
    for (int64_t i = 0; i < n; ++i) out[i] = from_float_saturating<T>(sums[i]);
}

// Calls f with null pointers of the gradient's type and of its values' type on the wire.
template <typename F>
void visit_topk_types(const PayloadHeader& h, F&& f) {
  visit_dtype(static_cast<DType>(h.dtype), [&](auto* t) {
    visit_topk_value_type<std::remove_pointer_t<decltype(t)>>(h, [&](auto* v) { f(t, v); });
  });
}

}  // namespace

void encode_topk(const EncodeArgs& a) {
  visit_topk_types(a.header, [&](auto* t, auto* v) {
    encode_typed<std::remove_pointer_t<decltype(t)>, std::remove_pointer_t<decltype(v)>>(a);
  });
}

void decode_topk(const DecodeArgs& a, const PayloadHeader& h) {
  visit_topk_types(h, [&](auto* t, auto* v) {
    decode_typed<std::remove_pointer_t<decltype(t)>, std::remove_pointer_t<decltype(v)>>(a, h);
  });
}

}  // namespace gradcomp::GC_CODECS_NS
