// The CUDA codecs against the CPU codecs, bit for bit: payloads, residuals and decoded sums, for
// every codec, dtype and a range of sizes; the device-side payload checks; orthogonalization.
// Built whenever the CUDA codecs are; every test skips where no GPU can be used.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/kernels.h"
#include "../../cuda/codecs.h"

using namespace gradcomp;

namespace {

bool gpu_usable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define REQUIRE_GPU()                                                      \
  do {                                                                     \
    if (!gpu_usable()) GTEST_SKIP() << "no CUDA GPU usable on this machine"; \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

// A device copy of host bytes that copies back on request; freed at scope exit.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, bytes ? bytes : 1) != cudaSuccess) ptr_ = nullptr;
  }
  DeviceBytes(const void* host, size_t bytes) : DeviceBytes(bytes) {
    if (ptr_ && bytes) cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice);
  }
  ~DeviceBytes() { cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  template <typename P = void>
  P* get() const { return static_cast<P*>(ptr_); }
  std::vector<uint8_t> host() const {
    std::vector<uint8_t> out(bytes_);
    if (bytes_) cudaMemcpy(out.data(), ptr_, bytes_, cudaMemcpyDeviceToHost);
    return out;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

struct Case {
  Codec codec;
  int64_t param0;  // levels for qsgd; for topk / randomk a ratio in thousandths (k = ceil)
  int64_t param1;
  DType dtype;
  int64_t numel;
  bool residual;
};

std::string name_of(const Case& c) {
  static const char* dtypes[] = {"f32", "f16", "bf16"};
  const std::string params = (c.param0 ? "_" + std::to_string(c.param0) : "") + (c.param1 ? "_" + std::to_string(c.param1) : "");
  return std::string(kCodecNames[static_cast<int>(c.codec)]) + params + "_" + dtypes[static_cast<int>(c.dtype)] + "_n" +
         std::to_string(c.numel) + (c.residual ? "_ef" : "");
}

int64_t wire_param0(const Case& c) {
  if (c.codec == Codec::TopK || c.codec == Codec::RandomK)
    return c.numel == 0 ? 0 : std::max<int64_t>(1, (c.numel * c.param0 + 999) / 1000);
  return c.param0;
}

// Gradient-like bytes of a dtype: Gaussian values over several scales, with exact zeros and ties,
// so that topk meets equal magnitudes and signsgd meets zeros.
std::vector<uint8_t> values(DType dtype, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<uint8_t> bytes(n * dtype_bytes(dtype));
  for (int64_t i = 0; i < n; ++i) {
    float v = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4);
    if (rng() % 17 == 0) v = 0.0f;
    if (rng() % 23 == 0) v = 0.5f;
    if (dtype == DType::F32) std::memcpy(&bytes[4 * i], &v, 4);
    const uint16_t half_bits = dtype == DType::F16 ? from_float<f16>(v).bits : from_float<bf16>(v).bits;
    if (dtype != DType::F32) std::memcpy(&bytes[2 * i], &half_bits, 2);
  }
  return bytes;
}

struct Encoded {
  std::vector<uint8_t> payload, residual;
};

Encoded encode_on_cpu(const Case& c, const PayloadHeader& h, uint32_t rank, const std::vector<uint8_t>& grad,
                      std::vector<uint8_t> residual, bool norm_scale = false) {
  EncodeArgs args;
  args.header = h;
  args.norm_scale = norm_scale;
  args.rank = rank;
  args.grad = grad.data();
  args.residual = c.residual ? residual.data() : nullptr;
  Encoded out{std::vector<uint8_t>(body_layout(h).total, 0xAB), residual};
  args.residual = c.residual ? out.residual.data() : nullptr;
  args.payload = out.payload.data();
  encode_cpu(args);
  return out;
}

Encoded encode_on_gpu(const Case& c, const PayloadHeader& h, uint32_t rank, const std::vector<uint8_t>& grad,
                      const std::vector<uint8_t>& residual, bool norm_scale = false) {
  DeviceBytes d_grad(grad.data(), grad.size()), d_residual(residual.data(), residual.size());
  DeviceBytes d_payload(body_layout(h).total), d_workspace(cuda::encode_workspace_bytes(h));
  cudaMemset(d_payload.get(), 0xAB, body_layout(h).total);
  cuda::EncodeParams p;
  p.header = h;
  p.rank = rank;
  p.grad = d_grad.get();
  p.residual = c.residual ? d_residual.get() : nullptr;
  p.payload = d_payload.get<uint8_t>();
  p.workspace = d_workspace.get();
  p.norm_scale = norm_scale;
  EXPECT_EQ(cuda::encode(p, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {d_payload.host(), d_residual.host()};
}

std::vector<uint8_t> decode_on_cpu(const PayloadHeader& h, const std::vector<uint8_t>& stacked, int64_t count,
                                   float alpha, bool vote) {
  const int64_t stride = body_layout(h).total;
  EXPECT_EQ(validate_payloads(stacked.data(), count, stride, h.numel, static_cast<DType>(h.dtype)), "");
  std::vector<uint8_t> out(h.numel * dtype_bytes(static_cast<DType>(h.dtype)), 0xCD);
  DecodeArgs args;
  args.payloads = stacked.data();
  args.count = count;
  args.stride = stride;
  args.out = out.data();
  args.alpha = alpha;
  args.vote = vote;
  decode_sum_cpu(args);
  return out;
}

// The decoded sum and the status word the device checks left.
std::pair<std::vector<uint8_t>, uint32_t> decode_on_gpu(const PayloadHeader& expected,
                                                        const std::vector<uint8_t>& stacked, int64_t count,
                                                        float alpha, bool vote) {
  DeviceBytes d_payloads(stacked.data(), stacked.size());
  DeviceBytes d_out(expected.numel * dtype_bytes(static_cast<DType>(expected.dtype)));
  DeviceBytes d_status(sizeof(uint32_t)), d_workspace(cuda::decode_workspace_bytes(expected, count));
  cudaMemset(d_status.get(), 0, sizeof(uint32_t));
  cuda::DecodeParams p;
  p.expected = expected;
  p.payloads = d_payloads.get<uint8_t>();
  p.count = count;
  p.out = d_out.get();
  p.alpha = alpha;
  p.vote = vote;
  p.status = d_status.get<uint32_t>();
  p.workspace = d_workspace.get();
  EXPECT_EQ(cuda::decode_sum(p, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  uint32_t status = 0;
  std::memcpy(&status, d_status.host().data(), sizeof status);
  return {d_out.host(), status};
}

class CudaMatchesCpu : public ::testing::TestWithParam<Case> {};

TEST_P(CudaMatchesCpu, PayloadsResidualsAndSumsAreTheSameBits) {
  REQUIRE_GPU();
  const Case c = GetParam();
  const int64_t ranks = 3;
  std::vector<uint8_t> cpu_stack;
  for (uint32_t rank = 0; rank < ranks; ++rank) {
    const PayloadHeader h =
        make_header(c.codec, c.dtype, c.numel, wire_param0(c), c.param1, RandomKey{0x1234567890ULL, 7, 3, 0});
    ASSERT_EQ(header_problem(h), nullptr);
    const auto grad = values(c.dtype, c.numel, 100 + rank);
    const auto residual = values(c.dtype, c.numel, 200 + rank);
    const Encoded cpu = encode_on_cpu(c, h, rank, grad, residual);
    const Encoded gpu = encode_on_gpu(c, h, rank, grad, residual);
    ASSERT_EQ(gpu.payload, cpu.payload) << "payload of rank " << rank;
    if (c.residual) ASSERT_EQ(gpu.residual, cpu.residual) << "residual of rank " << rank;
    cpu_stack.insert(cpu_stack.end(), cpu.payload.begin(), cpu.payload.end());
  }
  const PayloadHeader expected = make_header(c.codec, c.dtype, c.numel, wire_param0(c), c.param1, RandomKey{});
  for (int64_t count : {int64_t{1}, ranks}) {
    for (bool vote : {false, true}) {
      if (vote && c.codec != Codec::SignSGD) continue;
      const auto cpu = decode_on_cpu(expected, cpu_stack, count, 1.0f / 3, vote);
      const auto [gpu, status] = decode_on_gpu(expected, cpu_stack, count, 1.0f / 3, vote);
      EXPECT_EQ(status, 0u);
      EXPECT_EQ(gpu, cpu) << count << " payloads" << (vote ? ", vote" : "");
    }
  }
}

std::vector<Case> every_case() {
  const struct {
    Codec codec;
    int64_t param0, param1;
  } codecs[] = {{Codec::None, 0, 0},     {Codec::Fp16, 0, 0},   {Codec::Bf16, 0, 0},
                {Codec::SignSGD, 0, 256}, {Codec::SignSGD, 0, 100}, {Codec::SignSGD, 0, 7},
                {Codec::SignSGD, 0, 9000}, {Codec::SignSGD, 0, kMaxBlock},  // the last: one block per bucket
                {Codec::TernGrad, 0, 0}, {Codec::QSGD, 15, 512},
                {Codec::QSGD, 3, 5000},  {Codec::QSGD, 1000, 64}, {Codec::TopK, 10, 0},
                {Codec::TopK, 300, 0},   {Codec::TopK, 10, kTopkCompact}, {Codec::TopK, 300, kTopkCompact},
                {Codec::RandomK, 10, 0}};
  std::vector<Case> cases;
  for (const auto& codec : codecs)
    for (DType dtype : {DType::F32, DType::F16, DType::BF16})
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{33}, int64_t{4097}, int64_t{100003}})
        for (bool residual : {false, true})
          if (n > 0 || !residual) cases.push_back({codec.codec, codec.param0, codec.param1, dtype, n, residual});
  // Large enough for many blocks of every kernel and several topk tiles and digit passes.
  cases.push_back({Codec::TopK, 1, 0, DType::F32, 3000017, true});
  cases.push_back({Codec::TopK, 1, kTopkCompact, DType::F32, 3000017, true});  // 46 spans of 2^16
  cases.push_back({Codec::SignSGD, 0, 256, DType::BF16, 3000017, true});
  cases.push_back({Codec::SignSGD, 0, 100, DType::F32, 3000017, true});
  cases.push_back({Codec::SignSGD, 0, 100003, DType::F16, 3000017, true});  // blocks of many reduce chunks
  cases.push_back({Codec::SignSGD, 0, kMaxBlock, DType::F32, 3000017, true});
  cases.push_back({Codec::QSGD, 127, 1 << 20, DType::F32, 3000017, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EveryCodec, CudaMatchesCpu, ::testing::ValuesIn(every_case()),
                         [](const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); });

// The two-phase owner's signsgd re-encode (root mean square scale).
TEST(CudaSignsgd, NormScaleIsTheSameBits) {
  REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16})
    for (int64_t n : {int64_t{1}, int64_t{4097}, int64_t{3000017}})
      for (int64_t block : {int64_t{100}, int64_t{256}, int64_t{70000}, kMaxBlock})
        for (bool residual : {false, true}) {
          const Case c{Codec::SignSGD, 0, block, dtype, n, residual};
          const PayloadHeader h = make_header(Codec::SignSGD, dtype, n, 0, block, RandomKey{});
          const auto grad = values(dtype, n, 300), old = values(dtype, n, 400);
          const Encoded cpu = encode_on_cpu(c, h, 0, grad, old, true);
          const Encoded gpu = encode_on_gpu(c, h, 0, grad, old, true);
          ASSERT_EQ(gpu.payload, cpu.payload) << name_of(c);
          if (residual) ASSERT_EQ(gpu.residual, cpu.residual) << name_of(c);
        }
}

// Sum and vote of signsgd payloads with blocks of 100 (not a multiple of 8 or of a warp), against
// the CPU and against values computed here from each payload's own scales and sign bits.
TEST(CudaSignsgd, BlockOf100SumAndVote) {
  REQUIRE_GPU();
  const int64_t n = 1003, block = 100, blocks = 11, ranks = 3;
  const Case c{Codec::SignSGD, 0, block, DType::F32, n, false};
  const PayloadHeader h = make_header(Codec::SignSGD, DType::F32, n, 0, block, RandomKey{9, 1, 0, 0});
  ASSERT_EQ(body_layout(h).codes, kHeaderBytes + 4 * blocks);
  std::vector<uint8_t> stack;
  for (uint32_t rank = 0; rank < ranks; ++rank) {
    const auto grad = values(DType::F32, n, 500 + rank);
    const Encoded gpu = encode_on_gpu(c, h, rank, grad, {});
    ASSERT_EQ(gpu.payload, encode_on_cpu(c, h, rank, grad, {}).payload) << "rank " << rank;
    stack.insert(stack.end(), gpu.payload.begin(), gpu.payload.end());
  }
  const int64_t stride = body_layout(h).total;
  const float alpha = 0.25f;
  for (bool vote : {false, true}) {
    const auto [gpu, status] = decode_on_gpu(h, stack, ranks, alpha, vote);
    EXPECT_EQ(status, 0u);
    EXPECT_EQ(gpu, decode_on_cpu(h, stack, ranks, alpha, vote)) << (vote ? "vote" : "sum");
    for (int64_t i = 0; i < n; ++i) {
      float sum = 0.0f, magnitude = 0.0f;
      int votes = 0;
      for (int64_t p = 0; p < ranks; ++p) {
        float scale;
        std::memcpy(&scale, &stack[p * stride + kHeaderBytes + 4 * (i / block)], sizeof scale);
        const bool positive = (stack[p * stride + kHeaderBytes + 4 * blocks + i / 8] >> (i % 8)) & 1;
        const float t = alpha * scale;
        sum += positive ? t : -t;
        magnitude += t;
        votes += positive ? 1 : -1;
      }
      const float want = !vote ? sum : votes > 0 ? magnitude : votes < 0 ? -magnitude : 0.0f;
      float got;
      std::memcpy(&got, &gpu[4 * i], sizeof got);
      ASSERT_EQ(got, want) << (vote ? "vote" : "sum") << ", element " << i;
    }
  }
}

TEST(CudaTopk, TiesGoToTheLowestIndices) {
  REQUIRE_GPU();
  const int64_t n = 50000;
  std::vector<float> grad(n, 1.0f);  // every magnitude equal: the first k indices are the answer
  const std::vector<uint8_t> bytes(reinterpret_cast<const uint8_t*>(grad.data()),
                                   reinterpret_cast<const uint8_t*>(grad.data()) + 4 * n);
  const Case c{Codec::TopK, 0, 0, DType::F32, n, false};
  const PayloadHeader h = make_header(Codec::TopK, DType::F32, n, 777, 0, RandomKey{});
  const Encoded gpu = encode_on_gpu(c, h, 0, bytes, bytes);
  const int32_t* indices = reinterpret_cast<const int32_t*>(gpu.payload.data() + body_layout(h).codes);
  for (int j = 0; j < 777; ++j) ASSERT_EQ(indices[j], j);
}

class CudaChecksPayloads : public ::testing::Test {
 protected:
  // Three valid topk payloads of 1000 fp32 elements, k = 10.
  void SetUp() override {
    const Case c{Codec::TopK, 10, 0, DType::F32, 1000, false};
    stack.clear();
    header = make_header(Codec::TopK, DType::F32, 1000, 10, 0, RandomKey{5, 1, 0, 0});
    for (uint32_t rank = 0; rank < 3; ++rank) {
      const Encoded e = encode_on_cpu(c, header, rank, values(DType::F32, 1000, rank), {});
      stack.insert(stack.end(), e.payload.begin(), e.payload.end());
    }
    stride = body_layout(header).total;
  }
  uint32_t status_after_decode(const PayloadHeader& expected, bool* all_nan) {
    const auto [out, status] = decode_on_gpu(expected, stack, 3, 1.0f, false);
    *all_nan = true;
    for (size_t i = 0; i < out.size(); i += 4) {
      float v;
      std::memcpy(&v, &out[i], 4);
      *all_nan = *all_nan && std::isnan(v);
    }
    return status;
  }
  PayloadHeader header;
  std::vector<uint8_t> stack;
  int64_t stride = 0;
};

TEST_F(CudaChecksPayloads, ValidPayloadsPass) {
  REQUIRE_GPU();
  bool all_nan = false;
  EXPECT_EQ(status_after_decode(header, &all_nan), 0u);
  EXPECT_FALSE(all_nan);
}

TEST_F(CudaChecksPayloads, ForeignHeaderPoisonsTheOutput) {
  REQUIRE_GPU();
  stack[stride + 0] ^= 0xFF;  // payload 1's magic
  bool all_nan = false;
  EXPECT_EQ(status_after_decode(header, &all_nan), uint32_t{kHeaderNotExpected});
  EXPECT_TRUE(all_nan);
}

TEST_F(CudaChecksPayloads, OtherStepIsRefused) {
  REQUIRE_GPU();
  stack[2 * stride + offsetof(PayloadHeader, step)] ^= 1;
  bool all_nan = false;
  EXPECT_EQ(status_after_decode(header, &all_nan), uint32_t{kHeadersDiffer});
  EXPECT_TRUE(all_nan);
}

TEST_F(CudaChecksPayloads, OutOfRangeOrRepeatedIndexIsRefused) {
  REQUIRE_GPU();
  for (const int32_t bad : {int32_t{1000}, int32_t{-1}, int32_t{0}}) {  // 0 repeats or breaks the order
    SetUp();
    std::memcpy(&stack[stride + body_layout(header).codes + 4 * 5], &bad, 4);
    bool all_nan = false;
    EXPECT_EQ(status_after_decode(header, &all_nan), uint32_t{kIndexInvalid}) << bad;
    EXPECT_TRUE(all_nan);
  }
}

TEST_F(CudaChecksPayloads, ExpectedParametersMustMatch) {
  REQUIRE_GPU();
  stack[offsetof(PayloadHeader, param1)] = 1;  // payload 0 claims a parameter topk does not have
  bool all_nan = false;
  EXPECT_EQ(status_after_decode(header, &all_nan), uint32_t{kHeaderNotExpected});
  EXPECT_TRUE(all_nan);
}

class CudaChecksCompactTopk : public ::testing::TestWithParam<int64_t> {};

// 4 spans, and 301: the per-payload scan of the counts then takes two rounds of a block's threads.
INSTANTIATE_TEST_SUITE_P(Spans, CudaChecksCompactTopk, ::testing::Values(3 * 65536 + 100, 300 * 65536 + 100));

TEST_P(CudaChecksCompactTopk, CountsAndIndicesThatDoNotFitAreRefused) {
  REQUIRE_GPU();
  const int64_t n = GetParam(), k = 60;
  const PayloadHeader header = make_header(Codec::TopK, DType::F32, n, k, kTopkCompact, RandomKey{5, 1, 0, 0});
  const Case c{Codec::TopK, 0, kTopkCompact, DType::F32, n, false};
  const BodyLayout layout = body_layout(header);
  std::vector<uint8_t> good;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    auto grad = values(DType::F32, n, rank);
    // Selected for sure: indices 0 and 1 (the pokes below need two in the first span) and n - 1 (the
    // last, partial span), whatever the random values around them.
    const float big = 1e6f;
    for (const int64_t i : {int64_t{0}, int64_t{1}, n - 1}) std::memcpy(&grad[4 * i], &big, 4);
    const Encoded e = encode_on_cpu(c, header, rank, grad, {});
    good.insert(good.end(), e.payload.begin(), e.payload.end());
  }
  const auto status_of = [&](const std::vector<uint8_t>& stack) {
    const auto [out, status] = decode_on_gpu(header, stack, 2, 1.0f, false);
    bool all_nan = true;
    for (size_t i = 0; i < out.size(); i += 4) {
      float v;
      std::memcpy(&v, &out[i], 4);
      all_nan = all_nan && std::isnan(v);
    }
    EXPECT_EQ(all_nan, status != 0u);
    return status;
  };
  EXPECT_EQ(status_of(good), 0u);
  const int64_t stride = layout.total;
  const auto poke = [&](int64_t offset, const void* value, size_t bytes) {
    auto bad = good;
    std::memcpy(&bad[stride + offset], value, bytes);
    return bad;
  };
  uint32_t count0;
  std::memcpy(&count0, &good[stride + layout.scales], 4);
  for (uint32_t bad_count : {count0 + 1, count0 - 1, 0xFFFFFFFFu})  // the counts no longer add up to k
    EXPECT_EQ(status_of(poke(layout.scales, &bad_count, 4)), uint32_t{kIndexInvalid}) << bad_count;
  const int64_t last_span = (n - 1) / 65536;  // holds the last index; one more there breaks the total
  uint32_t last_count;
  std::memcpy(&last_count, &good[stride + layout.scales + 4 * last_span], 4);
  ++last_count;
  EXPECT_EQ(status_of(poke(layout.scales + 4 * last_span, &last_count, 4)), uint32_t{kIndexInvalid});
  const uint16_t past_n = 100;  // the last index, in the last span of 100 elements
  EXPECT_EQ(status_of(poke(layout.codes + 2 * (k - 1), &past_n, 2)), uint32_t{kIndexInvalid});
  ASSERT_GE(count0, 2u);
  uint16_t first;  // the second index made equal to the first, in the same span
  std::memcpy(&first, &good[stride + layout.codes], 2);
  EXPECT_EQ(status_of(poke(layout.codes + 2, &first, 2)), uint32_t{kIndexInvalid});
}

TEST(CudaOrthogonalize, MatchesTheCpuToRounding) {
  REQUIRE_GPU();
  const int64_t batch = 3, rows = 1000, cols = 8;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> m(batch * rows * cols);
  for (auto& v : m) v = normal(rng);
  for (int64_t r = 0; r < rows; ++r) m[r * cols + 5] = m[r * cols + 1] * 2.0f;  // dependent: becomes zero
  std::vector<float> cpu = m;
  for (int64_t b = 0; b < batch; ++b) orthogonalize_cpu(cpu.data() + b * rows * cols, rows, cols, 0.0f);
  DeviceBytes d(m.data(), 4 * m.size());
  ASSERT_EQ(cuda::orthogonalize(d.get<float>(), batch, rows, cols, 0.0f, nullptr), cudaSuccess);
  const auto bytes = d.host();
  std::vector<float> gpu(m.size());
  std::memcpy(gpu.data(), bytes.data(), bytes.size());
  for (size_t i = 0; i < m.size(); ++i) ASSERT_NEAR(gpu[i], cpu[i], 1e-4f) << "element " << i;
  for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(gpu[r * cols + 5], 0.0f);
}

}  // namespace
