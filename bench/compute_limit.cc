// The compute limit of `kvsnap bench`'s model figures: multiply-adds one core issues per ns with
// nothing to wait for (twelve independent chains in registers, no memory), in the widest vector
// instructions the model's kernels use on this CPU — what a product or an attention kernel
// could reach, at best, on the thread it runs on.
#include <cstdint>

#include "common.h"
#include "figure_parts.h"
#include "ops/vector_isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSNAP_BENCH_X86 1
#endif

namespace kvsnap::bench {
namespace {

constexpr int kChains = 12;  // fmas take 4-5 cycles and two issue a cycle: 10 chains keep them busy

// Each variant: `loops` times kChains multiply-adds of a vector; returns a sum that depends on
// every one. (Written out per variant: a lambda or template called from a function with a
// target attribute does not take the attribute.)
#ifdef KVSNAP_BENCH_X86
[[gnu::target("avx512f,fma")]] float chains_avx512(int64_t loops, float factor) {
  __m512 sums[kChains];
  const __m512 f = _mm512_set1_ps(factor), add = _mm512_set1_ps(1e-3f);
  for (int c = 0; c < kChains; ++c)
    sums[c] = _mm512_set1_ps(1.0f + 0.01f * c);  // apart: not one chain
  for (int64_t i = 0; i < loops; ++i) {
#pragma GCC unroll 12
    for (__m512& s : sums) s = _mm512_fmadd_ps(s, f, add);
  }
  alignas(64) float lanes[16];  // (GCC 12's _mm512_reduce_add_ps warns of its own temporaries)
  float out = 0.0f;
  for (const __m512& s : sums) {
    _mm512_store_ps(lanes, s);
    for (const float l : lanes) out += l;
  }
  return out;
}
[[gnu::target("avx2,fma")]] float chains_avx2(int64_t loops, float factor) {
  __m256 sums[kChains];
  const __m256 f = _mm256_set1_ps(factor), add = _mm256_set1_ps(1e-3f);
  for (int c = 0; c < kChains; ++c)
    sums[c] = _mm256_set1_ps(1.0f + 0.01f * c);  // apart: not one chain
  for (int64_t i = 0; i < loops; ++i) {
#pragma GCC unroll 12
    for (__m256& s : sums) s = _mm256_fmadd_ps(s, f, add);
  }
  alignas(32) float lanes[8];
  float out = 0.0f;
  for (const __m256& s : sums) {
    _mm256_store_ps(lanes, s);
    for (const float l : lanes) out += l;
  }
  return out;
}
#endif

// The build's baseline: four-float vectors, a multiply then an add (two operations, as one fma).
float chains_baseline(int64_t loops, float factor) {
  using Vec4 = float __attribute__((vector_size(16)));
  Vec4 sums[kChains];
  const Vec4 f = {factor, factor, factor, factor}, add = {1e-3f, 1e-3f, 1e-3f, 1e-3f};
  for (int c = 0; c < kChains; ++c) {
    const float v = 1.0f + 0.01f * c;  // chains apart: no compiler may take them for one
    sums[c] = Vec4{v, v, v, v};
  }
  for (int64_t i = 0; i < loops; ++i) {
#pragma GCC unroll 12
    for (Vec4& s : sums) s = s * f + add;
  }
  float out = 0.0f;
  for (const Vec4& s : sums) out += s[0] + s[1] + s[2] + s[3];
  return out;
}

double measure_peak() {
  int lanes = 4;
  float (*run)(int64_t, float) = chains_baseline;
#ifdef KVSNAP_BENCH_X86
  using detail::VectorIsa;
  const VectorIsa isa = detail::vector_isa();
  if (isa == VectorIsa::avx512) {
    lanes = 16;
    run = chains_avx512;
  } else if (isa == VectorIsa::avx2) {
    lanes = 8;
    run = chains_avx2;
  }
#endif
  constexpr int64_t kLoops = 1 << 16;
  volatile float factor = 0.999f;  // not known when compiling: the loop cannot be folded
  const double ns = time_ns([&] { keep(run(kLoops, factor)); });
  return 2.0 * kChains * lanes * static_cast<double>(kLoops) / ns;
}

}  // namespace

double fma_peak_flops_per_ns() {
  if (smoke()) return measure_peak();  // one call: not kept for a real run after it
  static const double peak = measure_peak();
  return peak;
}

}  // namespace kvsnap::bench
