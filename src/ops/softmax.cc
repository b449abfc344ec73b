#include "ops/softmax.h"

#include <cmath>

namespace kvsnap::detail {

float exp_shifted(float* row, int64_t n, float shift) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    row[i] = std::exp(row[i] - shift);
    total += row[i];
  }
  return total;
}

}  // namespace kvsnap::detail
