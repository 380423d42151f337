// topk (see csrc/cpu/topk.cpp for the selection rule): an exact radix select of the k-th largest
// magnitude key, then an order-preserving compaction, with no host round trip:
//   1. M = gradient + residual (written to the residual under error feedback) and a histogram of
//      the keys' top 11 bits, in one pass;
//   2. a one-block kernel finds the bin holding the k-th largest key and how many more keys it must
//      give (need); two more passes refine the threshold by the next 10 and the last 10 bits, over
//      the keys that match the prefix found so far. The threshold T is then the exact k-th key, and
//      need the number of keys equal to T to take (the lowest indices win);
//   3. per tile of 4096 elements, the counts of keys above and equal to T; exclusive scans (CUB) of
//      those counts; then each tile writes its selected elements in index order, each at position
//      (keys above T before it) + min(keys equal to T before it, need).
// Five passes over M in all; the workspace is a few counters per 4096 elements. The compact layout
// (wire.h) has step 3 write int32 indices to the workspace, then packs their low 16 bits and counts
// each span's indices by two binary searches in them (no atomics: the same bits as the CPU).
// Decode of the compact layout first expands the indices to int32 in its workspace (a scan of each
// payload's counts, then a binary search per index), so the checks and the sums are the wide ones.
#include <cub/cub.cuh>

#include "device.cuh"

namespace gradcomp::cuda {
namespace {

constexpr int kTopBits = 11, kDigitBits = 10;
constexpr int kTopBins = 1 << kTopBits, kDigitBins = 1 << kDigitBits;
constexpr int kSelectThreads = 1024;
constexpr int kTileRounds = 16;
constexpr int64_t kTile = kTileRounds * kThreads;

struct SelectState {
  uint32_t prefix;  // the key bits settled so far
  uint32_t mask;    // which bits those are
  uint32_t need;    // how many of the keys matching prefix are still to take
  uint32_t unused;
};

template <typename T>
__device__ __forceinline__ uint32_t key_of(const T* m, int64_t i) { return magnitude_key(to_float(m[i])); }

__global__ void start_select(SelectState* state, uint32_t k) { *state = SelectState{0, 0, k, 0}; }

template <int kBins>
__device__ __forceinline__ void flush_histogram(const uint32_t* local, uint32_t* hist) {
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x)
    if (local[b]) atomicAdd(&hist[b], local[b]);
}

template <typename T, bool kResidual>
__global__ void prepare_and_histogram(const T* grad, T* residual, int64_t n, uint32_t* hist) {
  __shared__ uint32_t local[kTopBins];
  for (int b = threadIdx.x; b < kTopBins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  GC_GRID_LOOP(i, n) {
    T m = grad[i];
    if constexpr (kResidual) {
      m = compensated_value(grad, residual, i);
      residual[i] = m;
    }
    atomicAdd(&local[magnitude_key(to_float(m)) >> (31 - kTopBits)], 1u);
  }
  flush_histogram<kTopBins>(local, hist);
}

template <typename T>
__global__ void digit_histogram(const T* m, int64_t n, const SelectState* state, int shift, uint32_t* hist) {
  __shared__ uint32_t local[kDigitBins];
  for (int b = threadIdx.x; b < kDigitBins; b += blockDim.x) local[b] = 0;
  const uint32_t prefix = state->prefix, mask = state->mask;
  __syncthreads();
  GC_GRID_LOOP(i, n) {
    const uint32_t key = key_of(m, i);
    if ((key & mask) == prefix) atomicAdd(&local[(key >> shift) & (kDigitBins - 1)], 1u);
  }
  flush_histogram<kDigitBins>(local, hist);
}

// One block: the bin, counted from the top, where the running count reaches need. Settles that
// digit in the state and clears the histogram for the next digit.
template <int kBins>
__global__ void select_digit(uint32_t* hist, SelectState* state, int shift) {
  constexpr int kPer = kBins / kSelectThreads;
  using Scan = cub::BlockScan<uint32_t, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  uint32_t counts[kPer], before[kPer];
  for (int j = 0; j < kPer; ++j) counts[j] = hist[kBins - 1 - (kPer * threadIdx.x + j)];
  const uint32_t need = state->need;
  Scan(scan_storage).ExclusiveSum(counts, before);
  __syncthreads();  // every thread has read need
  for (int j = 0; j < kPer; ++j) {
    if (before[j] < need && need <= before[j] + counts[j]) {
      const uint32_t bin = kBins - 1 - (kPer * threadIdx.x + j);
      state->need = need - before[j];
      state->prefix |= bin << shift;
      state->mask |= static_cast<uint32_t>(kBins - 1) << shift;
    }
    hist[kBins - 1 - (kPer * threadIdx.x + j)] = 0;
  }
}

template <typename T>
__global__ void tile_counts(const T* m, int64_t n, const SelectState* state, uint32_t* above, uint32_t* equal) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage reduce_storage;
  const uint32_t threshold = state->prefix;
  for (int64_t tile = blockIdx.x; tile * kTile < n; tile += gridDim.x) {
    uint32_t packed = 0;  // above << 16 | equal: at most 4096 each
    for (int r = 0; r < kTileRounds; ++r) {
      const int64_t i = tile * kTile + r * kThreads + threadIdx.x;
      if (i < n) {
        const uint32_t key = key_of(m, i);
        packed += (key > threshold ? 1u << 16 : 0u) + (key == threshold ? 1u : 0u);
      }
    }
    const uint32_t total = Reduce(reduce_storage).Sum(packed);
    if (threadIdx.x == 0) {
      above[tile] = total >> 16;
      equal[tile] = total & 0xFFFFu;
    }
    __syncthreads();
  }
}

template <typename T, typename V>
__global__ void write_selected(const T* m, T* residual, int64_t n, const SelectState* state,
                               const uint32_t* above_before, const uint32_t* equal_before, int32_t* indices,
                               V* values) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const uint32_t threshold = state->prefix, need = state->need;
  for (int64_t tile = blockIdx.x; tile * kTile < n; tile += gridDim.x) {
    uint32_t above_run = above_before[tile], equal_run = equal_before[tile];
    for (int r = 0; r < kTileRounds; ++r) {
      const int64_t i = tile * kTile + r * kThreads + threadIdx.x;
      const uint32_t key = i < n ? key_of(m, i) : 0u;
      const bool above = i < n && key > threshold, equal = i < n && key == threshold;
      uint32_t before, round_total;
      Scan(scan_storage).ExclusiveSum((above ? 1u << 16 : 0u) | (equal ? 1u : 0u), before, round_total);
      const uint32_t above_ahead = above_run + (before >> 16), equal_ahead = equal_run + (before & 0xFFFFu);
      if (above || (equal && equal_ahead < need)) {
        const uint32_t position = above_ahead + min(equal_ahead, need);
        const V value = topk_wire_value<V>(m[i]);
        indices[position] = static_cast<int32_t>(i);
        values[position] = value;
        if (residual) residual[i] = from_float<T>(sent_loss(to_float(m[i]), to_float(value)));
      }
      above_run += round_total >> 16;
      equal_run += round_total & 0xFFFFu;
      __syncthreads();
    }
  }
}

// A workspace carved in 256-byte-aligned pieces of the given sizes.
template <int kPieces>
struct Carved {
  size_t offsets[kPieces];
  size_t total = 0;

  explicit Carved(const size_t (&sizes)[kPieces]) {
    for (int j = 0; j < kPieces; ++j) {
      offsets[j] = total;
      total += (sizes[j] + 255) / 256 * 256;
    }
  }
  template <typename P>
  P* at(void* base, int j) const { return reinterpret_cast<P*>(static_cast<uint8_t*>(base) + offsets[j]); }
};

size_t scan_storage_bytes(int64_t tiles) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
                                static_cast<int>(tiles));
  return bytes;
}

int64_t tiles_for(int64_t n) { return std::max<int64_t>(1, ceil_div(n, kTile)); }

// The encode workspace: state, histogram, above, equal, above_before, equal_before, scan storage, and
// for the compact layout the k int32 indices before packing.
struct TopkWorkspace : Carved<8> {
  int64_t tiles;
  size_t scan_bytes;

  explicit TopkWorkspace(const PayloadHeader& h)
      : TopkWorkspace(h, tiles_for(h.numel), scan_storage_bytes(tiles_for(h.numel))) {}
  TopkWorkspace(const PayloadHeader& h, int64_t tiles_, size_t scan_bytes_)
      : Carved<8>({sizeof(SelectState), sizeof(uint32_t) * kTopBins, 4 * size_t(tiles_), 4 * size_t(tiles_),
                   4 * size_t(tiles_), 4 * size_t(tiles_), scan_bytes_,
                   h.param1 == kTopkCompact ? 4 * size_t(h.param0) : 0}),
        tiles(tiles_),
        scan_bytes(scan_bytes_) {}
};

// The first position of the ascending indices[0, k) at or above value.
__device__ __forceinline__ int64_t lower_bound(const int32_t* indices, int64_t k, int64_t value) {
  int64_t low = 0, high = k;
  while (low < high) {
    const int64_t mid = (low + high) / 2;
    if (indices[mid] < value) low = mid + 1;
    else high = mid;
  }
  return low;
}

// The compact body from the selected int32 indices: each one's low 16 bits, and each span's count.
__global__ void pack_compact(const int32_t* indices, int64_t k, int64_t spans, uint16_t* low_bits,
                             uint32_t* span_counts) {
  GC_GRID_LOOP(j, k) low_bits[j] = static_cast<uint16_t>(indices[j] % kCompactSpan);
  GC_GRID_LOOP(span, spans)
    span_counts[span] = static_cast<uint32_t>(lower_bound(indices, k, (span + 1) * kCompactSpan) -
                                              lower_bound(indices, k, span * kCompactSpan));
}

// Per payload (a block each): where each span's indices start, by a scan of its counts;
// offsets[spans] is their total, which must be k.
__global__ void scan_compact_counts(const uint8_t* counts_field, int64_t count, int64_t stride, int64_t spans, int64_t k,
                                    int64_t* offsets, uint32_t* problems) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  for (int64_t p = blockIdx.x; p < count; p += gridDim.x) {
    const uint32_t* counts = reinterpret_cast<const uint32_t*>(counts_field + p * stride);
    int64_t* out = offsets + p * (spans + 1);
    int64_t running = 0;
    for (int64_t first = 0; first < spans; first += kThreads) {
      const int64_t span = first + threadIdx.x;
      int64_t before, round_total;
      Scan(scan_storage).ExclusiveSum(span < spans ? static_cast<int64_t>(counts[span]) : 0, before, round_total);
      if (span < spans) out[span] = running + before;
      running += round_total;
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      out[spans] = running;
      if (running != k) atomicOr(problems, kIndexInvalid);
    }
  }
}

// Each index of each compact payload as int32 (-1 where it would lie at or past n, which the wide
// check then refuses): its span is the last one starting at or before its position.
__global__ void expand_compact(const uint8_t* payloads, int64_t count, int64_t stride, int64_t codes, int64_t spans,
                               int64_t k, int64_t n, const int64_t* offsets, int32_t* indices) {
  GC_GRID_LOOP(item, count * k) {
    const int64_t p = item / k, j = item % k;
    const int64_t* starts = offsets + p * (spans + 1);
    int64_t low = 0, high = spans - 1;  // the last span whose start is at or before j
    while (low < high) {
      const int64_t mid = (low + high + 1) / 2;
      if (starts[mid] <= j) low = mid;
      else high = mid - 1;
    }
    const uint16_t low_bits = reinterpret_cast<const uint16_t*>(payloads + p * stride + codes)[j];
    const int64_t index = low * kCompactSpan + low_bits;
    indices[item] = index < n ? static_cast<int32_t>(index) : -1;
  }
}

// read_topk_indices's checks (csrc/cpu/codec.cpp) on the device, one thread per index of every
// payload (the payload's own int32 indices, or the expanded compact ones).
__global__ void check_indices(const int32_t* all_indices, int64_t count, int64_t stride_words, int64_t k, int64_t n,
                              uint32_t* status) {
  GC_GRID_LOOP(j, count * k) {
    const int32_t* indices = all_indices + (j / k) * stride_words;
    const int64_t at = j % k;
    const int32_t index = indices[at];
    if (index < 0 || index >= n || (at > 0 && index <= indices[at - 1])) atomicOr(status, kIndexInvalid);
  }
}

// The decode workspace: fp32 sums (several payloads into a 16-bit output), then for the compact
// layout every payload's expanded indices and the starts of its spans.
struct TopkDecodeWorkspace : Carved<3> {
  explicit TopkDecodeWorkspace(const PayloadHeader& h, int64_t count)
      : Carved<3>({count > 1 && static_cast<DType>(h.dtype) != DType::F32 ? sizeof(float) * h.numel : 0,
                   h.param1 == kTopkCompact ? sizeof(int32_t) * count * h.param0 : 0,
                   h.param1 == kTopkCompact ? sizeof(int64_t) * count * (ceil_div(h.numel, kCompactSpan) + 1) : 0}) {}
};

template <typename T, typename V>
__global__ void scatter_single(const int32_t* indices, const V* values, int64_t k, int64_t n, float alpha, T* out) {
  GC_GRID_LOOP(j, k) {
    const int32_t i = indices[j];
    if (i >= 0 && i < n) out[i] = from_float_saturating<T>(0.0f + alpha * to_float(values[j]));
  }
}

// Indices within one payload are distinct (checked: strictly ascending), so one payload's adds do
// not race; payloads go one launch each, in order, as the CPU adds them.
template <typename V>
__global__ void scatter_add(const int32_t* indices, const V* values, int64_t k, int64_t n, float alpha, float* sums) {
  GC_GRID_LOOP(j, k) {
    const int32_t i = indices[j];
    if (i >= 0 && i < n) sums[i] = add_saturating(sums[i], alpha * to_float(values[j]));
  }
}

template <typename T>
__global__ void store_sums(const float* sums, int64_t n, T* out) {
  GC_GRID_LOOP(i, n) out[i] = from_float_saturating<T>(sums[i]);
}

}  // namespace

size_t topk_encode_workspace(const PayloadHeader& h) { return TopkWorkspace(h).total; }

size_t topk_decode_workspace(const PayloadHeader& h, int64_t count) { return TopkDecodeWorkspace(h, count).total; }

// Returns CUB's error, if any: a CUB failure need not set the runtime's last error.
cudaError_t encode_topk(const EncodeParams& p, cudaStream_t stream) {
  const int64_t n = p.header.numel, k = p.header.param0;
  if (n == 0) return cudaSuccess;
  const TopkWorkspace w(p.header);
  auto* state = w.at<SelectState>(p.workspace, 0);
  auto* hist = w.at<uint32_t>(p.workspace, 1);
  auto* above = w.at<uint32_t>(p.workspace, 2);
  auto* equal = w.at<uint32_t>(p.workspace, 3);
  auto* above_before = w.at<uint32_t>(p.workspace, 4);
  auto* equal_before = w.at<uint32_t>(p.workspace, 5);
  const BodyLayout layout = body_layout(p.header);
  const bool compact = p.header.param1 == kTopkCompact;
  int32_t* indices = compact ? w.at<int32_t>(p.workspace, 7) : reinterpret_cast<int32_t*>(p.payload + layout.codes);
  cudaMemsetAsync(hist, 0, sizeof(uint32_t) * kTopBins, stream);
  start_select<<<1, 1, 0, stream>>>(state, static_cast<uint32_t>(k));
  cudaError_t error = cudaSuccess;
  visit_encode(p, [&](auto* t, auto has_residual) {
    using T = Elem<decltype(t)>;
    constexpr bool kResidual = decltype(has_residual)::value;
    const T* grad = static_cast<const T*>(p.grad);
    T* residual = static_cast<T*>(p.residual);
    const T* m = kResidual ? residual : grad;
    prepare_and_histogram<T, kResidual><<<blocks_for(n), kThreads, 0, stream>>>(grad, residual, n, hist);
    select_digit<kTopBins><<<1, kSelectThreads, 0, stream>>>(hist, state, 31 - kTopBits);
    for (int shift = 31 - kTopBits - kDigitBits; shift >= 0; shift -= kDigitBits) {
      digit_histogram<<<blocks_for(n), kThreads, 0, stream>>>(m, n, state, shift, hist);
      select_digit<kDigitBins><<<1, kSelectThreads, 0, stream>>>(hist, state, shift);
    }
    const unsigned tile_blocks = blocks_for(w.tiles, 1);
    tile_counts<<<tile_blocks, kThreads, 0, stream>>>(m, n, state, above, equal);
    size_t scan_bytes = w.scan_bytes;
    void* scan_storage = w.at<void>(p.workspace, 6);
    error = cub::DeviceScan::ExclusiveSum(scan_storage, scan_bytes, above, above_before, static_cast<int>(w.tiles),
                                          stream);
    if (error == cudaSuccess)
      error = cub::DeviceScan::ExclusiveSum(scan_storage, scan_bytes, equal, equal_before, static_cast<int>(w.tiles),
                                            stream);
    if (error != cudaSuccess) return;  // the positions would be garbage: write nothing
    const auto write = [&](auto* v) {
      using V = Elem<decltype(v)>;
      write_selected<<<tile_blocks, kThreads, 0, stream>>>(m, residual, n, state, above_before, equal_before, indices,
                                                           reinterpret_cast<V*>(p.payload + layout.values));
    };
    visit_topk_value_type<T>(p.header, write);
  });
  if (error == cudaSuccess && compact) {
    const int64_t spans = ceil_div(n, kCompactSpan);
    pack_compact<<<blocks_for(std::max(k, spans)), kThreads, 0, stream>>>(
        indices, k, spans, reinterpret_cast<uint16_t*>(p.payload + layout.codes),
        reinterpret_cast<uint32_t*>(p.payload + layout.scales));
  }
  return error;
}

void check_topk(const DecodeParams& d, uint32_t* problems, cudaStream_t stream) {
  const PayloadHeader& h = d.expected;
  const int64_t k = h.param0;
  if (k == 0) return;
  const BodyLayout layout = body_layout(h);
  const int64_t stride = layout.total;
  if (h.param1 != kTopkCompact) {
    check_indices<<<blocks_for(d.count * k), kThreads, 0, stream>>>(
        reinterpret_cast<const int32_t*>(d.payloads + layout.codes), d.count, stride / 4, k, h.numel, problems);
    return;
  }
  const TopkDecodeWorkspace w(h, d.count);
  const int64_t spans = ceil_div(h.numel, kCompactSpan);
  auto* offsets = w.at<int64_t>(d.workspace, 2);
  auto* indices = w.at<int32_t>(d.workspace, 1);
  scan_compact_counts<<<blocks_for(d.count, 1), kThreads, 0, stream>>>(d.payloads + layout.scales, d.count, stride,
                                                                       spans, k, offsets, problems);
  expand_compact<<<blocks_for(d.count * k), kThreads, 0, stream>>>(d.payloads, d.count, stride, layout.codes, spans, k,
                                                                  h.numel, offsets, indices);
  check_indices<<<blocks_for(d.count * k), kThreads, 0, stream>>>(indices, d.count, k, k, h.numel, problems);
}

void decode_topk(const DecodeParams& d, cudaStream_t stream) {
  const PayloadHeader& h = d.expected;
  const int64_t n = h.numel, k = h.param0, stride = body_layout(h).total;
  if (n == 0) return;
  const BodyLayout layout = body_layout(h);
  const TopkDecodeWorkspace w(h, d.count);
  const bool compact = h.param1 == kTopkCompact;
  const auto indices = [&](int64_t p) {
    return compact ? w.at<const int32_t>(d.workspace, 1) + p * k
                   : reinterpret_cast<const int32_t*>(d.payloads + p * stride + layout.codes);
  };
  visit_dtype(static_cast<DType>(h.dtype), [&](auto* t) {
    using T = Elem<decltype(t)>;
    T* out = static_cast<T*>(d.out);
    const auto sum = [&](auto* v) {
      using V = Elem<decltype(v)>;
      const auto values = [&](int64_t p) { return reinterpret_cast<const V*>(d.payloads + p * stride + layout.values); };
      if (d.count == 1) {  // each index written once: 0 + alpha * v
        fill<<<blocks_for(n), kThreads, 0, stream>>>(out, n, from_float<T>(0.0f));
        scatter_single<<<blocks_for(k), kThreads, 0, stream>>>(indices(0), values(0), k, n, d.alpha, out);
        return;
      }
      float* sums = std::is_same_v<T, float> ? reinterpret_cast<float*>(out) : w.at<float>(d.workspace, 0);
      fill<<<blocks_for(n), kThreads, 0, stream>>>(sums, n, 0.0f);
      for (int64_t p = 0; p < d.count; ++p)
        scatter_add<<<blocks_for(k), kThreads, 0, stream>>>(indices(p), values(p), k, n, d.alpha, sums);
      if constexpr (!std::is_same_v<T, float>)  // fp32 sums are already in out
        store_sums<<<blocks_for(n), kThreads, 0, stream>>>(sums, n, out);
    };
    visit_topk_value_type<T>(h, sum);
  });
}

}  // namespace gradcomp::cuda
