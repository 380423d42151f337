// PowerSGD's orthogonalization (see csrc/cpu/orthogonalize.cpp for the rule): Gram-Schmidt with
// re-orthogonalization, one thread block per matrix of a batch. Column i's dot products with the
// earlier columns go one per warp (lanes over the rows, double precision), the projection and the
// normalization one thread per row. The sums run in another order than on the CPU, so the result
// agrees to rounding, not bit for bit (matmuls through cuBLAS do not either).
#include "device.cuh"

namespace gradcomp::cuda {
namespace {

constexpr int kWarps = kThreads / kLanes;

__device__ __forceinline__ double warp_sum(double v) {
  for (int width = 16; width >= 1; width /= 2) v += __shfl_down_sync(0xFFFFFFFFu, v, width);
  return v;
}

// sum over rows of a[r][j] * a[r][i], for every j in [0, columns), one warp per column: into out[j].
__device__ void column_dots(const float* a, int64_t rows, int64_t cols, int64_t columns, int64_t i, double* out) {
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  for (int64_t j = warp; j < columns; j += kWarps) {
    double acc = 0.0;
    for (int64_t r = lane; r < rows; r += kLanes) acc += double(a[r * cols + j]) * a[r * cols + (i < 0 ? j : i)];
    acc = warp_sum(acc);
    if (lane == 0) out[j] = acc;
  }
  __syncthreads();
}

__global__ void orthogonalize_kernel(float* matrices, int64_t rows, int64_t cols, float eps) {
  constexpr double kDependent = 1.0 / 65536;
  extern __shared__ double shared[];  // original[cols], dots[cols], norm
  double* original = shared;
  double* dots = shared + cols;
  float* a = matrices + static_cast<int64_t>(blockIdx.x) * rows * cols;
  column_dots(a, rows, cols, cols, -1, original);  // squared norms of the columns as given
  for (int64_t i = 0; i < cols; ++i) {
    for (int pass = 0; pass < 2 && i > 0; ++pass) {
      column_dots(a, rows, cols, i, i, dots);
      for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        double projection = 0.0;
        for (int64_t j = 0; j < i; ++j) projection += dots[j] * a[r * cols + j];
        a[r * cols + i] = static_cast<float>(a[r * cols + i] - projection);
      }
      __syncthreads();
    }
    // The squared norm of column i: column_dots of column i with itself, into dots[i].
    if (threadIdx.x < kLanes) {
      double acc = 0.0;
      for (int64_t r = threadIdx.x; r < rows; r += kLanes) acc += double(a[r * cols + i]) * a[r * cols + i];
      acc = warp_sum(acc);
      if (threadIdx.x == 0) dots[i] = acc;
    }
    __syncthreads();
    const double norm = sqrt(dots[i]);
    const bool keep = norm > eps && norm > kDependent * sqrt(original[i]);
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
      a[r * cols + i] = keep ? static_cast<float>(a[r * cols + i] / norm) : 0.0f;
    __syncthreads();
  }
}

}  // namespace

cudaError_t orthogonalize(float* matrices, int64_t batch, int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
  if (batch == 0 || rows == 0 || cols == 0) return cudaSuccess;
  const size_t shared_bytes = sizeof(double) * 2 * cols;
  if (shared_bytes > 48 * 1024) return cudaErrorInvalidValue;  // rank above 3072: the caller refuses it first
  orthogonalize_kernel<<<static_cast<unsigned>(batch), kThreads, shared_bytes, stream>>>(matrices, rows, cols, eps);
  return cudaGetLastError();
}

}  // namespace gradcomp::cuda
