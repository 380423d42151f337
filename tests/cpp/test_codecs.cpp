// The CPU codecs on raw pointers: error feedback, selection, decode-and-sum, validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cpu/kernels.h"

using namespace gradcomp;

namespace {

struct CodecCase {
  Codec codec;
  int64_t param0;  // k or levels (k given as a count here)
  int64_t param1;
};

void PrintTo(const CodecCase& c, std::ostream* os) {
  *os << kCodecNames[static_cast<int>(c.codec)] << "(" << c.param0 << ", " << c.param1 << ")";
}

std::vector<float> gaussian(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng);
  return x;
}

std::vector<uint8_t> encode(const CodecCase& c, const std::vector<float>& grad, std::vector<float>* residual,
                            uint32_t step = 0, uint32_t rank = 0) {
  EncodeArgs args;
  args.header = make_header(c.codec, DType::F32, grad.size(), c.param0, c.param1, RandomKey{11, step, 2, 0});
  args.rank = rank;
  args.grad = grad.data();
  args.residual = residual ? residual->data() : nullptr;
  std::vector<uint8_t> payload(body_layout(args.header).total, 0xAB);
  args.payload = payload.data();
  encode_cpu(args);
  return payload;
}

std::vector<float> decode(const std::vector<uint8_t>& payloads, int64_t count, int64_t numel, float alpha = 1.0f,
                          bool vote = false) {
  const int64_t stride = payloads.size() / count;
  EXPECT_EQ(validate_payloads(payloads.data(), count, stride, numel, DType::F32), "");
  std::vector<float> out(numel, -7.0f);
  DecodeArgs args;
  args.payloads = payloads.data();
  args.count = count;
  args.stride = stride;
  args.out = out.data();
  args.alpha = alpha;
  args.vote = vote;
  decode_sum_cpu(args);
  return out;
}

class EveryCodec : public ::testing::TestWithParam<CodecCase> {};

TEST_P(EveryCodec, ErrorFeedbackKeepsWhatWasNotSent) {
  const int64_t n = 3001;
  const auto grad = gaussian(n, 1);
  auto old_residual = gaussian(n, 2);
  for (auto& r : old_residual) r *= 0.1f;
  auto residual = old_residual;
  const auto payload = encode(GetParam(), grad, &residual);
  const auto decoded = decode(payload, 1, n);
  for (int64_t i = 0; i < n; ++i) {
    const float m = grad[i] + old_residual[i];
    ASSERT_NEAR(decoded[i] + residual[i], m, 1e-5f * (1 + std::fabs(m))) << "element " << i;
  }
}

TEST_P(EveryCodec, DecodeSumsPayloadsInOrderThenScales) {
  const int64_t n = 2500;
  std::vector<uint8_t> stacked;
  std::vector<std::vector<float>> singles;
  for (uint32_t rank = 0; rank < 3; ++rank) {
    const auto payload = encode(GetParam(), gaussian(n, 10 + rank), nullptr, 5, rank);
    stacked.insert(stacked.end(), payload.begin(), payload.end());
    singles.push_back(decode(payload, 1, n));
  }
  const auto summed = decode(stacked, 3, n, 0.25f);
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0.0f;
    for (const auto& s : singles) acc += s[i];
    ASSERT_EQ(summed[i], acc * 0.25f) << "element " << i;
  }
}

TEST_P(EveryCodec, EmptyAndSingleElementTensors) {
  for (int64_t n : {0, 1}) {
    CodecCase c = GetParam();
    if (c.codec == Codec::TopK || c.codec == Codec::RandomK) c.param0 = n;
    std::vector<float> grad(n, -2.5f), residual(n, 0.5f);
    const auto payload = encode(c, grad, &residual);
    const auto decoded = decode(payload, 1, n);
    for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(decoded[i] + residual[i], -2.0f, 1e-6f);
  }
}

TEST_P(EveryCodec, RefusesEveryTruncationAndHeaderCorruption) {
  const int64_t n = 777;
  const auto payload = encode(GetParam(), gaussian(n, 3), nullptr);
  for (int64_t cut = 0; cut < static_cast<int64_t>(payload.size()); cut += 1 + cut / 4)
    EXPECT_NE(validate_payloads(payload.data(), 1, cut, n, DType::F32), "") << "accepted " << cut << " bytes";
  for (int byte = 0; byte < 16; ++byte) {  // magic, version, codec, dtype, reserved
    auto bad = payload;
    bad[byte] ^= 0x5A;
    if (byte == 6) bad[byte] = 7;  // dtype id out of range
    EXPECT_NE(validate_payloads(bad.data(), 1, bad.size(), n, DType::F32), "") << "accepted a corrupted byte " << byte;
  }
}

TEST_P(EveryCodec, RandomBytesAfterAValidHeaderNeverEscapeTheOutput) {
  // Whatever the body holds, a validated payload decodes inside out's bounds (ASan builds check).
  const int64_t n = 1000;
  auto payload = encode(GetParam(), gaussian(n, 4), nullptr);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    for (size_t i = kHeaderBytes; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(rng());
    if (validate_payloads(payload.data(), 1, payload.size(), n, DType::F32) != "") continue;
    std::vector<float> guarded(n + 64, 123.0f);
    DecodeArgs args;
    args.payloads = payload.data();
    args.count = 1;
    args.stride = payload.size();
    args.out = guarded.data() + 32;
    decode_sum_cpu(args);
    for (int i = 0; i < 32; ++i) {
      ASSERT_EQ(guarded[i], 123.0f);
      ASSERT_EQ(guarded[n + 32 + i], 123.0f);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, EveryCodec,
                         ::testing::Values(CodecCase{Codec::None, 0, 0}, CodecCase{Codec::Fp16, 0, 0},
                                           CodecCase{Codec::Bf16, 0, 0}, CodecCase{Codec::SignSGD, 0, 256},
                                           CodecCase{Codec::SignSGD, 0, 100}, CodecCase{Codec::SignSGD, 0, 7},
                                           CodecCase{Codec::SignSGD, 0, 1},
                                           CodecCase{Codec::SignSGD, 0, kMaxBlock},  // one block, larger than n
                                           CodecCase{Codec::TernGrad, 0, 0}, CodecCase{Codec::QSGD, 15, 100},
                                           CodecCase{Codec::QSGD, 1, 7}, CodecCase{Codec::QSGD, 32767, 4096},
                                           CodecCase{Codec::TopK, 17, 0}, CodecCase{Codec::TopK, 17, kTopkCompact},
                                           CodecCase{Codec::RandomK, 17, 0}),
                         [](const auto& info) {
                           return std::string(kCodecNames[static_cast<int>(info.param.codec)]) + "_" +
                                  std::to_string(info.index);
                         });

// The k indices a stable sort by decreasing magnitude puts first, in ascending order.
std::vector<int32_t> expected_topk(const std::vector<float>& grad, int64_t k) {
  std::vector<int64_t> order(grad.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return std::fabs(grad[a]) > std::fabs(grad[b]); });
  std::vector<int32_t> expected(order.begin(), order.begin() + k);
  std::sort(expected.begin(), expected.end());
  return expected;
}

void expect_topk(const std::vector<float>& grad, int64_t k) {
  std::vector<float> residual(grad.size(), 0.0f);
  const auto payload = encode({Codec::TopK, k, 0}, grad, &residual);
  const auto expected = expected_topk(grad, k);
  const int32_t* indices = reinterpret_cast<const int32_t*>(payload.data() + kHeaderBytes);
  ASSERT_TRUE(std::equal(expected.begin(), expected.end(), indices)) << "n=" << grad.size() << " k=" << k;
  for (int32_t i : expected) ASSERT_EQ(residual[i], 0.0f);
}

TEST(TopK, SelectsTheLargestMagnitudesWithLowerIndexOnTies) {
  std::mt19937 rng(8);
  std::vector<float> grad(5000);
  for (auto& v : grad) v = static_cast<float>(static_cast<int>(rng() % 41) - 20);  // many ties
  for (int64_t k : {1, 7, 100, 2500, 5000}) expect_topk(grad, k);
}

TEST(TopK, LargeTensorsTakeTheSampledPath) {
  // Above 2^16 elements the threshold bin is estimated from a sample: 256 runs of 256 keys.
  const int64_t n = 300007;
  auto grad = gaussian(n, 21);
  for (int64_t k : {int64_t{1}, int64_t{300}, int64_t{3001}, int64_t{60000}, n}) expect_topk(grad, k);
  std::mt19937 rng(3);
  for (auto& v : grad) v = static_cast<float>(static_cast<int>(rng() % 9) - 4);  // ties across bins
  for (int64_t k : {5, 30000}) expect_topk(grad, k);
}

TEST(TopK, ASampleThatAimsTooHighFallsBackToTheExactBin) {
  // Large values exactly where the sample looks, small ones elsewhere: the sample promises far
  // more large elements than exist, so fewer than k are gathered and the exact pass must run.
  const int64_t n = 1 << 20, run_spacing = n / 256;  // the sample reads [r * spacing, r * spacing + 256)
  std::vector<float> grad(n);
  for (int64_t i = 0; i < n; ++i) grad[i] = (i % run_spacing < 256) ? 100.0f + (i % 7) : 0.001f * (i % 13);
  for (int64_t k : {70000, 200000}) expect_topk(grad, k);
}

TEST(TopK, MostlyZeroInputsTakeTheExactBin) {
  // A few nonzeros spread over many zeros (a sparse gradient; the two-phase owner's sum of top-k
  // payloads): for the larger k the sample finds too few keys above the lowest bin, and the exact
  // pass selects. With fewer nonzeros than k, the first zeros in index order make up the rest.
  const int64_t n = 1 << 20, nonzeros = 9000;
  std::vector<float> grad(n, 0.0f);
  std::mt19937 rng(5);
  for (int64_t j = 0; j < nonzeros; ++j) grad[rng() % n] = static_cast<float>(static_cast<int>(rng() % 2001) - 1000);
  for (int64_t k : {int64_t{1}, int64_t{6000}, int64_t{8900}, int64_t{12000}}) expect_topk(grad, k);
}

TEST(TopK, NanRanksAboveInfinity) {
  std::vector<float> grad = {1.0f, -INFINITY, 3.0f, NAN, -2.0f};
  const auto payload = encode({Codec::TopK, 2, 0}, grad, nullptr);
  const int32_t* indices = reinterpret_cast<const int32_t*>(payload.data() + kHeaderBytes);
  EXPECT_EQ(indices[0], 1);
  EXPECT_EQ(indices[1], 3);
}

TEST(TopK, RefusesOutOfRangeIndices) {
  const int64_t n = 100;
  auto payload = encode({Codec::TopK, 5, 0}, gaussian(n, 6), nullptr);
  int32_t* indices = reinterpret_cast<int32_t*>(payload.data() + kHeaderBytes);
  for (int32_t bad : {-1, 100, 1 << 30}) {
    const int32_t saved = indices[2];
    indices[2] = bad;
    EXPECT_NE(validate_payloads(payload.data(), 1, payload.size(), n, DType::F32), "") << bad;
    indices[2] = saved;
  }
  EXPECT_EQ(validate_payloads(payload.data(), 1, payload.size(), n, DType::F32), "");
}

// A compact payload read by hand: the counts per span, each index's low 16 bits, bf16 values.
struct CompactBody {
  std::vector<int64_t> indices;
  std::vector<float> values;
};

CompactBody read_compact(const std::vector<uint8_t>& payload, int64_t n, int64_t k) {
  const int64_t spans = (n + 65535) / 65536;
  const uint8_t* counts = payload.data() + kHeaderBytes;
  const uint8_t* lows = counts + 4 * spans;
  const uint8_t* values = lows + 2 * k;
  CompactBody body;
  int64_t j = 0;
  for (int64_t span = 0; span < spans; ++span) {
    uint32_t count;
    std::memcpy(&count, counts + 4 * span, 4);
    for (uint32_t c = 0; c < count; ++c, ++j) {
      uint16_t low, value;
      std::memcpy(&low, lows + 2 * j, 2);
      std::memcpy(&value, values + 2 * j, 2);
      body.indices.push_back(span * 65536 + low);
      const uint32_t bits = static_cast<uint32_t>(value) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      body.values.push_back(f);
    }
  }
  return body;
}

TEST(TopK, CompactSendsTheSameElementsAsBf16InHalfTheBytes) {
  // Four spans of 65536 and a partial one; the third span holds nothing large, so its count is 0.
  const int64_t n = 4 * 65536 + 999, k = 3000;
  auto grad = gaussian(n, 31);
  for (int64_t i = 2 * 65536; i < 3 * 65536; ++i) grad[i] *= 1e-3f;
  auto old_residual = gaussian(n, 32);
  for (auto& r : old_residual) r *= 0.1f;
  auto wide_residual = old_residual, compact_residual = old_residual;
  const auto wide = encode({Codec::TopK, k, kTopkWide}, grad, &wide_residual);
  const auto compact = encode({Codec::TopK, k, kTopkCompact}, grad, &compact_residual);
  const int64_t end = kHeaderBytes + 4 * 5 + 4 * k;
  EXPECT_EQ(static_cast<int64_t>(compact.size()), (end + 15) / 16 * 16);
  EXPECT_EQ(static_cast<int64_t>(wide.size()), kHeaderBytes + 8 * k);

  const CompactBody body = read_compact(compact, n, k);
  ASSERT_EQ(static_cast<int64_t>(body.indices.size()), k);
  const int32_t* wide_indices = reinterpret_cast<const int32_t*>(wide.data() + kHeaderBytes);
  const float* wide_values = reinterpret_cast<const float*>(wide.data() + kHeaderBytes + 4 * k);
  const auto decoded = decode(compact, 1, n);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = wide_indices[j];
    ASSERT_EQ(body.indices[j], i) << "position " << j;
    ASSERT_NE(i / 65536, 2);  // the quiet span sends nothing
    const float m = grad[i] + old_residual[i];
    ASSERT_EQ(wide_values[j], m);
    // bf16 by round to nearest even: within half a unit of its 8-bit mantissa, the loss kept exactly
    ASSERT_LE(std::fabs(body.values[j] - m), std::ldexp(std::fabs(m), -8)) << "position " << j;
    ASSERT_EQ(compact_residual[i], m - body.values[j]);
    ASSERT_EQ(decoded[i], body.values[j]);
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(decoded[i] + compact_residual[i], grad[i] + old_residual[i]) << i;
}

TEST(TopK, CompactRefusesCountsAndIndicesThatDoNotFit) {
  const int64_t n = 2 * 65536 + 100, k = 40;
  auto grad = gaussian(n, 33);
  grad[n - 1] = 100.0f;  // the last index lies in the last, partial span
  const auto good = encode({Codec::TopK, k, kTopkCompact}, grad, nullptr);
  ASSERT_EQ(validate_payloads(good.data(), 1, good.size(), n, DType::F32), "");
  const auto with_count = [&](int span, uint32_t count) {
    auto bad = good;
    std::memcpy(bad.data() + kHeaderBytes + 4 * span, &count, 4);
    return validate_payloads(bad.data(), 1, bad.size(), n, DType::F32);
  };
  uint32_t first;
  std::memcpy(&first, good.data() + kHeaderBytes, 4);
  EXPECT_NE(with_count(0, first + 1), "");  // counts add up to more than k
  EXPECT_NE(with_count(0, first - 1), "");  // to fewer
  EXPECT_NE(with_count(2, 0xFFFFFFFFu), "");
  const auto with_low = [&](int64_t j, uint16_t low) {
    auto bad = good;
    std::memcpy(bad.data() + kHeaderBytes + 4 * 3 + 2 * j, &low, 2);
    return validate_payloads(bad.data(), 1, bad.size(), n, DType::F32);
  };
  EXPECT_EQ(with_low(k - 1, 99), "");
  EXPECT_NE(with_low(k - 1, 100), "");  // past n in the last, partial span
  uint16_t second;
  std::memcpy(&second, good.data() + kHeaderBytes + 4 * 3 + 2, 2);
  EXPECT_NE(with_low(0, second), "");  // a repeat: not strictly ascending
}

TEST(Validate, RefusesPayloadsThatDisagree) {
  const int64_t n = 300;
  const auto a = encode({Codec::SignSGD, 0, 256}, gaussian(n, 1), nullptr, 1);
  const auto b = encode({Codec::SignSGD, 0, 256}, gaussian(n, 2), nullptr, 2);  // another step
  std::vector<uint8_t> stacked(a);
  stacked.insert(stacked.end(), b.begin(), b.end());
  EXPECT_NE(validate_payloads(stacked.data(), 2, a.size(), n, DType::F32), "");
}

TEST(SignSGD, MajorityVote) {
  // Three ranks: votes +,+,- -> +; scales 1, 2, 3; alpha 1/3 applied to each scale gives about 2.
  std::vector<uint8_t> stacked;
  const float rows[3][4] = {{1, 1, -1, 1}, {2, -2, -2, 2}, {-3, 3, -3, 3}};
  for (const auto& row : rows) {
    const auto p = encode({Codec::SignSGD, 0, 256}, std::vector<float>(row, row + 4), nullptr);
    stacked.insert(stacked.end(), p.begin(), p.end());
  }
  const auto out = decode(stacked, 3, 4, 1.0f / 3, true);
  const float alpha = 1.0f / 3;
  const float magnitude = ((0.0f + alpha * 1.0f) + alpha * 2.0f) + alpha * 3.0f;  // alpha first, in payload order
  EXPECT_EQ(out[0], magnitude);
  EXPECT_EQ(out[1], magnitude);
  EXPECT_EQ(out[2], -magnitude);
  EXPECT_EQ(out[3], magnitude);
}

TEST(SignSGD, NormScaleIsTheRootMeanSquareAndKeepsTheRest) {
  const int64_t n = 1000;
  const auto grad = gaussian(n, 21);
  const std::vector<float> old = gaussian(n, 22);
  // One block for the bucket (block n and beyond), blocks with a short last one, tiny blocks.
  for (const int64_t block : {n, kMaxBlock, int64_t{300}, int64_t{100}, int64_t{7}}) {
    SCOPED_TRACE("block " + std::to_string(block));
    std::vector<float> residual = old;
    EncodeArgs args;
    args.header = make_header(Codec::SignSGD, DType::F32, n, 0, block, RandomKey{});
    args.grad = grad.data();
    args.residual = residual.data();
    args.norm_scale = true;
    std::vector<uint8_t> payload(body_layout(args.header).total);
    args.payload = payload.data();
    encode_cpu(args);
    // The reference: m = grad + old, sqrt(mean m^2) over each block in long double.
    std::vector<float> expected;
    for (int64_t begin = 0; begin < n; begin += block) {
      const int64_t end = std::min(n, begin + block);
      long double squares = 0;
      for (int64_t i = begin; i < end; ++i) squares += static_cast<long double>(grad[i] + old[i]) * (grad[i] + old[i]);
      expected.push_back(static_cast<float>(std::sqrt(static_cast<double>(squares / (end - begin)))));
    }
    ASSERT_EQ(static_cast<int64_t>(expected.size()), (n + block - 1) / block);
    for (size_t b = 0; b < expected.size(); ++b) {
      float scale;
      std::memcpy(&scale, payload.data() + kHeaderBytes + 4 * b, sizeof scale);
      EXPECT_EQ(scale, expected[b]) << "block index " << b;
    }
    const auto decoded = decode(payload, 1, n);
    for (int64_t i = 0; i < n; ++i) {
      const float m = grad[i] + old[i];
      ASSERT_EQ(decoded[i], m < 0 ? -expected[i / block] : expected[i / block]) << i;
      ASSERT_EQ(residual[i], m - decoded[i]) << i;
    }
  }
}

// Values on a grid of 2^-10, below 2^7 in magnitude, a tenth of them zeros: any sum of a few
// thousand of their magnitudes (and grad + residual of two of them) is exact, in whatever order, so
// the reference means below need not follow the codec's summation order to be bit-exact.
std::vector<float> dyadic(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> x(n);
  for (auto& v : x) {
    const int steps = static_cast<int>(rng() % (1 << 18)) - (1 << 17);
    v = rng() % 10 == 0 ? 0.0f : std::ldexp(static_cast<float>(steps), -10);
  }
  return x;
}

// The reference scales: per block of `block` elements (the last one what is left), the mean |m| in
// double, rounded to fp32, by a plain loop.
std::vector<float> mean_magnitudes(const std::vector<float>& m, int64_t block) {
  std::vector<float> means;
  const int64_t n = m.size();
  for (int64_t begin = 0; begin < n; begin += block) {
    const int64_t end = std::min(n, begin + block);
    double total = 0;
    for (int64_t i = begin; i < end; ++i) total += std::fabs(static_cast<double>(m[i]));
    means.push_back(static_cast<float>(total / static_cast<double>(end - begin)));
  }
  return means;
}

// A signsgd payload's fp32 scales, read from the bytes after the header.
std::vector<float> scales_of(const std::vector<uint8_t>& payload, int64_t blocks) {
  std::vector<float> scales(blocks);
  std::memcpy(scales.data(), payload.data() + kHeaderBytes, blocks * sizeof(float));
  return scales;
}

int64_t padded(int64_t bytes) { return (bytes + 15) / 16 * 16; }

TEST(SignSGD, EachBlockScaleIsTheMeanMagnitudeOfItsBlock) {
  // 100 and 300 are not multiples of 8 (300 leaves a last block of 100), nor is 7 (a last block
  // of 6); 128 is; 1 makes every element its own scale. 997 elements end inside a sign byte.
  for (const int64_t block : {100, 300, 7, 128, 1}) {
    for (const int64_t n : {1000, 997}) {
      SCOPED_TRACE("block " + std::to_string(block) + ", n " + std::to_string(n));
      const auto grad = dyadic(n, 31), old = dyadic(n, 32);
      std::vector<float> m(n);
      for (int64_t i = 0; i < n; ++i) m[i] = grad[i] + old[i];  // exact on the grid
      const int64_t blocks = (n + block - 1) / block;
      auto residual = old;
      const auto payload = encode({Codec::SignSGD, 0, block}, grad, &residual);
      ASSERT_EQ(static_cast<int64_t>(payload.size()), padded(kHeaderBytes + 4 * blocks + (n + 7) / 8));
      const auto expected = mean_magnitudes(m, block);
      ASSERT_EQ(static_cast<int64_t>(expected.size()), blocks);
      const auto scales = scales_of(payload, blocks);
      for (int64_t b = 0; b < blocks; ++b) EXPECT_EQ(scales[b], expected[b]) << "block index " << b;
      const uint8_t* signs = payload.data() + kHeaderBytes + 4 * blocks;
      const auto decoded = decode(payload, 1, n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ((signs[i / 8] >> (i % 8)) & 1, m[i] < 0 ? 0 : 1) << i;
        const float want = m[i] < 0 ? -expected[i / block] : expected[i / block];
        ASSERT_EQ(decoded[i], want) << i;
        ASSERT_EQ(residual[i], m[i] - want) << i;
        if (block == 1) ASSERT_EQ(decoded[i], m[i]) << i;  // |m| is its own mean
      }
      for (int64_t i = n; i % 8 != 0; ++i) ASSERT_EQ((signs[i / 8] >> (i % 8)) & 1, 0) << "bit past n: " << i;
    }
  }
  const int64_t n = 1000;
  {
    // The short last block by hand: block 300 over 1000 elements, its last scale the mean of 100.
    const auto m = dyadic(n, 35);
    const auto payload = encode({Codec::SignSGD, 0, 300}, m, nullptr);
    double last = 0;
    for (int64_t i = 900; i < 1000; ++i) last += std::fabs(static_cast<double>(m[i]));
    EXPECT_EQ(scales_of(payload, 4)[3], static_cast<float>(last / 100));
    EXPECT_NE(scales_of(payload, 4)[3], static_cast<float>(last / 300));
  }
  // Gaussian values, against a long double reference.
  const auto g = gaussian(n, 33);
  for (const int64_t block : {100, 300}) {
    const auto payload = encode({Codec::SignSGD, 0, block}, g, nullptr);
    const auto scales = scales_of(payload, (n + block - 1) / block);
    for (int64_t begin = 0, b = 0; begin < n; begin += block, ++b) {
      const int64_t end = std::min(n, begin + block);
      long double total = 0;
      for (int64_t i = begin; i < end; ++i) total += std::fabs(static_cast<long double>(g[i]));
      EXPECT_EQ(scales[b], static_cast<float>(static_cast<double>(total / (end - begin)))) << block << " " << b;
    }
  }
}

TEST(SignSGD, DecodeSumAddsAlphaTimesEachPayloadsBlockScale) {
  const int64_t n = 1000;
  const float alpha = 0.3f;
  const std::vector<std::vector<float>> grads = {dyadic(n, 41), dyadic(n, 42)};
  for (const int64_t block : {100, 300, 7, 256}) {
    SCOPED_TRACE("block " + std::to_string(block));
    std::vector<uint8_t> stacked;
    for (uint32_t rank = 0; rank < 2; ++rank) {
      const auto payload = encode({Codec::SignSGD, 0, block}, grads[rank], nullptr, 4, rank);
      stacked.insert(stacked.end(), payload.begin(), payload.end());
    }
    const auto out = decode(stacked, 2, n, alpha);
    const auto s0 = mean_magnitudes(grads[0], block), s1 = mean_magnitudes(grads[1], block);
    for (int64_t i = 0; i < n; ++i) {
      const float t0 = alpha * s0[i / block], t1 = alpha * s1[i / block];
      float want = 0.0f;
      want += grads[0][i] < 0 ? -t0 : t0;  // payload 0, then payload 1
      want += grads[1][i] < 0 ? -t1 : t1;
      ASSERT_EQ(out[i], want) << i;
    }
  }
}

TEST(SignSGD, VoteMagnitudeSumsEachPayloadsBlockScale) {
  const int64_t n = 1000;
  const float alpha = 1.0f / 3;
  for (const int64_t count : {2, 3}) {
    std::vector<std::vector<float>> grads;
    for (int64_t p = 0; p < count; ++p) grads.push_back(dyadic(n, 50 + p));
    for (const int64_t block : {100, 300, 7}) {
      SCOPED_TRACE("block " + std::to_string(block) + ", " + std::to_string(count) + " payloads");
      std::vector<uint8_t> stacked;
      std::vector<std::vector<float>> scales;
      for (int64_t p = 0; p < count; ++p) {
        const auto payload = encode({Codec::SignSGD, 0, block}, grads[p], nullptr, 9, p);
        stacked.insert(stacked.end(), payload.begin(), payload.end());
        scales.push_back(mean_magnitudes(grads[p], block));
      }
      const auto out = decode(stacked, count, n, alpha, true);
      int ties = 0;
      for (int64_t i = 0; i < n; ++i) {
        float magnitude = 0.0f;  // alpha * scale of each payload, added in payload order from +0
        int votes = 0;
        for (int64_t p = 0; p < count; ++p) {
          magnitude += alpha * scales[p][i / block];
          votes += grads[p][i] < 0 ? -1 : 1;
        }
        const float want = votes > 0 ? magnitude : votes < 0 ? -magnitude : 0.0f;
        ASSERT_EQ(out[i], want) << i;
        if (votes == 0) {
          ASSERT_FALSE(std::signbit(out[i])) << "a tie is +0, element " << i;
          ++ties;
        }
      }
      if (count == 2) EXPECT_GT(ties, 100);
    }
  }
}

TEST(SignSGD, HeaderBlockMustBeWithinOneAndTwoToThe40) {
  for (const int64_t numel : {0, 1, 1000}) {
    for (const int64_t block : {int64_t{0}, int64_t{-1}, int64_t{-256}, kMaxBlock + 1, (int64_t{1} << 40) + 1,
                                std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()})
      EXPECT_NE(header_problem(make_header(Codec::SignSGD, DType::F32, numel, 0, block, RandomKey{})), nullptr)
          << "numel " << numel << ", block " << block;
    for (const int64_t block : {int64_t{1}, int64_t{7}, int64_t{256}, int64_t{1000}, int64_t{1001}, kMaxBlock})
      EXPECT_EQ(header_problem(make_header(Codec::SignSGD, DType::BF16, numel, 0, block, RandomKey{})), nullptr)
          << "numel " << numel << ", block " << block;
    EXPECT_NE(header_problem(make_header(Codec::SignSGD, DType::F32, numel, 1, 256, RandomKey{})), nullptr);
  }
  EXPECT_EQ(kMaxBlock, int64_t{1} << 40);
  // A payload whose block is rewritten out of range is refused before any layout is computed from it.
  const int64_t n = 1000;
  const auto payload = encode({Codec::SignSGD, 0, 256}, gaussian(n, 7), nullptr);
  ASSERT_EQ(validate_payloads(payload.data(), 1, payload.size(), n, DType::F32), "");
  for (const int64_t bad : {int64_t{0}, (int64_t{1} << 40) + 1, int64_t{-1}}) {
    auto corrupted = payload;
    std::memcpy(corrupted.data() + offsetof(PayloadHeader, param1), &bad, sizeof bad);
    EXPECT_NE(validate_payloads(corrupted.data(), 1, corrupted.size(), n, DType::F32), "") << bad;
  }
}

TEST(SignSGD, ABlockOfAtLeastNIsOneScaleForTheBucket) {
  const int64_t n = 1000;
  const auto grad = dyadic(n, 61);
  double total = 0;
  for (float v : grad) total += std::fabs(static_cast<double>(v));
  const float expected = static_cast<float>(total / n);
  std::vector<uint8_t> first;
  // 9000 and 70000 take the large-block paths of the encoder, beyond its fused one.
  for (const int64_t block : {n, n + 1, int64_t{4096}, int64_t{9000}, int64_t{70000}, kMaxBlock}) {
    SCOPED_TRACE("block " + std::to_string(block));
    auto payload = encode({Codec::SignSGD, 0, block}, grad, nullptr);
    ASSERT_EQ(static_cast<int64_t>(payload.size()), padded(kHeaderBytes + 4 + 125));
    EXPECT_EQ(scales_of(payload, 1)[0], expected);
    const auto decoded = decode(payload, 1, n, 0.5f);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(decoded[i], grad[i] < 0 ? -(0.5f * expected) : 0.5f * expected) << i;
    std::memset(payload.data() + offsetof(PayloadHeader, param1), 0, sizeof(int64_t));
    if (first.empty()) first = payload;
    EXPECT_EQ(payload, first) << "the bytes differ beyond the header's block";
  }
  // Gaussian values: the mean |m| of the whole bucket, against a long double reference.
  const auto g = gaussian(n, 62);
  long double magnitudes = 0;
  for (float v : g) magnitudes += std::fabs(static_cast<long double>(v));
  for (const int64_t block : {n, kMaxBlock}) {
    const auto payload = encode({Codec::SignSGD, 0, block}, g, nullptr);
    EXPECT_EQ(scales_of(payload, 1)[0], static_cast<float>(static_cast<double>(magnitudes / n))) << block;
  }
}

TEST(QSGD, LevelsStayWithinRangeAndDecodeIsUnbiased) {
  const int64_t n = 64;
  const auto grad = gaussian(n, 9);
  std::vector<double> mean(n, 0.0);
  const int trials = 4000;
  for (int t = 0; t < trials; ++t) {
    const auto decoded = decode(encode({Codec::QSGD, 3, 16}, grad, nullptr, t), 1, n);
    for (int64_t i = 0; i < n; ++i) mean[i] += decoded[i] / trials;
  }
  for (int64_t b = 0; b < n; b += 16) {
    double norm = 0;
    for (int64_t i = b; i < b + 16; ++i) norm += double(grad[i]) * grad[i];
    const double step = std::sqrt(norm) / 3;  // one level; per-trial deviation is at most a step
    for (int64_t i = b; i < b + 16; ++i) EXPECT_NEAR(mean[i], grad[i], 5 * step / std::sqrt(trials)) << i;
  }
}

TEST(Orthogonalize, ColumnsBecomeOrthonormal) {
  const int64_t rows = 50, cols = 6;
  auto m = gaussian(rows * cols, 12);
  orthogonalize_cpu(m.data(), rows, cols, 0.0f);
  for (int64_t a = 0; a < cols; ++a)
    for (int64_t b = 0; b < cols; ++b) {
      double dot = 0;
      for (int64_t r = 0; r < rows; ++r) dot += double(m[r * cols + a]) * m[r * cols + b];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5) << a << "," << b;
    }
}

TEST(Orthogonalize, DependentColumnBecomesZero) {
  const int64_t rows = 4, cols = 2;
  std::vector<float> m = {1, 2, 2, 4, 3, 6, 4, 8};  // column 1 = 2 * column 0
  orthogonalize_cpu(m.data(), rows, cols, 1e-4f);
  for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(m[r * cols + 1], 0.0f);
}

TEST(Orthogonalize, NumericallyDependentColumnBecomesZeroWithoutEps) {
  // Column 2 = 3 * column 0 - column 1 up to rounding: its remainder is noise, which must not be
  // normalized into a third "direction" (with eps = 0, only the relative test catches it).
  const int64_t rows = 64, cols = 3;
  auto m = gaussian(rows * cols, 5);
  for (int64_t r = 0; r < rows; ++r) m[r * cols + 2] = 3.0f * m[r * cols] - m[r * cols + 1];
  orthogonalize_cpu(m.data(), rows, cols, 0.0f);
  for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(m[r * cols + 2], 0.0f) << r;
}

TEST(LowRankProduct, IsPTimesQTransposed) {
  const int64_t rows = 7, cols = 5, rank = 3;
  const auto p = gaussian(rows * rank, 21), q = gaussian(cols * rank, 22);
  std::vector<float> out(rows * cols, -1.0f);
  low_rank_product_cpu(p.data(), q.data(), out.data(), rows, cols, rank, nullptr);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      double expected = 0;
      for (int64_t k = 0; k < rank; ++k) expected += double(p[i * rank + k]) * q[j * rank + k];
      EXPECT_NEAR(out[i * cols + j], expected, 1e-5) << i << "," << j;
    }
  std::vector<float> empty_rank(rows * cols, -1.0f);  // rank 0: a product of nothing is 0
  low_rank_product_cpu(p.data(), q.data(), empty_rank.data(), rows, cols, 0, nullptr);
  for (float v : empty_rank) EXPECT_EQ(v, 0.0f);
}

}  // namespace
