// The torch bridge: op schemas and their CPU and CUDA implementations. The only file that touches
// at::Tensor; everything below it works on raw pointers (csrc/cpu, cuda/). CUDA work goes on the
// current stream of the tensors' device, with no host-device synchronisation except where a
// caller asks decode_sum to check the payloads there and then (no status tensor given).
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../cpu/kernels.h"

#ifdef GRADCOMP_CUDA_KERNELS
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../../cuda/codecs.h"
#endif

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

// The codec whose wire name is exactly name: a name holding a NUL byte (which a C string would cut
// short, so that "none\0junk" read as "none") is refused like any other unknown name.
Codec codec_named(c10::string_view name) {
  const std::string text(name);
  const int id = text.find('\0') == std::string::npos ? codec_from_name(text.c_str()) : -1;
  if (id < 0) {
    std::string shown;  // the name as given, with control bytes escaped
    for (const char c : text) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(static_cast<unsigned char>(c)));
        shown += buf;
      } else {
        shown += c;
      }
    }
    TORCH_CHECK_VALUE(false, "gradcomp: unknown codec '", shown, "'; valid codecs: ", kValidCodecNames);
  }
  return static_cast<Codec>(id);
}

void check_header(const PayloadHeader& h, c10::string_view codec) {
  const char* problem = header_problem(h);
  TORCH_CHECK_VALUE(problem == nullptr, "gradcomp: invalid ", codec, " parameters: ", problem,
                    " (numel=", h.numel, ", param0=", h.param0, ", param1=", h.param1, ")");
}

void check_cuda_built(const at::Tensor& t) {
#ifndef GRADCOMP_CUDA_KERNELS
  TORCH_CHECK_VALUE(false, "gradcomp: this build has no CUDA codecs, and the tensor is on ", t.device(),
                    ". Rebuild gradcomp where the CUDA toolkit and a CUDA build of torch are installed "
                    "(GRADCOMP_CUDA=ON makes that a requirement), or pass CPU tensors.");
#else
  (void)t;
#endif
}

#ifdef GRADCOMP_CUDA_KERNELS
at::Tensor device_workspace(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, like.options().dtype(at::kByte));
}

void encode_cuda(const EncodeArgs& args, const at::Tensor& grad) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor workspace = device_workspace(cuda::encode_workspace_bytes(args.header), grad);
  cuda::EncodeParams p;
  p.header = args.header;
  p.rank = args.rank;
  p.grad = args.grad;
  p.residual = args.residual;
  p.payload = args.payload;
  p.workspace = workspace.data_ptr();
  p.norm_scale = args.norm_scale;
  C10_CUDA_CHECK(cuda::encode(p, c10::cuda::getCurrentCUDAStream(grad.device().index())));
}
#else
void encode_cuda(const EncodeArgs&, const at::Tensor& grad) { check_cuda_built(grad); }
#endif

// The residual's data pointer once it is checked against the gradient (nullptr: no error feedback).
void* checked_residual(const std::optional<at::Tensor>& residual, const at::Tensor& grad) {
  if (!residual.has_value()) return nullptr;
  const at::Tensor& r = *residual;
  TORCH_CHECK_VALUE(r.device() == grad.device(), "gradcomp: residual on ", r.device(),
                    " but the gradient on ", grad.device());
  TORCH_CHECK_VALUE(r.scalar_type() == grad.scalar_type() && r.numel() == grad.numel(),
                    "gradcomp: residual must match the gradient's dtype and element count; got ",
                    r.scalar_type(), "[", r.numel(), "] for ", grad.scalar_type(), "[", grad.numel(), "]");
  TORCH_CHECK_VALUE(r.is_contiguous(), "gradcomp: the residual must be contiguous (it is written in place)");
  TORCH_CHECK_VALUE(at::get_overlap_status(r, grad) == at::MemOverlapStatus::No,
                    "gradcomp: residual and gradient must be different tensors that share no memory");
  return r.data_ptr();
}

// The header of one payload, checked.
PayloadHeader checked_header(c10::string_view codec, DType dtype, int64_t numel, int64_t param0, int64_t param1,
                             int64_t seed, int64_t step, int64_t bucket, int64_t rank) {
  const RandomKey key{static_cast<uint64_t>(seed), as_u32(step, "step"), as_u32(bucket, "bucket"),
                      as_u32(rank, "rank")};
  const PayloadHeader header = make_header(codec_named(codec), dtype, numel, param0, param1, key);
  check_header(header, codec);
  return header;
}

// Encodes on the gradient's device; args hold the pointers and header.
void encode_on_device(EncodeArgs args, const at::Tensor& grad) {
  if (grad.is_cuda()) {
    encode_cuda(args, grad);
    return;
  }
  args.parallel_for = torch_parallel_for;
  encode_cpu(args);
}

at::Tensor encode(const at::Tensor& grad_in, const std::optional<at::Tensor>& residual,
                  c10::string_view codec, int64_t param0, int64_t param1, int64_t seed,
                  int64_t step, int64_t bucket, int64_t rank) {
  EncodeArgs args;
  args.header = checked_header(codec, wire_dtype(grad_in, "the gradient"), grad_in.numel(), param0, param1, seed,
                               step, bucket, rank);
  args.rank = static_cast<uint32_t>(rank);  // checked_header checked its range
  const at::Tensor grad = grad_in.contiguous();
  args.grad = grad.data_ptr();
  args.residual = checked_residual(residual, grad);
  at::Tensor payload = at::empty({body_layout(args.header).total}, grad.options().dtype(at::kByte));
  args.payload = payload.data_ptr<uint8_t>();
  encode_on_device(args, grad);
  return payload;
}

// [begin, end) of chunk j when numel elements are cut into count balanced chunks: numel / count
// elements each, one more for the first numel % count (torch.tensor_split's rule).
std::pair<int64_t, int64_t> chunk_range(int64_t numel, int64_t count, int64_t j) {
  const int64_t base = numel / count, extra = numel % count;
  const int64_t begin = j * base + std::min(j, extra);
  return {begin, begin + base + (j < extra ? 1 : 0)};
}

// The two-phase scheme's first step: grad (+ residual) cut into param0s.size() balanced chunks, chunk
// j encoded with param0s[j] and the random key's rank first_rank + j, the payloads back to back in
// chunk order (each a multiple of 16 bytes long, so each starts aligned). The same bits as encoding
// each chunk on its own; one op for the bucket, with no copy to concatenate.
at::Tensor encode_chunks(const at::Tensor& grad_in, const std::optional<at::Tensor>& residual,
                         c10::string_view codec, at::IntArrayRef param0s, int64_t param1, int64_t seed,
                         int64_t step, int64_t bucket, int64_t first_rank) {
  const int64_t count = static_cast<int64_t>(param0s.size());
  TORCH_CHECK_VALUE(count >= 1, "gradcomp: encode_chunks needs one param0 per chunk, got none");
  const DType dtype = wire_dtype(grad_in, "the gradient");
  const at::Tensor grad = grad_in.contiguous();
  void* residual_data = checked_residual(residual, grad);
  const int64_t itemsize = grad.element_size();
  std::vector<EncodeArgs> chunks(count);
  std::vector<int64_t> offsets(count);
  int64_t total = 0;
  for (int64_t j = 0; j < count; ++j) {
    const auto [begin, end] = chunk_range(grad.numel(), count, j);
    EncodeArgs& args = chunks[j];
    args.header = checked_header(codec, dtype, end - begin, param0s[j], param1, seed, step, bucket, first_rank + j);
    args.rank = static_cast<uint32_t>(first_rank + j);
    args.grad = static_cast<const uint8_t*>(grad.data_ptr()) + begin * itemsize;
    args.residual = residual_data ? static_cast<uint8_t*>(residual_data) + begin * itemsize : nullptr;
    offsets[j] = total;
    total += body_layout(args.header).total;
  }
  at::Tensor payloads = at::empty({total}, grad.options().dtype(at::kByte));
  for (int64_t j = 0; j < count; ++j) {
    chunks[j].payload = payloads.data_ptr<uint8_t>() + offsets[j];
    encode_on_device(chunks[j], grad);
  }
  return payloads;
}

#ifdef GRADCOMP_CUDA_KERNELS
// The payloads stay on the device: the host knows their layout from codec= and its parameters, and
// the device checks every header against it. With a status tensor, the problems found are OR-ed
// into it for the caller to read when it chooses; without one, they are read here (a sync) and raised.
void decode_cuda(const at::Tensor& stacked, at::Tensor& out, double alpha, bool vote,
                 std::optional<c10::string_view> codec, int64_t param0, int64_t param1,
                 const std::optional<at::Tensor>& status) {
  TORCH_CHECK_VALUE(codec.has_value(), "gradcomp: decoding payloads on ", out.device(),
                    " needs codec= and its parameters (the headers stay on the device); "
                    "gradcomp.codec(spec).decode_sum passes them");
  const PayloadHeader expected =
      make_header(codec_named(*codec), wire_dtype(out, "out"), out.numel(), param0, param1, RandomKey{});
  check_header(expected, *codec);
  TORCH_CHECK_VALUE(stacked.size(0) >= 1, "gradcomp: cannot decode: no payloads to decode");
  const int64_t expected_bytes = body_layout(expected).total;
  TORCH_CHECK_VALUE(stacked.size(1) == expected_bytes, "gradcomp: cannot decode: payloads of ", stacked.size(1),
                    " bytes, but ", *codec, " (param0=", param0, ", param1=", param1, ") makes ", expected_bytes,
                    " bytes for ", out.numel(), " elements of ", out.scalar_type());
  TORCH_CHECK_VALUE(!vote || static_cast<Codec>(expected.codec) == Codec::SignSGD,
                    "gradcomp: vote=True applies to signsgd payloads only, not ", *codec);
  const c10::cuda::CUDAGuard guard(out.device());
  at::Tensor problems = status.has_value() ? *status : at::zeros({1}, out.options().dtype(at::kInt));
  TORCH_CHECK_VALUE(problems.device() == out.device() && problems.scalar_type() == at::kInt &&
                        problems.numel() == 1 && problems.is_contiguous(),
                    "gradcomp: status must be one int32 element on ", out.device(), ", got ", problems.scalar_type(),
                    "[", problems.numel(), "] on ", problems.device());
  TORCH_CHECK_VALUE(at::get_overlap_status(problems, out) == at::MemOverlapStatus::No &&
                        at::get_overlap_status(problems, stacked) == at::MemOverlapStatus::No,
                    "gradcomp: status must not share memory with out or the payloads");
  const at::Tensor workspace = device_workspace(cuda::decode_workspace_bytes(expected, stacked.size(0)), out);
  cuda::DecodeParams p;
  p.expected = expected;
  p.payloads = stacked.data_ptr<uint8_t>();
  p.count = stacked.size(0);
  p.out = out.data_ptr();
  p.alpha = static_cast<float>(alpha);
  p.vote = vote;
  p.status = reinterpret_cast<uint32_t*>(problems.data_ptr<int32_t>());
  p.workspace = workspace.data_ptr();
  C10_CUDA_CHECK(cuda::decode_sum(p, c10::cuda::getCurrentCUDAStream(out.device().index())));
  if (!status.has_value()) {
    const auto found = static_cast<uint32_t>(problems.item<int32_t>());
    TORCH_CHECK_VALUE(found == 0, "gradcomp: cannot decode: ", describe_decode_problems(found),
                      " (the output was set to NaN)");
  }
}
#endif

// On the CPU, codec= (when given) must match what the headers say. which: what holds the header, for the message.
void check_expected_codec(const PayloadHeader& h, std::optional<c10::string_view> codec, int64_t param0,
                          int64_t param1, const std::string& which = "the payloads are") {
  if (!codec.has_value()) return;
  const Codec id = codec_named(*codec);
  TORCH_CHECK_VALUE(h.codec == static_cast<uint8_t>(id) && h.param0 == param0 && h.param1 == param1,
                    "gradcomp: cannot decode: ", which, " ", kCodecNames[h.codec], " (param0=", h.param0,
                    ", param1=", h.param1, ") but codec=", *codec, " (param0=", param0, ", param1=", param1,
                    ") was expected");
}

void decode_sum(const at::Tensor& payloads, at::Tensor& out, double alpha, bool vote,
                std::optional<c10::string_view> codec, int64_t param0, int64_t param1,
                const std::optional<at::Tensor>& status) {
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
  TORCH_CHECK_VALUE(out.is_contiguous(), "gradcomp: out must be contiguous (it is written in place)");
  TORCH_CHECK_VALUE(at::get_overlap_status(out, stacked) == at::MemOverlapStatus::No,
                    "gradcomp: out must not share memory with the payloads");
  if (out.is_cuda()) {
    check_cuda_built(out);
#ifdef GRADCOMP_CUDA_KERNELS
    decode_cuda(stacked, out, alpha, vote, codec, param0, param1, status);
#endif
    return;
  }
  DecodeArgs args;
  args.payloads = stacked.data_ptr<uint8_t>();
  args.count = stacked.size(0);
  args.stride = stacked.size(1);
  const std::string problem =
      validate_payloads(args.payloads, args.count, args.stride, out.numel(), wire_dtype(out, "out"));
  TORCH_CHECK_VALUE(problem.empty(), "gradcomp: cannot decode: ", problem);
  PayloadHeader h;
  std::memcpy(&h, args.payloads, sizeof h);
  check_expected_codec(h, codec, param0, param1);
  TORCH_CHECK_VALUE(!vote || static_cast<Codec>(h.codec) == Codec::SignSGD,
                    "gradcomp: vote=True applies to signsgd payloads only, not ", kCodecNames[h.codec]);
  args.out = out.data_ptr();
  args.alpha = static_cast<float>(alpha);
  args.vote = vote;
  args.parallel_for = torch_parallel_for;
  decode_sum_cpu(args);
}

// The two-phase scheme's last step: row j of rows [count, width] holds chunk j's payload in its
// first bytes (the re-encoded chunks, gathered), decoded into chunk j of out (the chunks of
// encode_chunks). The rows must carry one random key (seed, step, bucket), as decode_sum's payloads do.
// On the CPU every row is checked before any chunk is written, and a refusal names the row. On CUDA
// the checks run on the device (a bad row sets the output to NaN and its problem into status);
// without a status tensor they are read once, at the end.
void decode_chunks(const at::Tensor& rows, at::Tensor& out, bool vote, c10::string_view codec,
                   at::IntArrayRef param0s, int64_t param1, const std::optional<at::Tensor>& status) {
  const int64_t count = static_cast<int64_t>(param0s.size());
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(0) == count,
                    "gradcomp: decode_chunks takes one row per chunk: rows of shape [", count, ", bytes], got ",
                    rows.sizes());
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kByte, "gradcomp: rows must be uint8, got ", rows.scalar_type());
  TORCH_CHECK_VALUE(rows.device() == out.device(), "gradcomp: rows on ", rows.device(), " but out on ", out.device());
  TORCH_CHECK_VALUE(out.dim() == 1, "gradcomp: decode_chunks writes a flat output, got ", out.dim(), " dimensions");
  const DType dtype = wire_dtype(out, "out");
  std::vector<int64_t> sizes(count);
  for (int64_t j = 0; j < count; ++j) {
    const auto [begin, end] = chunk_range(out.numel(), count, j);
    const PayloadHeader expected = make_header(codec_named(codec), dtype, end - begin, param0s[j], param1, RandomKey{});
    check_header(expected, codec);  // before body_layout, which divides by a block
    sizes[j] = body_layout(expected).total;
    TORCH_CHECK_VALUE(sizes[j] <= rows.size(1), "gradcomp: chunk ", j, "'s payload takes ", sizes[j],
                      " bytes, but the rows hold ", rows.size(1));
  }
  if (out.is_cuda()) {
    std::optional<at::Tensor> problems = status;
    if (!status.has_value()) problems = at::zeros({1}, out.options().dtype(at::kInt));
    for (int64_t j = 0; j < count; ++j) {
      const auto [begin, end] = chunk_range(out.numel(), count, j);
      at::Tensor chunk = out.narrow(0, begin, end - begin);
      decode_sum(rows[j].narrow(0, 0, sizes[j]), chunk, 1.0, vote, codec, param0s[j], param1, problems);
    }
#ifdef GRADCOMP_CUDA_KERNELS
    // Each decode compared its own row's key; the rows must also agree with row 0 (seed, step and bucket:
    // the header's last 16 bytes), checked on the device.
    const at::Tensor keys = rows.narrow(1, kHeaderBytes - 16, 16);
    const at::Tensor differ = keys.ne(keys.narrow(0, 0, 1)).any();
    problems->bitwise_or_(differ.to(at::kInt) * static_cast<int32_t>(kHeadersDiffer));
    out.masked_fill_(differ, std::numeric_limits<float>::quiet_NaN());
    if (!status.has_value()) {
      const auto found = static_cast<uint32_t>(problems->item<int32_t>());
      TORCH_CHECK_VALUE(found == 0, "gradcomp: cannot decode: ", describe_decode_problems(found),
                        " (the output was set to NaN)");
    }
#endif
    return;
  }
  const at::Tensor contiguous = rows.contiguous();
  const uint8_t* base = contiguous.data_ptr<uint8_t>();
  PayloadHeader first{};
  for (int64_t j = 0; j < count; ++j) {
    const auto [begin, end] = chunk_range(out.numel(), count, j);
    const uint8_t* row = base + j * contiguous.size(1);
    const std::string which = "row " + std::to_string(j) + " of " + std::to_string(count);
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(row) % kPayloadAlign == 0, "gradcomp: cannot decode: ", which,
                      " does not start on a ", kPayloadAlign, "-byte boundary (rows of ", contiguous.size(1),
                      " bytes)");
    const std::string problem = validate_payloads(row, 1, sizes[j], end - begin, dtype);
    TORCH_CHECK_VALUE(problem.empty(), "gradcomp: cannot decode: ", which, " (chunk ", j, "): ", problem,
                      "; nothing was written");
    PayloadHeader h;
    std::memcpy(&h, row, sizeof h);
    check_expected_codec(h, codec, param0s[j], param1, which + "'s payload is");
    if (j == 0) first = h;
    TORCH_CHECK_VALUE(h.seed == first.seed && h.step == first.step && h.bucket == first.bucket,
                      "gradcomp: cannot decode: ", which, " carries seed ", h.seed, ", step ", h.step, ", bucket ",
                      h.bucket, " but row 0 seed ", first.seed, ", step ", first.step, ", bucket ", first.bucket,
                      " (a payload of another step or bucket); nothing was written");
  }
  TORCH_CHECK_VALUE(!vote || codec_named(codec) == Codec::SignSGD,
                    "gradcomp: vote=True applies to signsgd payloads only, not ", codec);
  TORCH_CHECK_VALUE(out.is_contiguous(), "gradcomp: out must be contiguous (it is written in place)");
  TORCH_CHECK_VALUE(at::get_overlap_status(out, contiguous) == at::MemOverlapStatus::No,
                    "gradcomp: out must not share memory with the rows");
  for (int64_t j = 0; j < count; ++j) {
    const auto [begin, end] = chunk_range(out.numel(), count, j);
    DecodeArgs args;
    args.payloads = base + j * contiguous.size(1);
    args.count = 1;
    args.stride = sizes[j];
    args.out = static_cast<uint8_t*>(out.data_ptr()) + begin * out.element_size();
    args.alpha = 1.0f;
    args.vote = vote;
    args.parallel_for = torch_parallel_for;
    decode_sum_cpu(args);
  }
}

// The two-phase owner's step: average = the sum of alpha times each of its chunk's payloads, then that
// average (+ the owner's residual) encoded again, returned. signsgd summing signs re-encodes with each
// block's root mean square as its scale (norm_scale, csrc/cpu/signsgd.cpp): a sum of signs that partly cancel
// spreads its magnitudes, and mean |m| would shrink what every element carries.
at::Tensor reencode_sum(const at::Tensor& payloads, at::Tensor& average, const std::optional<at::Tensor>& residual,
                        double alpha, bool vote, c10::string_view codec, int64_t param0, int64_t param1,
                        int64_t seed, int64_t step, int64_t bucket, int64_t rank,
                        const std::optional<at::Tensor>& status) {
  EncodeArgs args;
  args.header = checked_header(codec, wire_dtype(average, "average"), average.numel(), param0, param1, seed, step,
                               bucket, rank);
  args.rank = static_cast<uint32_t>(rank);
  args.norm_scale = static_cast<Codec>(args.header.codec) == Codec::SignSGD && !vote;
  args.residual = checked_residual(residual, average);
  decode_sum(payloads, average, alpha, vote, codec, param0, param1, status);
  args.grad = average.data_ptr();
  at::Tensor payload = at::empty({body_layout(args.header).total}, average.options().dtype(at::kByte));
  args.payload = payload.data_ptr<uint8_t>();
  encode_on_device(args, average);
  return payload;
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
  if (matrix.is_cuda()) {
    check_cuda_built(matrix);
#ifdef GRADCOMP_CUDA_KERNELS
    TORCH_CHECK_VALUE(cols <= 3072, "gradcomp: orthogonalize_ on CUDA takes at most 3072 columns, got ", cols);
    const c10::cuda::CUDAGuard guard(matrix.device());
    C10_CUDA_CHECK(cuda::orthogonalize(data, batch, rows, cols, static_cast<float>(eps),
                                       c10::cuda::getCurrentCUDAStream(matrix.device().index())));
#endif
    return;
  }
  for (int64_t b = 0; b < batch; ++b) orthogonalize_cpu(data + b * rows * cols, rows, cols, static_cast<float>(eps));
}

// out = P Q^T over the last two dimensions ([rows, rank] and [cols, rank], or batches of them): PowerSGD's
// decode. On the CPU, the same bits whatever torch's thread count (see low_rank_product.cpp); on CUDA, cuBLAS's
// product, whose bits are fixed for a GPU model.
void low_rank_product(const at::Tensor& p, const at::Tensor& q, at::Tensor& out) {
  for (const auto& [tensor, name] : {std::pair{&p, "p"}, {&q, "q"}, {&out, "out"}}) {
    TORCH_CHECK_VALUE(tensor->scalar_type() == at::kFloat, "gradcomp: low_rank_product takes float32, got ",
                      tensor->scalar_type(), " for ", name);
    TORCH_CHECK_VALUE(tensor->dim() == p.dim() && (p.dim() == 2 || p.dim() == 3),
                      "gradcomp: low_rank_product takes matrices or batches of them, alike; got ", p.dim(), ", ",
                      q.dim(), " and ", out.dim(), " dimensions");
    TORCH_CHECK_VALUE(tensor->is_contiguous(), "gradcomp: low_rank_product needs contiguous tensors, not ", name);
    TORCH_CHECK_VALUE(tensor->device() == out.device(), "gradcomp: low_rank_product's ", name, " is on ",
                      tensor->device(), ", out on ", out.device());
  }
  const int64_t rows = p.size(-2), rank = p.size(-1), cols = q.size(-2);
  const int64_t batch = p.dim() == 3 ? p.size(0) : 1;
  TORCH_CHECK_VALUE(q.size(-1) == rank && out.size(-2) == rows && out.size(-1) == cols &&
                        (p.dim() == 2 || (q.size(0) == batch && out.size(0) == batch)),
                    "gradcomp: low_rank_product of p ", p.sizes(), " and q ", q.sizes(), " cannot fill out ",
                    out.sizes(), " (out = p q^T)");
  if (out.is_cuda()) {
    at::matmul_out(out, p, q.transpose(-2, -1));
    return;
  }
  for (int64_t b = 0; b < batch; ++b)
    low_rank_product_cpu(p.data_ptr<float>() + b * rows * rank, q.data_ptr<float>() + b * cols * rank,
                         out.data_ptr<float>() + b * rows * cols, rows, cols, rank, torch_parallel_for);
}

}  // namespace

TORCH_LIBRARY(gradcomp, m) {
  m.def("encode(Tensor grad, Tensor(a!)? residual, str codec, int param0=0, int param1=0, int seed=0, "
        "int step=0, int bucket=0, int rank=0) -> Tensor");
  m.def("decode_sum(Tensor payloads, Tensor(a!) out, float alpha=1.0, bool vote=False, str? codec=None, "
        "int param0=0, int param1=0, Tensor(b!)? status=None) -> ()");
  m.def("orthogonalize_(Tensor(a!) matrix, float eps=0.0) -> ()");
  m.def("low_rank_product(Tensor p, Tensor q, Tensor(a!) out) -> ()");
  m.def("encode_chunks(Tensor grad, Tensor(a!)? residual, str codec, int[] param0s, int param1=0, int seed=0, "
        "int step=0, int bucket=0, int first_rank=0) -> Tensor");
  m.def("reencode_sum(Tensor payloads, Tensor(a!) average, Tensor(b!)? residual, float alpha, bool vote, str codec, "
        "int param0=0, int param1=0, int seed=0, int step=0, int bucket=0, int rank=0, Tensor(c!)? status=None) "
        "-> Tensor");
  m.def("decode_chunks(Tensor rows, Tensor(a!) out, bool vote, str codec, int[] param0s, int param1=0, "
        "Tensor(b!)? status=None) -> ()");
}

TORCH_LIBRARY_IMPL(gradcomp, CPU, m) {
  m.impl("encode", &encode);
  m.impl("decode_sum", &decode_sum);
  m.impl("orthogonalize_", &orthogonalize_);
  m.impl("low_rank_product", &low_rank_product);
  m.impl("encode_chunks", &encode_chunks);
  m.impl("reencode_sum", &reencode_sum);
  m.impl("decode_chunks", &decode_chunks);
}

// Registered in every build: without the CUDA codecs, CUDA tensors get a clear error, not a
// missing-kernel one.
TORCH_LIBRARY_IMPL(gradcomp, CUDA, m) {
  m.impl("encode", &encode);
  m.impl("decode_sum", &decode_sum);
  m.impl("orthogonalize_", &orthogonalize_);
  m.impl("low_rank_product", &low_rank_product);
  m.impl("encode_chunks", &encode_chunks);
  m.impl("reencode_sum", &reencode_sum);
  m.impl("decode_chunks", &decode_chunks);
}

}  // namespace gradcomp
