// The one summation order that every device uses for codec scales, so CPU and CUDA agree bit
// for bit: 32 double-precision lanes, lane j accumulating value(j), value(j + 32), ... in index
// order from +0, then a halving tree (lane i += lane i + 16, then + 8, + 4, + 2, + 1), which is
// what a warp's shuffle-down reduction computes. Long inputs are cut into chunks of kReduceChunk
// elements whose lane sums are then added in chunk order, from +0, in double precision.
// The values are doubles: signsgd sums |m| widened to double, qsgd sums (double)m * (double)m
// (exact: 48 significant bits). Neither can overflow for finite fp32 m (at most 2^34 elements of
// at most FLT_MAX^2 = 1.2e77 each), so a non-finite total means a NaN or Inf among the values.
#pragma once

#include <cmath>

#include "hd.h"

namespace gradcomp {

constexpr int kLanes = 32;
constexpr int64_t kReduceChunk = 4096;

GC_HD double lane_tree_sum(double* lanes) {
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] = lanes[i] + lanes[i + width];
  return lanes[0];
}

// The lane sum of value(i) for i in [begin, end), one chunk (at most kReduceChunk elements).
template <typename Value>
GC_HD double chunk_lane_sum(int64_t begin, int64_t end, Value&& value) {
  double lanes[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes)
    for (int lane = 0; lane < kLanes; ++lane) lanes[lane] += static_cast<double>(value(i + lane));
  for (int lane = 0; i < end; ++i, ++lane) lanes[lane] += static_cast<double>(value(i));
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

// qsgd's block norm from the canonical sum of squares: the correctly rounded double square root,
// rounded to fp32; a finite root beyond FLT_MAX (a block of many elements near FLT_MAX) saturates
// to FLT_MAX. NaN and Inf stay non-finite.
GC_HD float saturated_norm(double sum_of_squares) {
  const double root = sqrt(sum_of_squares);
  const double max_finite = static_cast<double>(bits_float(kMaxFiniteBits));
  const double infinity = static_cast<double>(bits_float(0x7F800000u));
  return root > max_finite && root < infinity ? bits_float(kMaxFiniteBits) : static_cast<float>(root);
}

}  // namespace gradcomp
