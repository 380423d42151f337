// Dispatch of the CUDA codecs, the payload header and padding, and the device-side payload checks.
#include "device.cuh"

namespace gradcomp::cuda {
namespace {

using EncodeFn = cudaError_t (*)(const EncodeParams&, cudaStream_t);
using DecodeFn = void (*)(const DecodeParams&, cudaStream_t);

// The codecs whose launches can only fail the runtime's way (reported by cudaGetLastError).
template <void (*kEncodeCodec)(const EncodeParams&, cudaStream_t)>
cudaError_t launches_only(const EncodeParams& p, cudaStream_t stream) {
  kEncodeCodec(p, stream);
  return cudaSuccess;
}

constexpr EncodeFn kEncode[kNumCodecs] = {
    launches_only<encode_dense>, launches_only<encode_dense>,    launches_only<encode_dense>,
    launches_only<encode_signsgd>, launches_only<encode_terngrad>, launches_only<encode_qsgd>,
    encode_topk,                   launches_only<encode_randomk>};
constexpr DecodeFn kDecode[kNumCodecs] = {decode_dense,    decode_dense, decode_dense, decode_signsgd,
                                          decode_terngrad, decode_qsgd,  decode_topk,  decode_randomk};

// The header (by value) and the zero padding after the body.
__global__ void write_header(PayloadHeader header, uint8_t* payload, int64_t end, int64_t total) {
  const int t = threadIdx.x;
  if (t < kHeaderBytes) payload[t] = reinterpret_cast<const uint8_t*>(&header)[t];
  if (end + t < total) payload[end + t] = 0;
}

// validate_payloads on the device, one thread per payload: the header must be the expected one,
// and carry payload 0's random key.
__global__ void check_headers(const uint8_t* payloads, int64_t count, int64_t stride, PayloadHeader expected,
                              uint32_t* status) {
  GC_GRID_LOOP(p, count) {
    const PayloadHeader& h = *reinterpret_cast<const PayloadHeader*>(payloads + p * stride);
    const PayloadHeader& first = *reinterpret_cast<const PayloadHeader*>(payloads);
    uint32_t problems = 0;
    if (h.magic != kMagic || h.version != kFormatVersion || h.codec != expected.codec || h.dtype != expected.dtype ||
        h.reserved != 0 || h.numel != expected.numel || h.param0 != expected.param0 || h.param1 != expected.param1)
      problems |= kHeaderNotExpected;
    if (h.seed != first.seed || h.step != first.step || h.bucket != first.bucket) problems |= kHeadersDiffer;
    if (problems) atomicOr(status, problems);
  }
}

// After a failed check of this call's payloads, the whole output becomes NaN.
template <typename T>
__global__ void poison_if_invalid(const uint32_t* problems, T* out, int64_t n) {
  if (*problems == 0) return;
  GC_GRID_LOOP(i, n) out[i] = from_float<T>(__int_as_float(0x7FC00000));
}

__global__ void report_problems(const uint32_t* problems, uint32_t* status) {
  if (*problems) atomicOr(status, *problems);
}

// The decode workspace: this call's own problem word first (the caller's status word may already
// hold an earlier call's problems), then the codec's part.
constexpr size_t kProblemWordBytes = 256;

}  // namespace

size_t encode_workspace_bytes(const PayloadHeader& h) {
  switch (static_cast<Codec>(h.codec)) {
    case Codec::SignSGD: return signsgd_encode_workspace(h);
    case Codec::TernGrad: return terngrad_encode_workspace(h);
    case Codec::QSGD: return qsgd_encode_workspace(h);
    case Codec::TopK: return topk_encode_workspace(h);
    default: return 0;
  }
}

size_t decode_workspace_bytes(const PayloadHeader& h, int64_t count) {
  return kProblemWordBytes + (static_cast<Codec>(h.codec) == Codec::TopK ? topk_decode_workspace(h, count) : 0);
}

cudaError_t encode(const EncodeParams& p, cudaStream_t stream) {
  const BodyLayout layout = body_layout(p.header);
  write_header<<<1, 64, 0, stream>>>(p.header, p.payload, layout.end, layout.total);
  const cudaError_t error = kEncode[p.header.codec](p, stream);
  return error != cudaSuccess ? error : cudaGetLastError();
}

cudaError_t decode_sum(const DecodeParams& params, cudaStream_t stream) {
  const PayloadHeader& h = params.expected;
  const int64_t stride = body_layout(h).total;
  uint32_t* problems = static_cast<uint32_t*>(params.workspace);
  DecodeParams d = params;
  d.workspace = static_cast<uint8_t*>(params.workspace) + kProblemWordBytes;
  cudaMemsetAsync(problems, 0, sizeof(uint32_t), stream);
  check_headers<<<blocks_for(d.count), kThreads, 0, stream>>>(d.payloads, d.count, stride, h, problems);
  if (static_cast<Codec>(h.codec) == Codec::TopK) check_topk(d, problems, stream);
  kDecode[h.codec](d, stream);
  if (h.numel > 0) {
    visit_dtype(static_cast<DType>(h.dtype), [&](auto* t) {
      using T = Elem<decltype(t)>;
      poison_if_invalid<<<blocks_for(h.numel), kThreads, 0, stream>>>(problems, static_cast<T*>(d.out), h.numel);
    });
  }
  report_problems<<<1, 1, 0, stream>>>(problems, d.status);
  return cudaGetLastError();
}

}  // namespace gradcomp::cuda
