// PowerSGD's orthogonalization of P (rows x rank): Gram-Schmidt, column by column. Column i has
// the earlier columns projected out (twice), then is normalized. It is zeroed instead when its
// norm is <= eps, or when what is left of it after the projections is below kDependent of its
// original norm: it lay in the span of the earlier columns (P = MQ is rank-deficient whenever M
// is, e.g. a classifier's last layer), and normalizing rounding noise would add a direction that
// is not orthogonal to the others.
#include <cmath>
#include <vector>

#include "kernels.h"

namespace gradcomp {

void orthogonalize_cpu(float* matrix, int64_t rows, int64_t cols, float eps) {
  constexpr double kDependent = 1.0 / 65536;  // ~100x above fp32 rounding after the projections
  std::vector<double> dots(cols), original(cols, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) original[j] += double(matrix[r * cols + j]) * matrix[r * cols + j];
  for (int64_t i = 0; i < cols; ++i) {
    // Two projection passes ("twice is enough"): one leaves errors of rounding / remainder in the
    // direction of the earlier columns when column i nearly depends on them; the second removes them.
    for (int pass = 0; pass < 2 && i > 0; ++pass) {
      std::fill(dots.begin(), dots.begin() + i, 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = matrix + r * cols;
        for (int64_t j = 0; j < i; ++j) dots[j] += double(row[j]) * row[i];
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* row = matrix + r * cols;
        double projection = 0.0;
        for (int64_t j = 0; j < i; ++j) projection += dots[j] * row[j];
        row[i] = static_cast<float>(row[i] - projection);
      }
    }
    double squares = 0.0;
    for (int64_t r = 0; r < rows; ++r) squares += double(matrix[r * cols + i]) * matrix[r * cols + i];
    const double norm = std::sqrt(squares);
    const bool keep = norm > eps && norm > kDependent * std::sqrt(original[i]);
    for (int64_t r = 0; r < rows; ++r)
      matrix[r * cols + i] = keep ? static_cast<float>(matrix[r * cols + i] / norm) : 0.0f;
  }
}

}  // namespace gradcomp
