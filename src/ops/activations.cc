#include "ops/activations.h"

#include <cmath>

#include "ops/exp16.h"
#include "ops/vector_isa.h"

namespace kvsnap::detail {
namespace {

void silu_gated_default(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
[[gnu::target("avx512f,fma")]] inline __m512 silu_gated16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
}

[[gnu::target("avx512f,fma")]] void silu_gated_avx512(float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(gate + i, silu_gated16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  }
  if (i < n) {
    const auto tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(
        gate + i, tail,
        silu_gated16(_mm512_maskz_loadu_ps(tail, gate + i), _mm512_maskz_loadu_ps(tail, up + i)));
  }
}

#endif

}  // namespace

std::vector<SiluVariant> silu_gated_variants() {
  std::vector<SiluVariant> out{{"portable", silu_gated_default}};
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (vector_isa() == VectorIsa::avx512) out.push_back({"avx512", silu_gated_avx512});
#endif
  return out;
}

void silu_gated(float* gate, const float* up, int64_t n) {
  static const SiluVariant chosen = silu_gated_variants().back();
  chosen.run(gate, up, n);
}

}  // namespace kvsnap::detail
