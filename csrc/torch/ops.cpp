// The torch bridge: op schemas and their CPU implementations. The only file that touches
// at::Tensor; everything below it works on raw pointers (csrc/cpu, cuda/).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../cpu/kernels.h"

namespace gradcomp {
namespace {

// The kernels' ParallelFor on torch's intra-op thread pool (torch.set_num_threads applies).
void torch_parallel_for(int64_t count, int64_t grain, const RangeBody& body) {
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) { body(begin, end); });
}

DType wire_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default:
      TORCH_CHECK_VALUE(false, "gradcomp: ", what, " has dtype ", t.scalar_type(),
                        "; supported dtypes are float32, float16 and bfloat16");
  }
  return DType::F32;
}

uint32_t as_u32(int64_t value, const char* what) {
  TORCH_CHECK_VALUE(value >= 0 && value <= 0xFFFFFFFFLL, "gradcomp: ", what, "=", value,
                    " must lie in [0, 2^32)");
  return static_cast<uint32_t>(value);
}

Codec codec_named(c10::string_view name) {
  const int id = codec_from_name(std::string(name).c_str());
  TORCH_CHECK_VALUE(id >= 0, "gradcomp: unknown codec '", name, "'; valid codecs: ", kValidCodecNames);
  return static_cast<Codec>(id);
}

void check_header(const PayloadHeader& h, c10::string_view codec) {
  const char* problem = header_problem(h);
  TORCH_CHECK_VALUE(problem == nullptr, "gradcomp: invalid ", codec, " parameters: ", problem,
                    " (numel=", h.numel, ", param0=", h.param0, ", param1=", h.param1, ")");
}

at::Tensor encode(const at::Tensor& grad_in, const std::optional<at::Tensor>& residual,
                  c10::string_view codec, int64_t param0, int64_t param1, int64_t seed,
                  int64_t step, int64_t bucket, int64_t rank) {
  const DType dtype = wire_dtype(grad_in, "the gradient");
  const RandomKey key{static_cast<uint64_t>(seed), as_u32(step, "step"), as_u32(bucket, "bucket"),
                      as_u32(rank, "rank")};
  EncodeArgs args;
  args.header = make_header(codec_named(codec), dtype, grad_in.numel(), param0, param1, key);
  check_header(args.header, codec);
  args.rank = key.rank;
  const at::Tensor grad = grad_in.contiguous();
  args.grad = grad.data_ptr();
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK_VALUE(r.device() == grad.device(), "gradcomp: residual on ", r.device(),
                      " but the gradient on ", grad.device());
    TORCH_CHECK_VALUE(r.scalar_type() == grad.scalar_type() && r.numel() == grad.numel(),
                      "gradcomp: residual must match the gradient's dtype and element count; got ",
                      r.scalar_type(), "[", r.numel(), "] for ", grad.scalar_type(), "[", grad.numel(), "]");
    TORCH_CHECK_VALUE(r.is_contiguous(), "gradcomp: the residual must be contiguous (it is written in place)");
    TORCH_CHECK_VALUE(at::get_overlap_status(r, grad) == at::MemOverlapStatus::No,
                      "gradcomp: residual and gradient must be different tensors that share no memory");
    args.residual = r.data_ptr();
  }
  at::Tensor payload = at::empty({body_layout(args.header).total}, grad.options().dtype(at::kByte));
  args.payload = payload.data_ptr<uint8_t>();
  args.parallel_for = torch_parallel_for;
  encode_cpu(args);
  return payload;
}

void decode_sum(const at::Tensor& payloads, at::Tensor& out, double alpha, bool vote) {
  TORCH_CHECK_VALUE(payloads.scalar_type() == at::kByte, "gradcomp: payloads must be uint8, got ",
                    payloads.scalar_type());
  TORCH_CHECK_VALUE(payloads.dim() == 1 || payloads.dim() == 2,
                    "gradcomp: payloads must be one payload [bytes] or a stack [count, bytes]; got ",
                    payloads.dim(), " dimensions");
  TORCH_CHECK_VALUE(payloads.device() == out.device(), "gradcomp: payloads on ", payloads.device(),
                    " but out on ", out.device());
  const at::Tensor stacked = (payloads.dim() == 1 ? payloads.unsqueeze(0) : payloads).contiguous();
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(stacked.data_ptr()) % kPayloadAlign == 0,
                    "gradcomp: payloads must start on a ", kPayloadAlign, "-byte boundary");
  DecodeArgs args;
  args.payloads = stacked.data_ptr<uint8_t>();
  args.count = stacked.size(0);
  args.stride = stacked.size(1);
  const std::string problem =
      validate_payloads(args.payloads, args.count, args.stride, out.numel(), wire_dtype(out, "out"));
  TORCH_CHECK_VALUE(problem.empty(), "gradcomp: cannot decode: ", problem);
  PayloadHeader h;
  std::memcpy(&h, args.payloads, sizeof h);
  TORCH_CHECK_VALUE(out.is_contiguous(), "gradcomp: out must be contiguous (it is written in place)");
  TORCH_CHECK_VALUE(at::get_overlap_status(out, stacked) == at::MemOverlapStatus::No,
                    "gradcomp: out must not share memory with the payloads");
  TORCH_CHECK_VALUE(!vote || static_cast<Codec>(h.codec) == Codec::SignSGD,
                    "gradcomp: vote=True applies to signsgd payloads only, not ", kCodecNames[h.codec]);
  args.out = out.data_ptr();
  args.alpha = static_cast<float>(alpha);
  args.vote = vote;
  args.parallel_for = torch_parallel_for;
  decode_sum_cpu(args);
}

void orthogonalize_(at::Tensor& matrix, double eps) {
  TORCH_CHECK_VALUE(matrix.scalar_type() == at::kFloat, "gradcomp: orthogonalize_ takes float32, got ",
                    matrix.scalar_type());
  TORCH_CHECK_VALUE(matrix.dim() == 2 || matrix.dim() == 3,
                    "gradcomp: orthogonalize_ takes [rows, cols] or [batch, rows, cols], got ", matrix.dim(),
                    " dimensions");
  TORCH_CHECK_VALUE(matrix.is_contiguous(), "gradcomp: orthogonalize_ needs a contiguous matrix");
  const int64_t rows = matrix.size(-2), cols = matrix.size(-1);
  const int64_t batch = matrix.dim() == 3 ? matrix.size(0) : 1;
  float* data = matrix.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) orthogonalize_cpu(data + b * rows * cols, rows, cols, static_cast<float>(eps));
}

}  // namespace

TORCH_LIBRARY(gradcomp, m) {
  m.def("encode(Tensor grad, Tensor(a!)? residual, str codec, int param0=0, int param1=0, int seed=0, "
        "int step=0, int bucket=0, int rank=0) -> Tensor");
  m.def("decode_sum(Tensor payloads, Tensor(a!) out, float alpha=1.0, bool vote=False) -> ()");
  m.def("orthogonalize_(Tensor(a!) matrix, float eps=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(gradcomp, CPU, m) {
  m.impl("encode", &encode);
  m.impl("decode_sum", &decode_sum);
  m.impl("orthogonalize_", &orthogonalize_);
}

}  // namespace gradcomp
