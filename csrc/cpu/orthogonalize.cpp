// PowerSGD's orthogonalization of P (rows x rank): modified Gram-Schmidt, column by column.
// Column i is normalized (or zeroed when its norm is <= eps), then projected out of every later
// column. Row-major storage, so each step is one pass over the rows for all later columns at once.
#include <cmath>
#include <vector>

#include "kernels.h"

namespace gradcomp {

void orthogonalize_cpu(float* matrix, int64_t rows, int64_t cols, float eps) {
  std::vector<double> dots(cols);
  for (int64_t i = 0; i < cols; ++i) {
    double squares = 0.0;
    for (int64_t r = 0; r < rows; ++r) squares += double(matrix[r * cols + i]) * matrix[r * cols + i];
    const double norm = std::sqrt(squares);
    for (int64_t r = 0; r < rows; ++r)
      matrix[r * cols + i] = norm > eps ? static_cast<float>(matrix[r * cols + i] / norm) : 0.0f;
    if (i + 1 == cols) break;
    std::fill(dots.begin(), dots.end(), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = matrix + r * cols;
      for (int64_t j = i + 1; j < cols; ++j) dots[j] += double(row[i]) * row[j];
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* row = matrix + r * cols;
      for (int64_t j = i + 1; j < cols; ++j) row[j] -= static_cast<float>(dots[j]) * row[i];
    }
  }
}

}  // namespace gradcomp
