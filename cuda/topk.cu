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
// Five passes over M in all; the workspace is a few counters per 4096 elements.
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

template <typename T>
__global__ void write_selected(const T* m, T* residual, int64_t n, const SelectState* state,
                               const uint32_t* above_before, const uint32_t* equal_before, int32_t* indices,
                               T* values) {
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
        indices[position] = static_cast<int32_t>(i);
        values[position] = m[i];
        if (residual) residual[i] = from_float<T>(0.0f);
      }
      above_run += round_total >> 16;
      equal_run += round_total & 0xFFFFu;
      __syncthreads();
    }
  }
}

// The encode workspace, carved in 256-byte-aligned pieces.
struct TopkWorkspace {
  int64_t tiles;
  size_t scan_bytes;
  size_t offsets[7];  // state, histogram, above, equal, above_before, equal_before, scan storage
  size_t total;

  explicit TopkWorkspace(int64_t n) {
    tiles = std::max<int64_t>(1, ceil_div(n, kTile));
    scan_bytes = 0;
    cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr), static_cast<int>(tiles));
    const size_t sizes[7] = {sizeof(SelectState), sizeof(uint32_t) * kTopBins, 4 * size_t(tiles), 4 * size_t(tiles),
                             4 * size_t(tiles), 4 * size_t(tiles), scan_bytes};
    total = 0;
    for (int j = 0; j < 7; ++j) {
      offsets[j] = total;
      total += (sizes[j] + 255) / 256 * 256;
    }
  }
  template <typename P>
  P* at(void* base, int j) const { return reinterpret_cast<P*>(static_cast<uint8_t*>(base) + offsets[j]); }
};

template <typename T>
__global__ void scatter_single(const int32_t* indices, const T* values, int64_t k, int64_t n, float alpha, T* out) {
  GC_GRID_LOOP(j, k) {
    const int32_t i = indices[j];
    if (i >= 0 && i < n) out[i] = from_float_saturating<T>(0.0f + alpha * to_float(values[j]));
  }
}

// Indices within one payload are distinct (checked: strictly ascending), so one payload's adds do
// not race; payloads go one launch each, in order, as the CPU adds them.
template <typename T>
__global__ void scatter_add(const int32_t* indices, const T* values, int64_t k, int64_t n, float alpha, float* sums) {
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

size_t topk_encode_workspace(const PayloadHeader& h) { return TopkWorkspace(h.numel).total; }

size_t topk_decode_workspace(const PayloadHeader& h, int64_t count) {
  return count > 1 && static_cast<DType>(h.dtype) != DType::F32 ? sizeof(float) * h.numel : 0;
}

// Returns CUB's error, if any: a CUB failure need not set the runtime's last error.
cudaError_t encode_topk(const EncodeParams& p, cudaStream_t stream) {
  const int64_t n = p.header.numel, k = p.header.param0;
  if (n == 0) return cudaSuccess;
  const TopkWorkspace w(n);
  auto* state = w.at<SelectState>(p.workspace, 0);
  auto* hist = w.at<uint32_t>(p.workspace, 1);
  auto* above = w.at<uint32_t>(p.workspace, 2);
  auto* equal = w.at<uint32_t>(p.workspace, 3);
  auto* above_before = w.at<uint32_t>(p.workspace, 4);
  auto* equal_before = w.at<uint32_t>(p.workspace, 5);
  const BodyLayout layout = body_layout(p.header);
  int32_t* indices = reinterpret_cast<int32_t*>(p.payload + layout.codes);
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
    write_selected<<<tile_blocks, kThreads, 0, stream>>>(m, residual, n, state, above_before, equal_before, indices,
                                                         reinterpret_cast<T*>(p.payload + layout.values));
  });
  return error;
}


void decode_topk(const DecodeParams& d, cudaStream_t stream) {
  const PayloadHeader& h = d.expected;
  const int64_t n = h.numel, k = h.param0, stride = body_layout(h).total;
  if (n == 0) return;
  const BodyLayout layout = body_layout(h);
  visit_dtype(static_cast<DType>(h.dtype), [&](auto* t) {
    using T = Elem<decltype(t)>;
    T* out = static_cast<T*>(d.out);
    const auto indices = [&](int64_t p) { return reinterpret_cast<const int32_t*>(d.payloads + p * stride + layout.codes); };
    const auto values = [&](int64_t p) { return reinterpret_cast<const T*>(d.payloads + p * stride + layout.values); };
    if (d.count == 1) {  // each index written once: 0 + alpha * v
      fill<<<blocks_for(n), kThreads, 0, stream>>>(out, n, from_float<T>(0.0f));
      scatter_single<<<blocks_for(k), kThreads, 0, stream>>>(indices(0), values(0), k, n, d.alpha, out);
      return;
    }
    float* sums = std::is_same_v<T, float> ? reinterpret_cast<float*>(out) : static_cast<float*>(d.workspace);
    fill<<<blocks_for(n), kThreads, 0, stream>>>(sums, n, 0.0f);
    for (int64_t p = 0; p < d.count; ++p)
      scatter_add<<<blocks_for(k), kThreads, 0, stream>>>(indices(p), values(p), k, n, d.alpha, sums);
    if constexpr (!std::is_same_v<T, float>)  // fp32 sums are already in out
      store_sums<<<blocks_for(n), kThreads, 0, stream>>>(sums, n, out);
  });
}

}  // namespace gradcomp::cuda
