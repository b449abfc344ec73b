#include "ops/softmax.h"

#include <cmath>

#include "ops/vector_isa.h"

namespace kvsnap::detail {
namespace {

[[gnu::always_inline]] inline float exp_loop(float* row, int64_t n, float shift) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    row[i] = std::exp(row[i] - shift);
    total += row[i];
  }
  return total;
}

using ExpShifted = float (*)(float*, int64_t, float);

float exp_default(float* row, int64_t n, float shift) { return exp_loop(row, n, shift); }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The same loop compiled for wider vectors: libmvec's 16- or 8-wide expf. Chosen once by what
// the CPU supports (not with target_clones: its resolver would be exported from the library).
[[gnu::target("avx512f,fma")]] float exp_avx512(float* row, int64_t n, float shift) {
  return exp_loop(row, n, shift);
}
[[gnu::target("avx2,fma")]] float exp_avx2(float* row, int64_t n, float shift) {
  return exp_loop(row, n, shift);
}
ExpShifted pick() {
  switch (vector_isa()) {
    case VectorIsa::avx512:
      return exp_avx512;
    case VectorIsa::avx2:
      return exp_avx2;
    case VectorIsa::baseline:
      break;
  }
  return exp_default;
}
#else
ExpShifted pick() { return exp_default; }
#endif

}  // namespace

float exp_shifted(float* row, int64_t n, float shift) {
  static const ExpShifted chosen = pick();
  return chosen(row, n, shift);
}

}  // namespace kvsnap::detail
