// Internal: the maximum and the exponentials of a softmax row, vectorized.
#pragma once

#include <cstdint>
#include <vector>

namespace kvsnap::detail {

// row[i] = exp(row[i] - shift) for i in [0, n); returns their sum. Every input must be finite
// (callers pass masked entries as a large negative number): this file is built with
// -ffast-math so the loop runs on the vector math library.
float exp_shifted(float* row, int64_t n, float shift);

// The largest of floor and row[0, n): vectorized (exact, so the same as a scalar loop). Inputs
// must not be NaN.
float max_of(const float* row, int64_t n, float floor);

// Every variant of the two kernels above this CPU runs — "portable", then where supported "avx2"
// and "avx512" (ops/exp16.h's exp8 and exp16); the functions above use the last — so that
// tests cover them all.
struct SoftmaxVariant {
  const char* name;
  float (*exp_shifted)(float* row, int64_t n, float shift);
  float (*max_of)(const float* row, int64_t n, float floor);
};
std::vector<SoftmaxVariant> softmax_variants();

}  // namespace kvsnap::detail
