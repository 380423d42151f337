// The CPU codecs on raw pointers: no torch here, so GoogleTest and fuzzers use them directly.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "../common/half.h"
#include "../common/random.h"
#include "../common/wire.h"

namespace gradcomp {

// Runs body over [0, count) cut into contiguous ranges of at least grain items, possibly on
// several threads at once (the torch bridge passes at::parallel_for). Every codec splits its work
// so that the result is the same bits whatever the ranges: per-range partial sums are combined in
// a fixed order, and random numbers are keyed by element, not by thread.
using RangeBody = std::function<void(int64_t begin, int64_t end)>;
using ParallelFor = void (*)(int64_t count, int64_t grain, const RangeBody& body);

struct EncodeArgs {
  PayloadHeader header;     // codec, dtype, numel, parameters and random key; copied to the payload
  uint32_t rank = 0;        // keys this rank's stochastic rounding
  const void* grad = nullptr;  // numel contiguous elements of header.dtype
  void* residual = nullptr;    // the same shape and dtype; nullptr: no error feedback
  uint8_t* payload = nullptr;  // body_layout(header).total bytes
  ParallelFor parallel_for = nullptr;  // nullptr: the calling thread does everything
  bool norm_scale = false;  // signsgd only: scale = root mean square of m, not mean |m| (see signsgd.cpp)
};

struct DecodeArgs {
  const uint8_t* payloads = nullptr;  // count payloads, one every stride bytes, all validated
  int64_t count = 0;
  int64_t stride = 0;
  void* out = nullptr;  // numel elements of the header's dtype, overwritten
  float alpha = 1.0f;   // out = sum of alpha * each decoded payload (alpha applied first)
  bool vote = false;    // signsgd only: majority vote of the signs, scaled by the summed scales
  ParallelFor parallel_for = nullptr;
};

PayloadHeader make_header(Codec codec, DType dtype, int64_t numel, int64_t param0, int64_t param1,
                          const RandomKey& key);

// Encodes grad (+ residual) into payload; with a residual, leaves grad + residual - decoded there.
void encode_cpu(const EncodeArgs& args);

// Checks what decode_sum_cpu relies on: every header well formed and equal to the first, the
// payload size exact, the element count and dtype those of the output, every index in range.
// Returns "" when the payloads are safe to decode into out_numel elements of out_dtype.
std::string validate_payloads(const uint8_t* payloads, int64_t count, int64_t stride, int64_t out_numel,
                              DType out_dtype);

void decode_sum_cpu(const DecodeArgs& args);

// What the DecodeProblem bits (common/wire.h) of a device-side check mean, in words.
std::string describe_decode_problems(uint32_t problems);

// Orthonormalizes the columns of a row-major rows x cols fp32 matrix in place (Gram-Schmidt with
// re-orthogonalization); a column whose norm after the projections falls below eps, or below
// 2^-16 of its original norm (it depended on the earlier columns), becomes zero.
void orthogonalize_cpu(float* matrix, int64_t rows, int64_t cols, float eps);

// out (rows x cols) = P (rows x rank) times Q (cols x rank) transposed, all row-major fp32: each
// element summed over the rank in order, so the bits are the same whatever the threads.
void low_rank_product_cpu(const float* p, const float* q, float* out, int64_t rows, int64_t cols, int64_t rank,
                          ParallelFor parallel_for);

// Per-codec entry points, one file each, compiled once per instruction-set variant into its own
// namespace; encode_cpu / decode_sum_cpu pick the variant the running CPU supports.
#define GRADCOMP_DECLARE_CODECS(ns)                                                 \
  namespace ns {                                                                    \
  void encode_dense(const EncodeArgs&);                                             \
  void decode_dense(const DecodeArgs&, const PayloadHeader&);                       \
  void encode_signsgd(const EncodeArgs&);                                           \
  void decode_signsgd(const DecodeArgs&, const PayloadHeader&);                     \
  void encode_terngrad(const EncodeArgs&);                                          \
  void decode_terngrad(const DecodeArgs&, const PayloadHeader&);                    \
  void encode_qsgd(const EncodeArgs&);                                              \
  void decode_qsgd(const DecodeArgs&, const PayloadHeader&);                        \
  void encode_topk(const EncodeArgs&);                                              \
  void decode_topk(const DecodeArgs&, const PayloadHeader&);                        \
  void encode_randomk(const EncodeArgs&);                                           \
  void decode_randomk(const DecodeArgs&, const PayloadHeader&);                     \
  }
GRADCOMP_DECLARE_CODECS(codecs_base)
GRADCOMP_DECLARE_CODECS(codecs_avx2)
GRADCOMP_DECLARE_CODECS(codecs_avx512)

struct CodecVariant {
  const char* isa;  // "base", "avx2" or "avx512"
  bool supported;   // whether the running CPU can execute it
  void (*encode[kNumCodecs])(const EncodeArgs&);
  void (*decode[kNumCodecs])(const DecodeArgs&, const PayloadHeader&);
};

// Every variant compiled into this build, from the portable one to the best.
std::vector<CodecVariant> codec_variants();

// Which variant encode_cpu / decode_sum_cpu use: "avx512", "avx2" or "base". The environment
// variable GRADCOMP_CPU_ISA=base or avx2, read once, caps it (for tests and comparisons).
const char* cpu_isa();

// A topk payload's k indices as int32, from either layout (wire.h), into indices (cleared first); or,
// when they are out of range, not strictly ascending, or compact counts that do not add up to k,
// why not (indices then holds those read before the fault). Shared by every variant.
std::string read_topk_indices(const uint8_t* payload, const PayloadHeader&, std::vector<int32_t>& indices);


}  // namespace gradcomp
