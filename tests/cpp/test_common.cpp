// The shared codec math: generator, permutation, conversions, layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/half.h"
#include "common/random.h"
#include "common/reduce.h"
#include "common/wire.h"

using namespace gradcomp;

// Known-answer vectors of Philox4x32-10 from Random123 (kat_vectors).
TEST(Philox, KnownAnswers) {
  const Philox4 zero = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(zero.v[0], 0x6627e8d5u);
  EXPECT_EQ(zero.v[1], 0xe169c58du);
  EXPECT_EQ(zero.v[2], 0xbc57ac4cu);
  EXPECT_EQ(zero.v[3], 0x9b00dbd8u);
  const Philox4 ones = philox4x32_10(~0u, ~0u, ~0u, ~0u, ~0u, ~0u);
  EXPECT_EQ(ones.v[0], 0x408f276du);
  EXPECT_EQ(ones.v[1], 0x41c83b0eu);
  EXPECT_EQ(ones.v[2], 0xa20bc7c6u);
  EXPECT_EQ(ones.v[3], 0x6d5451fdu);
  const Philox4 pi = philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(pi.v[0], 0xd16cfe09u);
  EXPECT_EQ(pi.v[1], 0x94fdccebu);
  EXPECT_EQ(pi.v[2], 0x5001e420u);
  EXPECT_EQ(pi.v[3], 0x24126ea1u);
}

TEST(Philox, UniformsCoverTheUnitInterval) {
  const RandomKey key{42, 7, 3, 1};
  double sum = 0.0;
  float lo = 1.0f, hi = 0.0f;
  const int groups = 25000;
  for (int g = 0; g < groups; ++g) {
    const Philox4 block = rounding_block(key, g);
    for (uint32_t word : block.v) {
      const float u = unit_uniform(word);
      ASSERT_GE(u, 0.0f);
      ASSERT_LT(u, 1.0f);
      lo = std::min(lo, u);
      hi = std::max(hi, u);
      sum += u;
    }
  }
  const double mean = sum / (4.0 * groups);
  EXPECT_NEAR(mean, 0.5, 5 * std::sqrt(1.0 / 12 / (4.0 * groups)));  // 5 standard errors
  EXPECT_LT(lo, 1e-3f);
  EXPECT_GT(hi, 1.0f - 1e-3f);
}

TEST(Philox, StreamsDifferByEveryKeyField) {
  const RandomKey base{1, 2, 3, 4};
  const Philox4 a = rounding_block(base, 5);
  for (int field = 0; field < 5; ++field) {
    RandomKey other = base;
    uint64_t group = 5;
    if (field == 0) other.seed = 9;
    if (field == 1) other.step = 9;
    if (field == 2) other.bucket = 9;
    if (field == 3) other.rank = 9;
    if (field == 4) group = 6;
    const Philox4 b = rounding_block(other, group);
    EXPECT_FALSE(std::equal(a.v, a.v + 4, b.v)) << "field " << field;
  }
}

class PermutationTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(PermutationTest, IsABijectionOfTheRange) {
  const uint32_t n = GetParam();
  const IndexPermutation pi(n, RandomKey{123, 4, 5, 0});
  std::vector<char> seen(n, 0);
  for (uint32_t j = 0; j < n; ++j) {
    const uint32_t i = pi(j);
    ASSERT_LT(i, n);
    ASSERT_FALSE(seen[i]) << "index " << i << " chosen twice";
    seen[i] = 1;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, PermutationTest, ::testing::Values(1u, 2u, 3u, 7u, 64u, 1000u, 4097u, 65536u, 100003u));

TEST(Permutation, DependsOnStepNotOnRank) {
  const uint32_t n = 10000;
  const IndexPermutation a(n, RandomKey{7, 1, 0, 0}), b(n, RandomKey{7, 1, 0, 5}), c(n, RandomKey{7, 2, 0, 0});
  int same_as_c = 0;
  for (uint32_t j = 0; j < 100; ++j) {
    EXPECT_EQ(a(j), b(j));
    same_as_c += a(j) == c(j);
  }
  EXPECT_LT(same_as_c, 5);
}

TEST(Permutation, FirstIndicesSpreadOverTheRange) {
  // The first k indices should look like a uniform sample: about k/4 in each quarter.
  const uint32_t n = 1 << 20, k = 4000;
  const IndexPermutation pi(n, RandomKey{99, 0, 0, 0});
  int quarters[4] = {};
  for (uint32_t j = 0; j < k; ++j) ++quarters[pi(j) / (n / 4)];
  for (int q : quarters) EXPECT_NEAR(q, k / 4.0, 5 * std::sqrt(k * 0.25 * 0.75));
}

TEST(Half, RoundTripsEveryFp16Value) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const f16 h{static_cast<uint16_t>(bits)};
    const float f = to_float(h);
    if (std::isnan(f)) {
      EXPECT_TRUE((bits & 0x7C00) == 0x7C00 && (bits & 0x3FF));
      continue;
    }
    EXPECT_EQ(from_float<f16>(f).bits, bits) << std::hex << bits;
  }
}

TEST(Half, RoundsToNearestEven) {
  EXPECT_EQ(from_float<f16>(1.0f).bits, 0x3C00);
  EXPECT_EQ(from_float<f16>(1.0f + 0x1.0p-11f).bits, 0x3C00);                // halfway: even stays
  EXPECT_EQ(from_float<f16>(1.0f + 3 * 0x1.0p-11f).bits, 0x3C02);            // halfway: to even
  EXPECT_EQ(from_float<f16>(65520.0f).bits, 0x7C00);                         // overflows to Inf
  EXPECT_EQ(from_float<f16>(-0.0f).bits, 0x8000);
  EXPECT_EQ(from_float<f16>(std::numeric_limits<float>::quiet_NaN()).bits & 0x7FFF, 0x7E00);
  EXPECT_EQ(from_float<f16>(0x1.0p-24f).bits, 0x0001);                       // smallest subnormal
  EXPECT_EQ(from_float<bf16>(1.0f + 0x1.0p-8f).bits, 0x3F80);                // halfway: even stays
  EXPECT_EQ(from_float<bf16>(1.0f + 3 * 0x1.0p-8f).bits, 0x3F82);
  EXPECT_EQ(from_float<bf16>(std::numeric_limits<float>::quiet_NaN()).bits, 0x7FC0);
  EXPECT_EQ(to_float(bf16{0x3F80}), 1.0f);
}

TEST(Reduce, MatchesTheDocumentedOrder) {
  std::vector<double> x(10000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.1 * i) * (1 + (i % 7)) * (1 + 1e-9 * i);
  double expected = 0.0;
  for (size_t begin = 0; begin < x.size(); begin += kReduceChunk) {
    double lanes[kLanes] = {};
    for (size_t i = begin; i < std::min(x.size(), begin + kReduceChunk); ++i) lanes[(i - begin) % kLanes] += x[i];
    for (int w = 16; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
    expected += lanes[0];
  }
  EXPECT_EQ(canonical_sum(x.size(), [&](int64_t i) { return x[i]; }), expected);
}

// The lanes are doubles: fp32 magnitudes and squares that would overflow fp32 lanes stay finite.
TEST(Reduce, DoubleLanesDoNotOverflow) {
  const float big = 3e38f;
  std::vector<float> m(5000, 1.0f);
  m[0] = big;
  m[32] = -big;  // the same lane as m[0]
  const double abs_sum = canonical_sum(m.size(), [&](int64_t i) { return static_cast<double>(std::fabs(m[i])); });
  EXPECT_TRUE(std::isfinite(abs_sum));
  EXPECT_EQ(static_cast<float>(abs_sum / m.size()), static_cast<float>((6e38 + 4998.0) / 5000.0));
  m[0] = 1e20f;
  m[32] = 1.0f;
  const double squares = canonical_sum(m.size(), [&](int64_t i) {
    const double v = m[i];
    return v * v;
  });
  EXPECT_EQ(squares, static_cast<double>(1e20f) * static_cast<double>(1e20f) + 4999.0);
  EXPECT_EQ(saturated_norm(squares), static_cast<float>(std::sqrt(squares)));
  // 512 elements of FLT_MAX: a norm beyond fp32 saturates; NaN and Inf stay.
  const double fmax = std::numeric_limits<float>::max();
  EXPECT_EQ(saturated_norm(512 * fmax * fmax), std::numeric_limits<float>::max());
  EXPECT_EQ(saturated_norm(fmax * fmax), std::numeric_limits<float>::max());
  EXPECT_TRUE(std::isinf(saturated_norm(std::numeric_limits<double>::infinity())));
  EXPECT_TRUE(std::isnan(saturated_norm(std::numeric_limits<double>::quiet_NaN())));
}

TEST(Saturating, ArithmeticSaturatesFiniteOverflowOnly) {
  const float fmax = std::numeric_limits<float>::max(), inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(add_saturating(3e38f, 3e38f), fmax);
  EXPECT_EQ(add_saturating(-3e38f, -3e38f), -fmax);
  EXPECT_EQ(sub_saturating(3e38f, -3e38f), fmax);
  EXPECT_EQ(sub_saturating(-3e38f, 3e38f), -fmax);
  EXPECT_EQ(mul_saturating(127.0f, 3e38f), fmax);
  EXPECT_EQ(mul_saturating(-2.0f, 3e38f), -fmax);
  EXPECT_EQ(add_saturating(1.5f, 2.25f), 3.75f);
  EXPECT_EQ(sub_saturating(1.5f, 2.25f), -0.75f);
  EXPECT_EQ(mul_saturating(1.5f, 2.0f), 3.0f);
  EXPECT_EQ(add_saturating(inf, 1.0f), inf);  // a real Inf stays
  EXPECT_EQ(add_saturating(1.0f, -inf), -inf);
  EXPECT_EQ(mul_saturating(inf, 2.0f), inf);
  EXPECT_TRUE(std::isnan(add_saturating(inf, -inf)));
  EXPECT_TRUE(std::isnan(add_saturating(nan, 1.0f)));
  EXPECT_TRUE(std::isnan(sub_saturating(1.0f, nan)));
  EXPECT_TRUE(std::isnan(mul_saturating(0.0f, inf)));
}

TEST(Saturating, StoresSaturateFiniteValuesOnly) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(from_float_saturating<f16>(1e5f).bits, 0x7BFFu);  // 65504
  EXPECT_EQ(from_float_saturating<f16>(-1e5f).bits, 0xFBFFu);
  EXPECT_EQ(from_float_saturating<f16>(65519.0f).bits, 0x7BFFu);  // rounds to 65504 anyway
  EXPECT_EQ(from_float_saturating<f16>(65520.0f).bits, 0x7BFFu);  // would round to Inf
  EXPECT_EQ(from_float_saturating<f16>(3e38f).bits, 0x7BFFu);
  EXPECT_EQ(from_float_saturating<f16>(inf).bits, 0x7C00u);
  EXPECT_EQ(from_float_saturating<f16>(-inf).bits, 0xFC00u);
  EXPECT_EQ(from_float_saturating<f16>(nan).bits, from_float<f16>(nan).bits);
  EXPECT_EQ(from_float_saturating<bf16>(std::numeric_limits<float>::max()).bits, 0x7F7Fu);
  EXPECT_EQ(from_float_saturating<bf16>(-std::numeric_limits<float>::max()).bits, 0xFF7Fu);
  EXPECT_EQ(from_float<bf16>(std::numeric_limits<float>::max()).bits, 0x7F80u);  // what plain rounding gives
  EXPECT_EQ(from_float_saturating<bf16>(inf).bits, 0x7F80u);
  EXPECT_EQ(from_float_saturating<bf16>(nan).bits, 0x7FC0u);
  EXPECT_EQ(to_float(bf16{0x7F7F}), 3.3895314e38f);
  EXPECT_EQ(from_float_saturating<float>(std::numeric_limits<float>::max()), std::numeric_limits<float>::max());
  EXPECT_EQ(from_float_saturating<float>(-inf), -inf);
  // Below the overflow threshold the saturating store is the plain one, for every fp16 input.
  for (uint32_t u = 0; u < 0x477FF000u; u += 4099) {  // up to 65520, where fp16 rounding overflows
    const float x = bits_float(u);
    EXPECT_EQ(from_float_saturating<f16>(x).bits, from_float<f16>(x).bits);
    EXPECT_EQ(from_float_saturating<bf16>(-x).bits, from_float<bf16>(-x).bits);
  }
}

TEST(Wire, HeaderIsPackedAndLayoutsAreExact) {
  PayloadHeader h{};
  h.magic = kMagic;
  h.version = kFormatVersion;
  h.numel = 1000;
  auto total = [&](Codec c, DType d, int64_t p0, int64_t p1) {
    h.codec = static_cast<uint8_t>(c);
    h.dtype = static_cast<uint8_t>(d);
    h.param0 = p0;
    h.param1 = p1;
    EXPECT_EQ(header_problem(h), nullptr);
    return body_layout(h).total;
  };
  auto pad = [](int64_t b) { return (b + 15) / 16 * 16; };
  EXPECT_EQ(total(Codec::None, DType::F32, 0, 0), pad(48 + 4000));
  EXPECT_EQ(total(Codec::None, DType::BF16, 0, 0), pad(48 + 2000));
  EXPECT_EQ(total(Codec::Fp16, DType::F32, 0, 0), pad(48 + 2000));
  EXPECT_EQ(total(Codec::SignSGD, DType::F32, 0, 256), pad(48 + 4 * 4 + 125));   // one fp32 scale per block
  EXPECT_EQ(total(Codec::SignSGD, DType::F32, 0, 100), pad(48 + 10 * 4 + 125));
  EXPECT_EQ(total(Codec::SignSGD, DType::BF16, 0, 7), pad(48 + 143 * 4 + 125));  // a last block of 6
  EXPECT_EQ(total(Codec::SignSGD, DType::F32, 0, 1), pad(48 + 1000 * 4 + 125));
  EXPECT_EQ(total(Codec::SignSGD, DType::F32, 0, 1000), pad(48 + 4 + 125));      // one block for the bucket
  EXPECT_EQ(total(Codec::SignSGD, DType::F32, 0, kMaxBlock), pad(48 + 4 + 125));
  EXPECT_EQ(total(Codec::TernGrad, DType::F32, 0, 0), pad(48 + 4 + 250));
  EXPECT_EQ(total(Codec::QSGD, DType::F32, 15, 512), pad(48 + 2 * 4 + 1000 * 5 / 8));
  EXPECT_EQ(total(Codec::QSGD, DType::F32, 16, 100), pad(48 + 10 * 4 + 1000 * 6 / 8));
  EXPECT_EQ(total(Codec::TopK, DType::F16, 10, 0), pad(48 + 10 * 4 + 10 * 2));
  EXPECT_EQ(total(Codec::RandomK, DType::F32, 10, 0), pad(48 + 40));
}

TEST(Wire, CodeBitsCoverTheLevels) {
  EXPECT_EQ(qsgd_code_bits(1), 2);
  EXPECT_EQ(qsgd_code_bits(3), 3);
  EXPECT_EQ(qsgd_code_bits(4), 4);
  EXPECT_EQ(qsgd_code_bits(15), 5);
  EXPECT_EQ(qsgd_code_bits(16), 6);
  EXPECT_EQ(qsgd_code_bits(kMaxLevels), 16);
}

TEST(Wire, RefusesBadHeaders) {
  PayloadHeader good{};
  good.magic = kMagic;
  good.version = kFormatVersion;
  good.codec = static_cast<uint8_t>(Codec::TopK);
  good.numel = 100;
  good.param0 = 10;
  ASSERT_EQ(header_problem(good), nullptr);
  auto with = [&](auto mutate) {
    PayloadHeader h = good;
    mutate(h);
    return header_problem(h);
  };
  EXPECT_NE(with([](PayloadHeader& h) { h.magic = 0; }), nullptr);
  EXPECT_NE(with([](PayloadHeader& h) { h.version = 2; }), nullptr);
  EXPECT_NE(with([](PayloadHeader& h) { h.codec = kNumCodecs; }), nullptr);
  EXPECT_NE(with([](PayloadHeader& h) { h.dtype = kNumDTypes; }), nullptr);
  EXPECT_NE(with([](PayloadHeader& h) { h.numel = -1; }), nullptr);
  EXPECT_NE(with([](PayloadHeader& h) { h.param0 = 0; }), nullptr);
  EXPECT_NE(with([](PayloadHeader& h) { h.param0 = 101; }), nullptr);
  EXPECT_EQ(with([](PayloadHeader& h) { h.param1 = kTopkCompact; }), nullptr);
  EXPECT_NE(with([](PayloadHeader& h) { h.param1 = 2; }), nullptr);  // neither topk layout
  EXPECT_NE(with([](PayloadHeader& h) { h.codec = static_cast<uint8_t>(Codec::QSGD); h.param0 = 0; }), nullptr);
  EXPECT_NE(with([](PayloadHeader& h) { h.codec = static_cast<uint8_t>(Codec::QSGD); h.param0 = 4; h.param1 = 0; }), nullptr);
  EXPECT_NE(with([](PayloadHeader& h) { h.codec = static_cast<uint8_t>(Codec::QSGD); h.param0 = kMaxLevels + 1; h.param1 = 8; }), nullptr);
}
