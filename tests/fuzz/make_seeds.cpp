// Writes the fuzzers' seed corpus: valid payloads of every codec, in each dtype and at a few sizes,
// in the input layout of fuzz_decode.cpp (a control byte, then the payloads).
//   make_seeds DIR   ->   DIR/<codec>/seed_<n>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/kernels.h"

using namespace gradcomp;

namespace {

std::vector<uint8_t> encode(Codec codec, DType dtype, int64_t numel, int64_t param0, int64_t param1, uint32_t rank) {
  std::vector<float> grad(numel);
  for (int64_t i = 0; i < numel; ++i) grad[i] = std::sin(0.7f * static_cast<float>(i + rank)) * (1 + i % 5);
  std::vector<uint8_t> typed(numel * dtype_bytes(dtype));
  visit_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* values = reinterpret_cast<T*>(typed.data());
    for (int64_t i = 0; i < numel; ++i) values[i] = from_float<T>(grad[i]);
  });
  EncodeArgs args;
  args.header = make_header(codec, dtype, numel, param0, param1, RandomKey{5, 3, 1, 0});
  args.rank = rank;
  args.grad = typed.data();
  std::vector<uint8_t> payload(body_layout(args.header).total);
  args.payload = payload.data();
  encode_cpu(args);
  return payload;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root = argv[1];
  int written = 0;
  for (int c = 0; c < kNumCodecs; ++c) {
    const Codec codec = static_cast<Codec>(c);
    const std::filesystem::path dir = root / kCodecNames[c];
    std::filesystem::create_directories(dir);
    int n_seed = 0;
    for (int64_t numel : {1, 7, 64, 1000}) {
      for (int d = 0; d < kNumDTypes; ++d) {
        for (int64_t count : {1, 3}) {
          const bool indexed = codec == Codec::TopK || codec == Codec::RandomK;
          const int64_t param0 = indexed ? (numel + 9) / 10 : codec == Codec::QSGD ? 5 : 0;
          // signsgd blocks: smaller than n and not a multiple of 8 (a short last block), a multiple of
          // 8, and larger than n.
          const int64_t signsgd_block = numel == 1000 ? 300 : numel == 64 ? 8 : numel == 7 ? 3 : 256;
          // topk: the wide layout, and for the larger sizes of 3 payloads the compact one (counts per span)
          const int64_t topk_layout = numel >= 64 && count == 3 ? kTopkCompact : kTopkWide;
          const int64_t param1 = codec == Codec::QSGD      ? 16
                                 : codec == Codec::SignSGD ? signsgd_block
                                 : codec == Codec::TopK    ? topk_layout
                                                           : 0;
          std::vector<uint8_t> input{static_cast<uint8_t>(count - 1)};
          for (int64_t r = 0; r < count; ++r) {
            const auto payload = encode(codec, static_cast<DType>(d), numel, param0, param1, r);
            input.insert(input.end(), payload.begin(), payload.end());
          }
          const std::string name = (dir / ("seed_" + std::to_string(n_seed++))).string();
          FILE* f = std::fopen(name.c_str(), "wb");
          if (!f || std::fwrite(input.data(), 1, input.size(), f) != input.size() || std::fclose(f) != 0) {
            std::perror(name.c_str());
            return 1;
          }
          ++written;
        }
      }
    }
  }
  std::printf("wrote %d seed inputs under %s\n", written, argv[1]);
  return 0;
}
