// Codec dispatch and payload validation for the CPU path.
#include <cstdlib>
#include <cstring>

#include "kernels.h"

namespace gradcomp {
namespace {

#define GRADCOMP_CODEC_VARIANT(ns, name, supported)                                                  \
  CodecVariant{name, supported,                                                                   \
               {ns::encode_dense, ns::encode_dense, ns::encode_dense, ns::encode_signsgd,           \
                ns::encode_terngrad, ns::encode_qsgd, ns::encode_topk, ns::encode_randomk},         \
               {ns::decode_dense, ns::decode_dense, ns::decode_dense, ns::decode_signsgd,           \
                ns::decode_terngrad, ns::decode_qsgd, ns::decode_topk, ns::decode_randomk}}

// The CPU runs code built with -march=x86-64-v3 (avx2) or -march=x86-64-v4 (avx512).
bool cpu_has(const char* feature_set) {
#if defined(__x86_64__) && defined(GRADCOMP_X86_VARIANTS)
  __builtin_cpu_init();
#if defined(__clang__) && __clang_major__ < 16  // no "x86-64-vN" names yet: the features that matter
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                  __builtin_cpu_supports("avx512cd");
#else
  const bool v3 = __builtin_cpu_supports("x86-64-v3");
  const bool v4 = __builtin_cpu_supports("x86-64-v4");
#endif
  if (std::strcmp(feature_set, "avx2") == 0) return v3;
  if (std::strcmp(feature_set, "avx512") == 0) return v4;
#endif
  (void)feature_set;
  return false;
}

const CodecVariant& codec_table() {
  static const CodecVariant table = [] {
    // GRADCOMP_CPU_ISA caps the variant (base < avx2 < avx512); unset means the best the CPU has.
    const char* cap = std::getenv("GRADCOMP_CPU_ISA");
    const std::vector<CodecVariant> variants = codec_variants();  // best last
    for (auto v = variants.rbegin(); v != variants.rend(); ++v) {
      if (!v->supported) continue;
      if (cap && std::strcmp(cap, "base") == 0 && std::strcmp(v->isa, "base") != 0) continue;
      if (cap && std::strcmp(cap, "avx2") == 0 && std::strcmp(v->isa, "avx512") == 0) continue;
      return *v;
    }
    return variants.front();
  }();
  return table;
}

}  // namespace

std::vector<CodecVariant> codec_variants() {
  std::vector<CodecVariant> variants{GRADCOMP_CODEC_VARIANT(codecs_base, "base", true)};
#if defined(GRADCOMP_X86_VARIANTS)
  variants.push_back(GRADCOMP_CODEC_VARIANT(codecs_avx2, "avx2", cpu_has("avx2")));
  variants.push_back(GRADCOMP_CODEC_VARIANT(codecs_avx512, "avx512", cpu_has("avx512")));
#endif
  return variants;
}

const char* cpu_isa() { return codec_table().isa; }

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
  codec_table().encode[args.header.codec](args);
}

namespace {

// Why index, at position j after previous, is not a valid topk index (it is out of range or not ascending).
std::string index_problem(int64_t index, int64_t j, int64_t previous, int64_t n) {
  if (index < 0 || index >= n)
    return "index " + std::to_string(index) + " at position " + std::to_string(j) + " is outside [0, " +
           std::to_string(n) + ")";
  return "index " + std::to_string(index) + " at position " + std::to_string(j) + " does not follow " +
         std::to_string(previous) + " (indices must be strictly ascending)";
}

}  // namespace

std::string read_topk_indices(const uint8_t* payload, const PayloadHeader& h, std::vector<int32_t>& indices) {
  const BodyLayout layout = body_layout(h);
  const int64_t k = h.param0;
  indices.clear();
  indices.reserve(k);
  int64_t previous = -1;  // indices must be strictly ascending: in range and each at most once
  if (h.param1 != kTopkCompact) {
    for (int64_t j = 0; j < k; ++j) {
      int32_t index;
      std::memcpy(&index, payload + layout.codes + 4 * j, sizeof index);
      if (index < 0 || index >= h.numel || index <= previous) return index_problem(index, j, previous, h.numel);
      indices.push_back(index);
      previous = index;
    }
    return "";
  }
  const int64_t spans = ceil_div(h.numel, kCompactSpan);
  for (int64_t span = 0; span < spans; ++span) {
    uint32_t count;
    std::memcpy(&count, payload + layout.scales + 4 * span, sizeof count);
    const int64_t j0 = static_cast<int64_t>(indices.size());
    if (count > static_cast<uint64_t>(k - j0))
      return "the counts per span of " + std::to_string(kCompactSpan) + " elements reach past k = " +
             std::to_string(k) + " at span " + std::to_string(span);
    for (int64_t j = j0; j < j0 + count; ++j) {
      uint16_t low;
      std::memcpy(&low, payload + layout.codes + 2 * j, sizeof low);
      const int64_t index = span * kCompactSpan + low;
      if (index >= h.numel || index <= previous) return index_problem(index, j, previous, h.numel);
      indices.push_back(static_cast<int32_t>(index));
      previous = index;
    }
  }
  if (static_cast<int64_t>(indices.size()) != k)
    return "the counts per span of " + std::to_string(kCompactSpan) + " elements add up to " +
           std::to_string(indices.size()) + ", not k = " + std::to_string(k);
  return "";
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
    std::vector<int32_t> indices;
    for (int64_t p = 0; p < count; ++p) {
      std::string problem = read_topk_indices(payloads + p * stride, first, indices);
      if (!problem.empty()) return "payload " + std::to_string(p) + ": " + problem;
    }
  }
  return "";
}

std::string describe_decode_problems(uint32_t problems) {
  std::string text;
  const auto add = [&](uint32_t bit, const char* what) {
    if (problems & bit) text += (text.empty() ? "" : "; ") + std::string(what);
  };
  add(kHeaderNotExpected, "a payload header is not the expected one (not a gradcomp payload, or another codec, "
                          "dtype, element count or parameters)");
  add(kHeadersDiffer, "the payloads carry different random keys (seed, step or bucket)");
  add(kIndexInvalid, "a topk index is out of range or not strictly ascending, or compact counts do not add up "
                     "to k");
  if (problems & ~uint32_t{kHeaderNotExpected | kHeadersDiffer | kIndexInvalid}) add(problems, "unknown problem bits");
  return text.empty() ? "no problem" : text;
}

void decode_sum_cpu(const DecodeArgs& args) {
  PayloadHeader h;
  std::memcpy(&h, args.payloads, sizeof h);
  codec_table().decode[h.codec](args, h);
}

}  // namespace gradcomp
