// PowerSGD's decode, out = P Q^T (P: rows x rank, Q: cols x rank, row-major fp32). Every rank
// computes it from the same summed P and Q, and must get the same bits, or the ranks' models
// drift apart. A BLAS product does not promise that: its blocking follows its thread count, which
// MKL lowers when the machine is busy, so two ranks can round differently. Here each element is
// summed over the rank in a fixed order, and threads split whole rows, so the bits depend on
// nothing but the inputs.
#include <algorithm>
#include <vector>

#include "chunked.h"
#include "kernels.h"

namespace gradcomp {

void low_rank_product_cpu(const float* p, const float* q, float* out, int64_t rows, int64_t cols, int64_t rank,
                          ParallelFor parallel_for) {
  // Q^T, so that a row of out is a sum of rank contiguous rows of it, each scaled by one of P's.
  std::vector<float> q_t(static_cast<size_t>(rank * cols));
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t k = 0; k < rank; ++k) q_t[k * cols + j] = q[j * rank + k];
  const int64_t rows_per_task = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, cols * rank));
  for_ranges(parallel_for, rows, rows_per_task, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      float* row = out + i * cols;
      const float* scales = p + i * rank;
      std::fill(row, row + cols, 0.0f);
      int64_t k = 0;
      for (; k + 4 <= rank; k += 4) {  // four terms per pass over the row, still added one after another
        const float* s0 = q_t.data() + k * cols;
        const float *s1 = s0 + cols, *s2 = s1 + cols, *s3 = s2 + cols;
        for (int64_t j = 0; j < cols; ++j)
          row[j] = (((row[j] + scales[k] * s0[j]) + scales[k + 1] * s1[j]) + scales[k + 2] * s2[j]) +
                   scales[k + 3] * s3[j];
      }
      for (; k < rank; ++k) {
        const float* source = q_t.data() + k * cols;
        for (int64_t j = 0; j < cols; ++j) row[j] += scales[k] * source[j];
      }
    }
  });
}

}  // namespace gradcomp
