#include "ops/softmax.h"

#include <cmath>

// One clone per instruction set (libmvec's 16-, 8- or 4-wide expf), picked when the library loads.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVSNAP_EXP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVSNAP_EXP_CLONES
#endif

namespace kvsnap::detail {

KVSNAP_EXP_CLONES
float exp_shifted(float* row, int64_t n, float shift) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    row[i] = std::exp(row[i] - shift);
    total += row[i];
  }
  return total;
}

}  // namespace kvsnap::detail
