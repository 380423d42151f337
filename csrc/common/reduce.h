// The one summation order that every device uses for codec scales, so CPU and CUDA agree bit
// for bit: 32 fp32 lanes, lane j accumulating elements j, j + 32, ... in index order, then a
// halving tree (lane i += lane i + 16, then + 8, + 4, + 2, + 1), which is what a warp's
// shuffle-down reduction computes. Long inputs are cut into chunks of kReduceChunk elements whose
// lane sums are then added in chunk order in double precision.
#pragma once

#include "hd.h"

namespace gradcomp {

constexpr int kLanes = 32;
constexpr int64_t kReduceChunk = 4096;

GC_HD float lane_tree_sum(float* lanes) {
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] = lanes[i] + lanes[i + width];
  return lanes[0];
}

// The lane sum of value(i) for i in [begin, end), one chunk (at most kReduceChunk elements).
template <typename Value>
GC_HD float chunk_lane_sum(int64_t begin, int64_t end, Value&& value) {
  float lanes[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes)
    for (int lane = 0; lane < kLanes; ++lane) lanes[lane] += value(i + lane);
  for (int lane = 0; i < end; ++i, ++lane) lanes[lane] += value(i);
  return lane_tree_sum(lanes);
}

// Sum of value(i) for i in [0, len) in the canonical order above.
template <typename Value>
GC_HD double canonical_sum(int64_t len, Value&& value) {
  double total = 0.0;
  for (int64_t begin = 0; begin < len; begin += kReduceChunk)
    total += chunk_lane_sum(begin, begin + kReduceChunk < len ? begin + kReduceChunk : len, value);
  return total;
}

}  // namespace gradcomp
