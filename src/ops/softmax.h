// Internal: the maximum and the exponentials of a softmax row, vectorized.
#pragma once

#include <cstdint>

namespace kvsnap::detail {

// row[i] = exp(row[i] - shift) for i in [0, n); returns their sum. Every input must be finite
// (callers pass masked entries as a large negative number): this file is built with
// -ffast-math so the loop runs on the vector math library.
float exp_shifted(float* row, int64_t n, float shift);

// The largest of floor and row[0, n): vectorized (exact, so the same as a scalar loop). Inputs
// must not be NaN.
float max_of(const float* row, int64_t n, float floor);

}  // namespace kvsnap::detail
