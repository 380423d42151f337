// Every instruction-set variant of the codecs computes the same bits as the portable one.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cpu/kernels.h"

using namespace gradcomp;

namespace {

template <typename T>
std::vector<T> random_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<T> x(n);
  for (auto& v : x) v = from_float<T>(normal(rng) * (1 + (rng() % 3)));
  return x;
}

template <typename T>
void check_codec(Codec codec, DType dtype, int64_t p0, int64_t p1) {
  const int64_t n = 5003;  // not a multiple of any tile, chunk or byte
  const auto grad = random_values<T>(n, 1);
  const auto residual0 = random_values<T>(n, 2);
  std::vector<uint8_t> base_payload, base_residual_bytes, base_out_bytes;
  int compared = 0;
  for (const CodecVariant& v : codec_variants()) {
    if (!v.supported) continue;
    auto residual = residual0;
    EncodeArgs args;
    args.header = make_header(codec, dtype, n, p0, p1, RandomKey{77, 3, 1, 0});
    args.rank = 2;
    args.grad = grad.data();
    args.residual = residual.data();
    std::vector<uint8_t> payload(body_layout(args.header).total);
    args.payload = payload.data();
    std::memcpy(payload.data(), &args.header, sizeof args.header);
    v.encode[static_cast<int>(codec)](args);
    std::vector<T> out(n);
    DecodeArgs d;
    d.payloads = payload.data();
    d.count = 1;
    d.stride = payload.size();
    d.out = out.data();
    d.alpha = 0.5f;
    v.decode[static_cast<int>(codec)](d, args.header);
    std::vector<uint8_t> residual_bytes(reinterpret_cast<uint8_t*>(residual.data()),
                                        reinterpret_cast<uint8_t*>(residual.data() + n));
    std::vector<uint8_t> out_bytes(reinterpret_cast<uint8_t*>(out.data()), reinterpret_cast<uint8_t*>(out.data() + n));
    if (base_payload.empty()) {
      base_payload = payload;
      base_residual_bytes = residual_bytes;
      base_out_bytes = out_bytes;
      continue;
    }
    ++compared;
    EXPECT_EQ(payload, base_payload) << v.isa << " payload differs for codec " << kCodecNames[int(codec)];
    EXPECT_EQ(residual_bytes, base_residual_bytes) << v.isa << " residual differs for codec " << kCodecNames[int(codec)];
    EXPECT_EQ(out_bytes, base_out_bytes) << v.isa << " decode differs for codec " << kCodecNames[int(codec)];
  }
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) EXPECT_GE(compared, 1) << "no SIMD variant was compared with the portable one";
#endif
}

template <typename T>
void check_all(DType dtype) {
  check_codec<T>(Codec::None, dtype, 0, 0);
  check_codec<T>(Codec::Fp16, dtype, 0, 0);
  check_codec<T>(Codec::Bf16, dtype, 0, 0);
  check_codec<T>(Codec::SignSGD, dtype, 0, 256);
  check_codec<T>(Codec::SignSGD, dtype, 0, 100);
  check_codec<T>(Codec::SignSGD, dtype, 0, 7);
  check_codec<T>(Codec::SignSGD, dtype, 0, 9000);  // one block larger than n
  check_codec<T>(Codec::TernGrad, dtype, 0, 0);
  check_codec<T>(Codec::QSGD, dtype, 15, 512);
  check_codec<T>(Codec::QSGD, dtype, 200, 77);
  check_codec<T>(Codec::TopK, dtype, 50, 0);
  check_codec<T>(Codec::RandomK, dtype, 50, 0);
}

TEST(Variants, Float32) { check_all<float>(DType::F32); }
TEST(Variants, Float16) { check_all<f16>(DType::F16); }
TEST(Variants, BFloat16) { check_all<bf16>(DType::BF16); }

TEST(Variants, TheDispatcherNamesItsChoice) {
  const std::string isa = cpu_isa();
  EXPECT_TRUE(isa == "base" || isa == "avx2" || isa == "avx512") << isa;
}

}  // namespace
