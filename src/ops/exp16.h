// Internal: e^x for 16 floats at once in AVX-512 and for 8 in AVX2, inline, for the kernels that
// exponentiate long rows (softmax numerators, SiLU): a call into the vector math library per
// vector spilled the calling loop's registers and cost as much as the exponential itself. The two
// give bitwise the same result for each lane.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace kvsnap::detail {

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsics (roundscale, scalef) pass an undefined vector as their unused
// merge source, which its uninitialized-use warnings report where they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// The constants both variants use (one definition: exp8 must be bitwise exp16): the clamp, log2 e,
// ln 2 in two parts, and Cephes' expf polynomial from its highest coefficient down.
namespace exp_constants {
constexpr float kHigh = 89.0f, kLow = -110.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_constants

// e^x = 2^k e^r with k = round(x / ln 2), r = x - k ln 2 in two parts, e^r by Cephes' expf
// polynomial (within 2 ulp), 2^k applied by scalef. Below -87.3 the results are denormal, as
// expf's are, and from -110 down (masked entries: a large negative number) exactly 0; from 89 up
// +inf. NaN stays NaN (max and min return their second operand when one is NaN).
[[gnu::target("avx512f,fma")]] inline __m512 exp16(__m512 x) {
  using namespace exp_constants;
  x = _mm512_min_ps(_mm512_set1_ps(kHigh), _mm512_max_ps(_mm512_set1_ps(kLow), x));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// exp16's steps in AVX2, which has no scalef: 2^k applied in two halves, k >> 1 added to p's
// exponent as an integer (exact: p lies in [0.7, 1.5] and the half in [-80, 64], so the result
// is a normal float), then a multiply by 2^(k - (k >> 1)), a normal float for every k the clamp
// allows ([-159, 128]), which rounds once, as scalef does (denormals, 0 and +inf alike). Integer
// arithmetic for the first half, not a multiply: under -ffast-math (softmax.cc) GCC regrouped
// p * 2^a * 2^b as p * (2^a * 2^b), which overflows for k = 128 and underflows for k = -150.
[[gnu::target("avx2,fma")]] inline __m256 exp8(__m256 x) {
  using namespace exp_constants;
  x = _mm256_min_ps(_mm256_set1_ps(kHigh), _mm256_max_ps(_mm256_set1_ps(kLow), x));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ki = _mm256_cvtps_epi32(k);  // exact: k is an integer
  const __m256i half = _mm256_srai_epi32(ki, 1), rest = _mm256_sub_epi32(ki, half);
  const __m256 scaled =
      _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(half, 23)));
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_mul_ps(scaled, second);
}

}  // namespace kvsnap::detail

#endif
