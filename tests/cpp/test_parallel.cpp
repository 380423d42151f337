// Codecs split across threads produce the same bits as on one thread.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cpu/kernels.h"

using namespace gradcomp;

namespace {

// Cuts [0, count) into `kThreads` ranges (at least grain items each) and runs them concurrently.
constexpr int64_t kThreads = 4;
void threaded_for(int64_t count, int64_t grain, const RangeBody& body) {
  const int64_t per = std::max(grain, (count + kThreads - 1) / kThreads);
  std::vector<std::thread> threads;
  for (int64_t begin = 0; begin < count; begin += per)
    threads.emplace_back([&body, begin, end = std::min(count, begin + per)] { body(begin, end); });
  for (auto& t : threads) t.join();
}

struct Result {
  std::vector<uint8_t> payload;
  std::vector<float> residual;
  std::vector<float> out;
};

Result run(Codec codec, int64_t p0, int64_t p1, const std::vector<float>& grad, ParallelFor parallel_for) {
  Result r;
  r.residual.assign(grad.size(), 0.25f);
  EncodeArgs e;
  e.header = make_header(codec, DType::F32, grad.size(), p0, p1, RandomKey{5, 6, 7, 0});
  e.rank = 3;
  e.grad = grad.data();
  e.residual = r.residual.data();
  r.payload.assign(body_layout(e.header).total, 0);
  e.payload = r.payload.data();
  e.parallel_for = parallel_for;
  encode_cpu(e);
  std::vector<uint8_t> stacked(r.payload);
  stacked.insert(stacked.end(), r.payload.begin(), r.payload.end());
  EXPECT_EQ(validate_payloads(stacked.data(), 2, r.payload.size(), grad.size(), DType::F32), "");
  r.out.assign(grad.size(), 0.0f);
  DecodeArgs d;
  d.payloads = stacked.data();
  d.count = 2;
  d.stride = r.payload.size();
  d.out = r.out.data();
  d.alpha = 0.5f;
  d.parallel_for = parallel_for;
  decode_sum_cpu(d);
  return r;
}

struct Case {
  Codec codec;
  int64_t p0, p1;
};

class Parallel : public ::testing::TestWithParam<Case> {};

TEST_P(Parallel, SameBitsAsOneThread) {
  const int64_t n = 1'000'003;  // many tasks, none of them aligned to anything
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> grad(n);
  for (auto& v : grad) v = normal(rng);
  const Case c = GetParam();
  const Result serial = run(c.codec, c.p0, c.p1, grad, nullptr);
  const Result threaded = run(c.codec, c.p0, c.p1, grad, threaded_for);
  EXPECT_EQ(serial.payload, threaded.payload);
  EXPECT_EQ(0, std::memcmp(serial.residual.data(), threaded.residual.data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(serial.out.data(), threaded.out.data(), n * sizeof(float)));
}

INSTANTIATE_TEST_SUITE_P(
    Codecs, Parallel,
    // signsgd: blocks summed where they are signed (7, 100, 256), whole blocks in parallel (9000),
    // each block's reduce chunks in parallel (70000), one block of exactly n, one larger than n.
    ::testing::Values(Case{Codec::None, 0, 0}, Case{Codec::Fp16, 0, 0}, Case{Codec::SignSGD, 0, 256},
                      Case{Codec::SignSGD, 0, 7}, Case{Codec::SignSGD, 0, 100}, Case{Codec::SignSGD, 0, 9000},
                      Case{Codec::SignSGD, 0, 70000}, Case{Codec::SignSGD, 0, 1'000'003},
                      Case{Codec::SignSGD, 0, kMaxBlock}, Case{Codec::TernGrad, 0, 0}, Case{Codec::QSGD, 15, 512},
                      Case{Codec::QSGD, 7, 100003},
                      Case{Codec::QSGD, 3, 77}, Case{Codec::TopK, 10000, 0}, Case{Codec::TopK, 999999, 0},
                      Case{Codec::RandomK, 10000, 0}),
    [](const auto& info) { return std::string(kCodecNames[static_cast<int>(info.param.codec)]) + "_" + std::to_string(info.index); });

// PowerSGD's decode: P Q^T on rows split across threads gives one thread's bits (the ranks of a run
// must apply the same average whatever their thread counts).
TEST(LowRankProduct, SameBitsAsOneThread) {
  const int64_t rows = 1001, cols = 517, rank = 5;  // many tasks of rows, none aligned
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> p(rows * rank), q(cols * rank), serial(rows * cols), threaded(rows * cols);
  for (auto& v : p) v = normal(rng);
  for (auto& v : q) v = normal(rng);
  low_rank_product_cpu(p.data(), q.data(), serial.data(), rows, cols, rank, nullptr);
  low_rank_product_cpu(p.data(), q.data(), threaded.data(), rows, cols, rank, threaded_for);
  EXPECT_EQ(0, std::memcmp(serial.data(), threaded.data(), serial.size() * sizeof(float)));
}

}  // namespace
