// Decode attention's products (decode_kernels.h) for CPUs with AVX-512: scores with 16 queries
// per vector (one lane each) and 8 key columns at a time, outputs with 32 value columns in two
// vectors for 4 queries at a time. Each lane is one fma chain in a fixed order (the depth for a
// score, the columns for an output), so tiles and sharing never change a result; keys and
// values are read in place, no packing.
#include "ops/decode_kernels.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ops/vector_isa.h"

namespace kvsnap::detail {
namespace {

// The kernels this CPU runs; null where it has no AVX-512.
struct Kernels {
  void (*scores)(const float* const*, int64_t, int64_t, const float*, int64_t, int64_t, float,
                 float* const*, float*) = nullptr;
  void (*weigh)(const float* const*, int64_t, const float*, int64_t, int64_t, int64_t,
                float* const*) = nullptr;
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
[[gnu::target("avx512f,fma")]] void scores_avx512(const float* const* q, int64_t m, int64_t depth,
                                                  const float* keys, int64_t stride, int64_t count,
                                                  float scale, float* const* out, float* qt) {
  alignas(64) float tile[8 * 16];
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < m; i0 += 16) {
    const int64_t valid = std::min<int64_t>(16, m - i0);
    for (int64_t d = 0; d < depth; ++d) {
      for (int64_t t = 0; t < 16; ++t) qt[d * 16 + t] = t < valid ? q[i0 + t][d] : 0.0f;
    }
    int64_t c = 0;
    for (; c + 8 <= count; c += 8) {
      const float* k = keys + c * stride;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0,
             s7 = s0;
      for (int64_t d = 0; d < depth; ++d) {
        const __m512 x = _mm512_loadu_ps(qt + d * 16);
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(k[d]), x, s0);
        s1 = _mm512_fmadd_ps(_mm512_set1_ps(k[stride + d]), x, s1);
        s2 = _mm512_fmadd_ps(_mm512_set1_ps(k[2 * stride + d]), x, s2);
        s3 = _mm512_fmadd_ps(_mm512_set1_ps(k[3 * stride + d]), x, s3);
        s4 = _mm512_fmadd_ps(_mm512_set1_ps(k[4 * stride + d]), x, s4);
        s5 = _mm512_fmadd_ps(_mm512_set1_ps(k[5 * stride + d]), x, s5);
        s6 = _mm512_fmadd_ps(_mm512_set1_ps(k[6 * stride + d]), x, s6);
        s7 = _mm512_fmadd_ps(_mm512_set1_ps(k[7 * stride + d]), x, s7);
      }
      const __m512 sums[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
      for (int u = 0; u < 8; ++u) _mm512_store_ps(tile + u * 16, _mm512_mul_ps(sums[u], scale16));
      for (int64_t t = 0; t < valid; ++t) {
        float* row = out[i0 + t] + c;
        for (int u = 0; u < 8; ++u) row[u] = tile[u * 16 + t];
      }
    }
    for (; c < count; ++c) {
      const float* k = keys + c * stride;
      __m512 s0 = _mm512_setzero_ps();
      for (int64_t d = 0; d < depth; ++d) {
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(k[d]), _mm512_loadu_ps(qt + d * 16), s0);
      }
      _mm512_store_ps(tile, _mm512_mul_ps(s0, scale16));
      for (int64_t t = 0; t < valid; ++t) out[i0 + t][c] = tile[t];
    }
  }
}

// T queries, 32 value columns in two vectors each; other widths and the rest fall to fma.
template <int T>
[[gnu::target("avx512f,fma")]] inline void weigh_avx512_tile(const float* const* w,
                                                             const float* values, int64_t stride,
                                                             int64_t count, int64_t v0,
                                                             float* const* out) {
  __m512 lo[T], hi[T];
  for (int t = 0; t < T; ++t) {
    lo[t] = _mm512_loadu_ps(out[t] + v0);
    hi[t] = _mm512_loadu_ps(out[t] + v0 + 16);
  }
  for (int64_t c = 0; c < count; ++c) {
    const __m512 a = _mm512_loadu_ps(values + c * stride + v0);
    const __m512 b = _mm512_loadu_ps(values + c * stride + v0 + 16);
    for (int t = 0; t < T; ++t) {
      const __m512 x = _mm512_set1_ps(w[t][c]);
      lo[t] = _mm512_fmadd_ps(x, a, lo[t]);
      hi[t] = _mm512_fmadd_ps(x, b, hi[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    _mm512_storeu_ps(out[t] + v0, lo[t]);
    _mm512_storeu_ps(out[t] + v0 + 16, hi[t]);
  }
}

[[gnu::target("avx512f,fma")]] void weigh_avx512(const float* const* w, int64_t m,
                                                 const float* values, int64_t stride, int64_t count,
                                                 int64_t value_depth, float* const* out) {
  const int64_t wide = value_depth / 32 * 32;
  for (int64_t v0 = 0; v0 < wide; v0 += 32) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) weigh_avx512_tile<4>(w + i, values, stride, count, v0, out + i);
    for (; i < m; ++i) weigh_avx512_tile<1>(w + i, values, stride, count, v0, out + i);
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t v = wide; v < value_depth; ++v) {
      float acc = out[i][v];
      for (int64_t c = 0; c < count; ++c) acc = std::fma(w[i][c], values[c * stride + v], acc);
      out[i][v] = acc;
    }
  }
}

Kernels pick() {
  if (vector_isa() == VectorIsa::avx512) return {scores_avx512, weigh_avx512};
  return {};
}
#else
Kernels pick() { return {}; }
#endif

const Kernels& kernels() {
  static const Kernels chosen = pick();
  return chosen;
}

}  // namespace

bool decode_kernels_available() { return kernels().scores != nullptr; }

void decode_scores(const float* const* queries, int64_t m, int64_t depth, const float* keys,
                   int64_t key_stride, int64_t count, float scale, float* const* out,
                   std::vector<float>& scratch) {
  scratch.resize(static_cast<size_t>(depth * 16));
  kernels().scores(queries, m, depth, keys, key_stride, count, scale, out, scratch.data());
}

void decode_weigh(const float* const* weights, int64_t m, const float* values, int64_t value_stride,
                  int64_t count, int64_t value_depth, float* const* out) {
  kernels().weigh(weights, m, values, value_stride, count, value_depth, out);
}

}  // namespace kvsnap::detail
