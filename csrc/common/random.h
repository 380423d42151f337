// Counter-based randomness shared by the CPU and CUDA codecs.
//
// Every random number is a pure function of (seed, step, bucket, rank, element index), so the
// result does not depend on thread count, chunking or device:
//   * stochastic rounding: Philox4x32-10 (Salmon et al., SC'11) with
//       key     = (seed & 0xFFFFFFFF, seed >> 32)
//       counter = (group, step, bucket, rank)
//     Elements go in tiles of 64: element e takes 32-bit word w = (e >> 4) & 3 of the block of
//     group = (e >> 6) * 16 + (e & 15), as u = (word >> 8) * 2^-24 in [0, 1). So the 16 groups of a
//     tile give its elements 16 at a time, in order, one word each: SIMD lanes and GPU threads
//     need no transposition.
//   * random-k indices: a keyed pseudo-random permutation pi of [0, n), the same on every rank:
//     a 4-round balanced Feistel network on 2h bits (h the smallest integer >= 1 with
//     2^(2h) >= n) with cycle walking.
//     Round keys are the four words of Philox(counter = (0, step, bucket, 0xFFFFFFFF), key);
//     round i maps (L, R) -> (R, L ^ (mix32(R ^ key_i) & (2^h - 1))), x = (L << h) | R.
//     The chosen indices are pi(0), pi(1), ..., pi(k - 1), in that order.
#pragma once

#include "hd.h"

namespace gradcomp {

struct RandomKey {
  uint64_t seed = 0;
  uint32_t step = 0;
  uint32_t bucket = 0;
  uint32_t rank = 0;
};

constexpr uint32_t kSharedStream = 0xFFFFFFFFu;  // the "rank" of streams every rank shares

struct Philox4 {
  uint32_t v[4];
};

GC_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                            uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The Philox block of a group; see the file comment for which elements it serves.
GC_HD Philox4 rounding_block(const RandomKey& key, uint64_t group) {
  return philox4x32_10(static_cast<uint32_t>(group), key.step, key.bucket, key.rank,
                       static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32));
}

// The random word of element e (one Philox evaluation; bulk code shares blocks instead).
GC_HD uint32_t rounding_word(const RandomKey& key, uint64_t e) {
  return rounding_block(key, (e >> 6) * 16 + (e & 15)).v[(e >> 4) & 3];
}

GC_HD float unit_uniform(uint32_t word) { return static_cast<float>(word >> 8) * 0x1.0p-24f; }

GC_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// pi: a bijection of [0, n) keyed by (seed, step, bucket); see the file comment.
struct IndexPermutation {
  uint32_t n = 0;
  uint32_t half_bits = 1;
  uint32_t round_keys[4] = {0, 0, 0, 0};

  GC_HD IndexPermutation(uint32_t n_, const RandomKey& key) : n(n_) {
    uint32_t bits = 1;
    while (bits < 32 && (uint64_t{1} << bits) < n_) ++bits;
    half_bits = (bits + 1) / 2;
    const Philox4 k = philox4x32_10(0, key.step, key.bucket, kSharedStream,
                                    static_cast<uint32_t>(key.seed),
                                    static_cast<uint32_t>(key.seed >> 32));
    for (int i = 0; i < 4; ++i) round_keys[i] = k.v[i];
  }

  GC_HD uint32_t feistel(uint32_t x) const {
    const uint32_t mask = (1u << half_bits) - 1u;
    uint32_t left = x >> half_bits, right = x & mask;
    for (int i = 0; i < 4; ++i) {
      const uint32_t next = left ^ (mix32(right ^ round_keys[i]) & mask);
      left = right;
      right = next;
    }
    return (left << half_bits) | right;
  }

  // j must be < n; the walk ends because j's cycle under feistel passes through [0, n) again.
  GC_HD uint32_t operator()(uint32_t j) const {
    uint32_t x = feistel(j);
    while (x >= n) x = feistel(x);
    return x;
  }
};

}  // namespace gradcomp
