// Codec dispatch and payload validation for the CPU path.
#include <cstring>

#include "kernels.h"

namespace gradcomp {

PayloadHeader make_header(Codec codec, DType dtype, int64_t numel, int64_t param0, int64_t param1,
                          const RandomKey& key) {
  PayloadHeader h{};
  h.magic = kMagic;
  h.version = kFormatVersion;
  h.codec = static_cast<uint8_t>(codec);
  h.dtype = static_cast<uint8_t>(dtype);
  h.numel = numel;
  h.param0 = param0;
  h.param1 = param1;
  h.seed = key.seed;
  h.step = key.step;
  h.bucket = key.bucket;
  return h;
}

void encode_cpu(const EncodeArgs& args) {
  const BodyLayout layout = body_layout(args.header);
  std::memcpy(args.payload, &args.header, sizeof(PayloadHeader));
  std::memset(args.payload + layout.end, 0, layout.total - layout.end);
  switch (static_cast<Codec>(args.header.codec)) {
    case Codec::None:
    case Codec::Fp16:
    case Codec::Bf16: codecs::encode_dense(args); break;
    case Codec::SignSGD: codecs::encode_signsgd(args); break;
    case Codec::TernGrad: codecs::encode_terngrad(args); break;
    case Codec::QSGD: codecs::encode_qsgd(args); break;
    case Codec::TopK: codecs::encode_topk(args); break;
    case Codec::RandomK: codecs::encode_randomk(args); break;
  }
}

std::string validate_payloads(const uint8_t* payloads, int64_t count, int64_t stride, int64_t out_numel,
                              DType out_dtype) {
  if (count < 1) return "no payloads to decode";
  if (stride < kHeaderBytes)
    return "payload of " + std::to_string(stride) + " bytes is shorter than the " +
           std::to_string(kHeaderBytes) + "-byte header (truncated or not a gradcomp payload)";
  PayloadHeader first;
  std::memcpy(&first, payloads, sizeof first);
  if (const char* problem = header_problem(first)) return std::string("payload 0: ") + problem;
  if (first.numel != out_numel || first.dtype != static_cast<uint8_t>(out_dtype))
    return "the payload holds " + std::to_string(first.numel) + " elements of dtype id " +
           std::to_string(first.dtype) + " but the output has " + std::to_string(out_numel) +
           " elements of dtype id " + std::to_string(static_cast<int>(out_dtype)) +
           " (ids: 0 float32, 1 float16, 2 bfloat16)";
  const int64_t expected = body_layout(first).total;
  if (stride != expected)
    return "payload holds " + std::to_string(stride) + " bytes but its header describes " +
           std::to_string(expected) + " (truncated, padded or corrupted payload)";
  for (int64_t p = 1; p < count; ++p) {
    if (std::memcmp(payloads + p * stride, &first, sizeof first) != 0)
      return "payload " + std::to_string(p) + " of " + std::to_string(count) +
             " has a header that differs from payload 0 (another codec, size, step or bucket)";
  }
  if (static_cast<Codec>(first.codec) == Codec::TopK) {
    for (int64_t p = 0; p < count; ++p) {
      std::string problem = codecs::validate_topk_indices(payloads + p * stride, first);
      if (!problem.empty()) return "payload " + std::to_string(p) + ": " + problem;
    }
  }
  return "";
}

void decode_sum_cpu(const DecodeArgs& args) {
  PayloadHeader h;
  std::memcpy(&h, args.payloads, sizeof h);
  switch (static_cast<Codec>(h.codec)) {
    case Codec::None:
    case Codec::Fp16:
    case Codec::Bf16: codecs::decode_dense(args, h); break;
    case Codec::SignSGD: codecs::decode_signsgd(args, h); break;
    case Codec::TernGrad: codecs::decode_terngrad(args, h); break;
    case Codec::QSGD: codecs::decode_qsgd(args, h); break;
    case Codec::TopK: codecs::decode_topk(args, h); break;
    case Codec::RandomK: codecs::decode_randomk(args, h); break;
  }
}

}  // namespace gradcomp
