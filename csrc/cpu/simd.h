// Bulk random words for the CPU codecs: the Philox words of whole 64-element tiles (random.h),
// 16 groups side by side in AVX-512 or AVX2 lanes where the build variant has them. Every path
// computes the same integers as philox4x32_10.
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../common/random.h"

namespace gradcomp {

constexpr int64_t kTile = 64;  // elements per tile; a tile's words come from 16 Philox groups

#if defined(__AVX512F__)

inline __m512i mul_hi_lo(__m512i a, __m512i multiplier, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(a, multiplier);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), multiplier);
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  return _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

// words[64 * t + i] for the elements of tiles first_tile, first_tile + 1 (two tiles: ILP).
inline void tile_words_x2(const RandomKey& key, uint64_t first_tile, uint32_t* words) {
  __m512i c0[2], c1[2], c2[2], c3[2];
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int t = 0; t < 2; ++t) {
    c0[t] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>((first_tile + t) * 16)), lanes);
    c1[t] = _mm512_set1_epi32(static_cast<int>(key.step));
    c2[t] = _mm512_set1_epi32(static_cast<int>(key.bucket));
    c3[t] = _mm512_set1_epi32(static_cast<int>(key.rank));
  }
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m512i key0 = _mm512_set1_epi32(static_cast<int>(k0)), key1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int t = 0; t < 2; ++t) {
      __m512i lo0, lo1;
      const __m512i hi0 = mul_hi_lo(c0[t], m0, &lo0);
      const __m512i hi1 = mul_hi_lo(c2[t], m1, &lo1);
      c0[t] = _mm512_xor_si512(_mm512_xor_si512(hi1, c1[t]), key0);
      c1[t] = lo1;
      c2[t] = _mm512_xor_si512(_mm512_xor_si512(hi0, c3[t]), key1);
      c3[t] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int t = 0; t < 2; ++t) {
    _mm512_storeu_si512(words + 64 * t + 0, c0[t]);
    _mm512_storeu_si512(words + 64 * t + 16, c1[t]);
    _mm512_storeu_si512(words + 64 * t + 32, c2[t]);
    _mm512_storeu_si512(words + 64 * t + 48, c3[t]);
  }
}

#elif defined(__AVX2__)

inline __m256i mul_hi_lo(__m256i a, __m256i multiplier, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, multiplier);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), multiplier);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

inline void tile_words_x2(const RandomKey& key, uint64_t first_tile, uint32_t* words) {
  // Four vectors of 8 groups: tile t, half h holds groups 16 * (first_tile + t) + 8 * h + lane.
  __m256i c0[4], c1[4], c2[4], c3[4];
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int v = 0; v < 4; ++v) {
    const uint64_t group0 = (first_tile + v / 2) * 16 + 8 * (v % 2);
    c0[v] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(group0)), lanes);
    c1[v] = _mm256_set1_epi32(static_cast<int>(key.step));
    c2[v] = _mm256_set1_epi32(static_cast<int>(key.bucket));
    c3[v] = _mm256_set1_epi32(static_cast<int>(key.rank));
  }
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0)), key1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int v = 0; v < 4; ++v) {
      __m256i lo0, lo1;
      const __m256i hi0 = mul_hi_lo(c0[v], m0, &lo0);
      const __m256i hi1 = mul_hi_lo(c2[v], m1, &lo1);
      c0[v] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[v]), key0);
      c1[v] = lo1;
      c2[v] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[v]), key1);
      c3[v] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int v = 0; v < 4; ++v) {
    uint32_t* tile = words + 64 * (v / 2) + 8 * (v % 2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 0), c0[v]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 16), c1[v]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 32), c2[v]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 48), c3[v]);
  }
}

#else

inline void tile_words_x2(const RandomKey& key, uint64_t first_tile, uint32_t* words) {
  for (int t = 0; t < 2; ++t)
    for (int lane = 0; lane < 16; ++lane) {
      const Philox4 block = rounding_block(key, (first_tile + t) * 16 + lane);
      for (int w = 0; w < 4; ++w) words[64 * t + 16 * w + lane] = block.v[w];
    }
}

#endif

// Uniforms in [0, 1) for the 128 elements starting at 128 * pair (two tiles).
inline void tile_uniforms_x2(const RandomKey& key, uint64_t pair, float* uniforms) {
  uint32_t words[2 * kTile];
  tile_words_x2(key, 2 * pair, words);
  for (int i = 0; i < 2 * kTile; ++i) uniforms[i] = unit_uniform(words[i]);
}

}  // namespace gradcomp
