// gradcomp._C: loading it registers the torch.ops.gradcomp ops (ops.cpp); the functions here are
// the plain, tensor-free helpers the Python layer needs.
#include <pybind11/pybind11.h>

#include "../cpu/kernels.h"

namespace py = pybind11;
using namespace gradcomp;

namespace {

// Exact payload bytes for a codec (wire name), dtype id, element count and parameters.
int64_t payload_nbytes(const std::string& codec, int dtype, int64_t numel, int64_t param0, int64_t param1) {
  const int id = codec.find('\0') == std::string::npos ? codec_from_name(codec.c_str()) : -1;  // exact names only
  if (dtype < 0 || dtype >= kNumDTypes) throw py::value_error("dtype id " + std::to_string(dtype) + " is not 0 (float32), 1 (float16) or 2 (bfloat16)");
  if (id < 0) throw py::value_error("unknown codec '" + codec + "'; valid codecs: " + kValidCodecNames);
  const PayloadHeader h = make_header(static_cast<Codec>(id), static_cast<DType>(dtype), numel, param0, param1, RandomKey{});
  if (const char* problem = header_problem(h)) throw py::value_error(std::string("invalid ") + codec + " parameters: " + problem);
  return body_layout(h).total;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gradcomp native extension";
  m.def("payload_nbytes", &payload_nbytes, py::arg("codec"), py::arg("dtype"), py::arg("numel"),
        py::arg("param0") = 0, py::arg("param1") = 0);
  m.def("cpu_isa", &cpu_isa, "The CPU codec variant in use: avx512, avx2 or base");
  m.def("describe_decode_problems", &describe_decode_problems,
        "What the problem bits of a CUDA decode's status word mean, in words");
  m.attr("header_bytes") = kHeaderBytes;
  m.attr("payload_align") = kPayloadAlign;
  m.attr("format_version") = kFormatVersion;
  m.attr("max_levels") = kMaxLevels;
  m.attr("max_block") = kMaxBlock;
  m.attr("topk_wide") = kTopkWide;  // topk's param1: its two body layouts (wire.h)
  m.attr("topk_compact") = kTopkCompact;
  m.attr("topk_compact_span") = kCompactSpan;
#ifdef GRADCOMP_CUDA_KERNELS  // defined once the CUDA codecs are compiled in
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
}
