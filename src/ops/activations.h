// Internal: elementwise activations of the built-in model's blocks, vectorized.
#pragma once

#include <cstdint>
#include <vector>

namespace kvsnap::detail {

// gate[i] = silu(gate[i]) * up[i] for i in [0, n), silu(v) = v / (1 + e^-v): the gated MLP's
// middle. With AVX2 or AVX-512 the exponentials are ops/exp16.h's (exp8 / exp16: within 2 ulp
// of expf).
void silu_gated(float* gate, const float* up, int64_t n);

// Every variant this CPU runs — "portable" (expf), then "avx2" and "avx512" where supported
// (GCC builds); silu_gated uses the last — so that tests cover them all.
struct SiluVariant {
  const char* name;
  void (*run)(float* gate, const float* up, int64_t n);
};
std::vector<SiluVariant> silu_gated_variants();

}  // namespace kvsnap::detail
