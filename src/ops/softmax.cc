#include "ops/softmax.h"

#include <algorithm>
#include <cmath>

#include "ops/exp16.h"
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

// Max is exact, so the vectorized loop's order changes no result.
[[gnu::always_inline]] inline float max_loop(const float* row, int64_t n, float floor) {
  float best = floor;
  for (int64_t i = 0; i < n; ++i) best = std::max(best, row[i]);
  return best;
}

float exp_default(float* row, int64_t n, float shift) { return exp_loop(row, n, shift); }
float max_default(const float* row, int64_t n, float floor) { return max_loop(row, n, floor); }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// GCC 12's _mm512_reduce_add_ps passes an undefined vector to the extract it starts with, which
// -Wuninitialized reports.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
[[gnu::target("avx512f,fma")]] float exp_avx512(float* row, int64_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512 total = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), s));
    _mm512_storeu_ps(row + i, e);
    total = _mm512_add_ps(total, e);
  }
  if (i < n) {
    const auto tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + i), s));
    _mm512_mask_storeu_ps(row + i, tail, e);
    total = _mm512_mask_add_ps(total, tail, total, e);
  }
  return _mm512_reduce_add_ps(total);
}
#pragma GCC diagnostic pop
// exp_avx512 in 8 lanes: a tail of fewer than 8 goes through a buffer whose spare lanes hold
// -1e30 (finite: this file is built with -ffast-math), whose exponential is exactly 0.
[[gnu::target("avx2,fma")]] float exp_avx2(float* row, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), s));
    _mm256_storeu_ps(row + i, e);
    total = _mm256_add_ps(total, e);
  }
  if (i < n) {
    alignas(32) float tail[8];
    for (int64_t t = 0; t < 8; ++t) tail[t] = i + t < n ? row[i + t] : -1e30f;
    const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(tail), s));
    _mm256_store_ps(tail, e);
    for (int64_t t = 0; i + t < n; ++t) row[i + t] = tail[t];
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}
// The max loops compiled for wider vectors. Chosen once by what the CPU supports (not with
// target_clones: its resolver would be exported from the library).
[[gnu::target("avx512f,fma")]] float max_avx512(const float* row, int64_t n, float floor) {
  return max_loop(row, n, floor);
}
[[gnu::target("avx2,fma")]] float max_avx2(const float* row, int64_t n, float floor) {
  return max_loop(row, n, floor);
}
#endif

}  // namespace

std::vector<SoftmaxVariant> softmax_variants() {
  std::vector<SoftmaxVariant> out{{"portable", exp_default, max_default}};
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  const VectorIsa isa = vector_isa();
  if (isa == VectorIsa::avx2 || isa == VectorIsa::avx512) {
    out.push_back({"avx2", exp_avx2, max_avx2});
  }
  if (isa == VectorIsa::avx512) out.push_back({"avx512", exp_avx512, max_avx512});
#endif
  return out;
}

namespace {

const SoftmaxVariant& kernels() {
  static const SoftmaxVariant chosen = softmax_variants().back();
  return chosen;
}

}  // namespace

float exp_shifted(float* row, int64_t n, float shift) {
  return kernels().exp_shifted(row, n, shift);
}

float max_of(const float* row, int64_t n, float floor) { return kernels().max_of(row, n, floor); }

}  // namespace kvsnap::detail
