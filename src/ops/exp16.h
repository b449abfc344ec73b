// Internal: e^x for 16 floats at once in AVX-512, inline, for the kernels that exponentiate long
// rows (softmax numerators, SiLU): a call into the vector math library per vector spilled the
// calling loop's registers and cost as much as the exponential itself.
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

// e^x = 2^k e^r with k = round(x / ln 2), r = x - k ln 2 in two parts, e^r by Cephes' expf
// polynomial (within 2 ulp), 2^k applied by scalef. Below -87.3 the results are denormal, as
// expf's are, and from -110 down (masked entries: a large negative number) exactly 0; from 89 up
// +inf. NaN stays NaN (max and min return their second operand when one is NaN).
[[gnu::target("avx512f,fma")]] inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-110.0f), x));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace kvsnap::detail

#endif
