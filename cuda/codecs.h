// The CUDA codecs on raw device pointers: no torch here (csrc/torch/ops.cpp is the bridge), so the
// GoogleTest suite calls them directly. Every function only enqueues work on the given stream: no
// host-device synchronisation, no allocation (the caller passes a workspace of the size asked for).
// The payload bits are those of the CPU codecs (csrc/cpu) for the same inputs and random key.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/wire.h"

namespace gradcomp::cuda {

struct EncodeParams {
  PayloadHeader header;        // codec, dtype, numel, parameters and random key (validated by the caller)
  uint32_t rank = 0;           // keys this rank's stochastic rounding
  const void* grad = nullptr;  // numel contiguous elements of header.dtype, on the device
  void* residual = nullptr;    // the same shape and dtype; nullptr: no error feedback
  uint8_t* payload = nullptr;  // body_layout(header).total bytes on the device, 16-byte aligned
  void* workspace = nullptr;   // encode_workspace_bytes(header) bytes on the device, 256-byte aligned
  bool norm_scale = false;     // signsgd only: scale = root mean square of m, not mean |m|
};

struct DecodeParams {
  // What every payload's header must say (codec, dtype, numel, param0, param1); its random key is
  // ignored: the payloads must agree with payload 0 on theirs. Validated by the caller.
  PayloadHeader expected;
  const uint8_t* payloads = nullptr;  // count payloads of body_layout(expected).total bytes, back to back,
                                      // the first 16-byte aligned
  int64_t count = 0;
  void* out = nullptr;    // numel elements of expected.dtype, overwritten
  float alpha = 1.0f;     // out = sum of alpha * each decoded payload (alpha applied first)
  bool vote = false;      // signsgd only: majority vote of the signs, scaled by the summed scales
  uint32_t* status = nullptr;  // one device word; the DecodeProblem bits this call finds are OR-ed into it
  void* workspace = nullptr;   // decode_workspace_bytes(expected, count) bytes, 256-byte aligned
};

size_t encode_workspace_bytes(const PayloadHeader& header);
size_t decode_workspace_bytes(const PayloadHeader& expected, int64_t count);

// Each returns the launch error, if any (cudaSuccess otherwise).
cudaError_t encode(const EncodeParams& params, cudaStream_t stream);

// Checks the payloads on the device as validate_payloads does on the host. If any fails, its problem
// bits go into *status and this call's whole output becomes NaN: never an access out of bounds,
// never a plausible wrong gradient.
cudaError_t decode_sum(const DecodeParams& params, cudaStream_t stream);

// orthogonalize_cpu (csrc/cpu/kernels.h) on batch row-major rows x cols fp32 matrices, one after
// the other in memory: one thread block per matrix.
cudaError_t orthogonalize(float* matrices, int64_t batch, int64_t rows, int64_t cols, float eps,
                          cudaStream_t stream);

}  // namespace gradcomp::cuda
