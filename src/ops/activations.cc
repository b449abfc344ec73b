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

[[gnu::target("avx2,fma")]] inline __m256 silu_gated8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
}

// silu_gated_avx512 in 8 lanes; a tail of fewer than 8 through a buffer.
[[gnu::target("avx2,fma")]] void silu_gated_avx2(float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(gate + i, silu_gated8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    alignas(32) float g[8] = {}, u[8] = {};
    for (int64_t t = 0; i + t < n; ++t) g[t] = gate[i + t], u[t] = up[i + t];
    _mm256_store_ps(g, silu_gated8(_mm256_load_ps(g), _mm256_load_ps(u)));
    for (int64_t t = 0; i + t < n; ++t) gate[i + t] = g[t];
  }
}
#endif

}  // namespace

std::vector<SiluVariant> silu_gated_variants() {
  std::vector<SiluVariant> out{{"portable", silu_gated_default}};
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  const VectorIsa isa = vector_isa();
  if (isa == VectorIsa::avx2 || isa == VectorIsa::avx512) {
    out.push_back({"avx2", silu_gated_avx2});
  }
  if (isa == VectorIsa::avx512) out.push_back({"avx512", silu_gated_avx512});
#endif
  return out;
}

void silu_gated(float* gate, const float* up, int64_t n) {
  static const SiluVariant chosen = silu_gated_variants().back();
  chosen.run(gate, up, n);
}

}  // namespace kvsnap::detail
