// Internal: elementwise activations of the built-in model's blocks, vectorized.
#pragma once

#include <cstdint>

namespace kvsnap::detail {

// gate[i] = silu(gate[i]) * up[i] for i in [0, n), silu(v) = v / (1 + e^-v): the gated MLP's
// middle. With AVX-512 the exponentials are ops/exp16.h's (within 2 ulp of expf).
void silu_gated(float* gate, const float* up, int64_t n);

}  // namespace kvsnap::detail
