// libFuzzer target: one codec's validate-then-decode-and-sum on arbitrary bytes, on every
// instruction-set variant this CPU runs. Built once per codec (GC_FUZZ_CODEC is its wire id) with
// AddressSanitizer and UndefinedBehaviorSanitizer: any out-of-bounds access, overflow or misaligned
// load in the decoders is a finding.
//
// Input: one control byte, then the payload bytes, cut into `count` equal payloads.
//   control bits 0-1: count - 1;  bit 2: vote (signsgd only);  bit 3: ask for one output element
//   more than the header says;  bit 4: ask for float32 output whatever the header says.
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/kernels.h"

using namespace gradcomp;

namespace {
constexpr int64_t kMaxOutputElements = int64_t{1} << 20;  // larger claimed sizes are refused unread
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t control = data[0];
  const int64_t count = 1 + (control & 3);
  const int64_t stride = static_cast<int64_t>(size - 1) / count;
  std::vector<uint8_t> payloads(data + 1, data + 1 + stride * count);
  if (stride > 5) payloads[5] = GC_FUZZ_CODEC;  // the first payload's codec byte: keep to this target's decoder

  PayloadHeader header{};
  if (stride >= kHeaderBytes) std::memcpy(&header, payloads.data(), sizeof header);
  int64_t out_numel = header.numel;
  if ((control & 8) && out_numel <= kMaxOutputElements) out_numel += 1;  // never past INT64_MAX
  const DType out_dtype = (control & 16) || header.dtype >= kNumDTypes ? DType::F32 : static_cast<DType>(header.dtype);
  if (out_numel < 0 || out_numel > kMaxOutputElements) out_numel = 0;

  // The output is exactly as large as claimed, so ASan sees any write past it.
  std::vector<uint8_t> out(static_cast<size_t>(out_numel * dtype_bytes(out_dtype)));
  const uint8_t* first = payloads.empty() ? data : payloads.data();  // never null, even when empty
  if (!validate_payloads(first, payloads.empty() ? 0 : count, stride, out_numel, out_dtype).empty()) return 0;

  DecodeArgs args;
  args.payloads = payloads.data();
  args.count = count;
  args.stride = stride;
  args.out = out.data();
  args.alpha = 0.5f;
  args.vote = (control & 4) && header.codec == static_cast<uint8_t>(Codec::SignSGD);
  for (const CodecVariant& variant : codec_variants()) {
    if (variant.supported) variant.decode[header.codec](args, header);
  }
  return 0;
}
