// Decode attention's products (decode_kernels.h): the AVX-512 variant, and which variant runs
// (the AVX2 one is in decode_kernels_avx2.cc). Scores with 16 queries
// per vector (one lane each), two vectors and 8 key columns at a time, outputs with 32 value
// columns in two vectors for 8 queries at a time (then 4, then 1), over runs of columns. Each lane
// is one fma chain in a fixed order (the depth for a score, the columns for an output), so tiles
// and sharing never change a result; keys and values are read in place, no packing.
#include "ops/decode_kernels.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ops/decode_kernels_common.h"
#include "ops/vector_isa.h"

namespace kvsnap::detail {
namespace {

using decode::for_each_span;
using decode::Lookahead;
using decode::weigh_tail;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC 12's AVX-512 unpack and shuffle intrinsics pass an undefined vector as their unused
// merge source, which -Wmaybe-uninitialized (-Wuninitialized at -O1) reports at every use. (Pushed
// and popped: a unity build compiles other files after this one.)
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"

[[gnu::target("avx512f,fma")]] inline __m512d as_pd(__m512 x) { return _mm512_castps_pd(x); }
[[gnu::target("avx512f,fma")]] inline __m256 upper(__m512 x) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
}

// Scales sums[u] (lane t: query t's score of key column c + u) and writes query t's eight
// scores to out[t][c, c + 8) for t < valid: an 8 x 16 transpose in registers (unpacks within
// 128-bit lanes, then 128-bit lane shuffles), two 256-bit stores per pair of queries.
[[gnu::target("avx512f,fma")]] inline void store_columns(__m512 (&sums)[8], __m512 scale,
                                                         float* const* out, int64_t c,
                                                         int64_t valid) {
  __m512 t[8], u[8];
  for (int p = 0; p < 4; ++p) {
    const __m512 a = _mm512_mul_ps(sums[2 * p], scale), b = _mm512_mul_ps(sums[2 * p + 1], scale);
    t[2 * p] = _mm512_unpacklo_ps(a, b);  // lane l: a[4l], b[4l], a[4l+1], b[4l+1]
    t[2 * p + 1] = _mm512_unpackhi_ps(a, b);
  }
  for (int h = 0; h < 2; ++h) {  // keys 4h .. 4h+3: u[4h + m] lane l = query 4l + m
    const __m512* v = t + 4 * h;
    u[4 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(as_pd(v[0]), as_pd(v[2])));
    u[4 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(as_pd(v[0]), as_pd(v[2])));
    u[4 * h + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(as_pd(v[1]), as_pd(v[3])));
    u[4 * h + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(as_pd(v[1]), as_pd(v[3])));
  }
  for (int m = 0; m < 4; ++m) {
    // [keys 0-3, keys 4-7] of queries m, 4 + m (lo) and 8 + m, 12 + m (hi).
    const __m512 lo = _mm512_shuffle_f32x4(
        _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(1, 0, 1, 0)), _MM_SHUFFLE(3, 1, 2, 0));
    const __m512 hi = _mm512_shuffle_f32x4(
        _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(3, 2, 3, 2)),
        _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(3, 2, 3, 2)), _MM_SHUFFLE(3, 1, 2, 0));
    const int64_t query[4] = {m, 4 + m, 8 + m, 12 + m};
    const __m256 eight[4] = {_mm512_castps512_ps256(lo), upper(lo), _mm512_castps512_ps256(hi),
                             upper(hi)};
    for (int i = 0; i < 4; ++i) {
      if (query[i] < valid) _mm256_storeu_ps(out[query[i]] + c, eight[i]);
    }
  }
}

// T tiles of 16 queries (qt: [T][depth][16]) against 8 key columns: each key broadcast once
// for all T tiles.
template <int T>
[[gnu::target("avx512f,fma")]] inline void score_columns(const float* qt, int64_t depth,
                                                         const float* k, int64_t stride,
                                                         __m512 (&sums)[T][8]) {
  for (int t = 0; t < T; ++t) {
    for (int u = 0; u < 8; ++u) sums[t][u] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < depth; ++d) {
    __m512 x[T];
    for (int t = 0; t < T; ++t) x[t] = _mm512_loadu_ps(qt + (t * depth + d) * 16);
    for (int u = 0; u < 8; ++u) {
      const __m512 key = _mm512_set1_ps(k[u * stride + d]);
      for (int t = 0; t < T; ++t) sums[t][u] = _mm512_fmadd_ps(key, x[t], sums[t][u]);
    }
  }
}

// Scores of the (up to 32) queries in qt over `count` key columns, into out[i][at + c].
template <int T>
[[gnu::target("avx512f,fma")]] void score_tiles(const float* qt, int64_t depth, const float* keys,
                                                int64_t stride, int64_t count, __m512 scale,
                                                float* const* out, int64_t at, int64_t valid,
                                                Lookahead& ahead) {
  alignas(64) float tile[16];
  int64_t c = 0;
  for (; c + 8 <= count; c += 8) {
    __m512 sums[T][8];
    ahead.fetch(8);
    score_columns<T>(qt, depth, keys + c * stride, stride, sums);
    for (int t = 0; t < T; ++t) {
      store_columns(sums[t], scale, out + 16 * t, at + c, valid - 16 * t);
    }
  }
  ahead.fetch(count - c);
  for (; c < count; ++c) {
    const float* k = keys + c * stride;
    for (int t = 0; t < T; ++t) {
      __m512 s0 = _mm512_setzero_ps();
      for (int64_t d = 0; d < depth; ++d) {
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(k[d]), _mm512_loadu_ps(qt + (t * depth + d) * 16), s0);
      }
      _mm512_store_ps(tile, _mm512_mul_ps(s0, scale));
      for (int64_t i = 0; i < std::min<int64_t>(16, valid - 16 * t); ++i) {
        out[16 * t + i][at + c] = tile[i];
      }
    }
  }
}

// In place: rows r[j] (j < 16) become columns: r[i] lane j = old r[j] lane i.
[[gnu::target("avx512f,fma")]] inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
  for (int p = 0; p < 8; ++p) {
    t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // rows 4q .. 4q+3: u[4q + e] lane l = element 4l + e
    const __m512* v = t + 4 * q;
    u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(as_pd(v[0]), as_pd(v[2])));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(as_pd(v[0]), as_pd(v[2])));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(as_pd(v[1]), as_pd(v[3])));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(as_pd(v[1]), as_pd(v[3])));
  }
  for (int e = 0; e < 4; ++e) {
    // Lanes 0, 2 (then 1, 3) of rows 0-3 and 4-7, and of rows 8-11 and 12-15.
    const __m512 a0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88),
                 a1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xdd),
                 b0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88),
                 b1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xdd);
    r[e] = _mm512_shuffle_f32x4(a0, b0, 0x88);
    r[8 + e] = _mm512_shuffle_f32x4(a0, b0, 0xdd);
    r[4 + e] = _mm512_shuffle_f32x4(a1, b1, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(a1, b1, 0xdd);
  }
}

// M (<= 8) queries with 16 key columns per vector (one lane each): each block of 16 keys is
// transposed in registers, 16 depths at a time, so a few queries fill every lane. The same fma
// chain per score as scores_avx512's, so a query's scores are bitwise the same either way.
template <int M>
[[gnu::target("avx512f,fma")]] void scores_by_key(const float* const* q, int64_t depth,
                                                  const ColumnRun* runs, size_t n, int64_t stride,
                                                  float scale, float* const* out) {
  const __m512 scale16 = _mm512_set1_ps(scale);
  Lookahead ahead(runs, n, stride, depth);
  int64_t at = 0;
  for (size_t r = 0; r < n; at += runs[r].count, ++r) {
    const float* keys = runs[r].data;
    const int64_t count = runs[r].count;
    for (int64_t c = 0; c < count; c += 16) {
      const int64_t rows = std::min<int64_t>(16, count - c);
      ahead.fetch(rows);
      __m512 sum[M];
      for (int i = 0; i < M; ++i) sum[i] = _mm512_setzero_ps();
      for (int64_t d0 = 0; d0 < depth; d0 += 16) {
        const int64_t span = std::min<int64_t>(16, depth - d0);
        const auto lanes = static_cast<__mmask16>((1u << span) - 1u);
        __m512 k[16];
        for (int j = 0; j < 16; ++j) {
          k[j] = j < rows ? _mm512_maskz_loadu_ps(lanes, keys + (c + j) * stride + d0)
                          : _mm512_setzero_ps();
        }
        transpose16(k);  // k[e] lane j: key c + j at depth d0 + e
        for (int64_t e = 0; e < span; ++e) {
          for (int i = 0; i < M; ++i) {
            sum[i] = _mm512_fmadd_ps(k[e], _mm512_set1_ps(q[i][d0 + e]), sum[i]);
          }
        }
      }
      const auto valid = static_cast<__mmask16>((1u << rows) - 1u);
      for (int i = 0; i < M; ++i) {
        _mm512_mask_storeu_ps(out[i] + at + c, valid, _mm512_mul_ps(sum[i], scale16));
      }
    }
  }
}

// scores_by_key<1> .. scores_by_key<kByKey>, by query count less one.
constexpr int64_t kByKey = 8;
using ByKey = void (*)(const float* const*, int64_t, const ColumnRun*, size_t, int64_t, float,
                       float* const*);
template <size_t... M>
constexpr std::array<ByKey, sizeof...(M)> by_key(std::index_sequence<M...>) {
  return {scores_by_key<static_cast<int>(M) + 1>...};
}

// Queries in pairs of 16-lane tiles (one lane each; a partial tile's spare lanes are zero and
// never stored), transposed once into qt.
[[gnu::target("avx512f,fma")]] void scores_avx512(const float* const* q, int64_t m, int64_t depth,
                                                  const ColumnRun* runs, size_t n, int64_t stride,
                                                  float scale, float* const* out, float* qt) {
  static constexpr std::array<ByKey, kByKey> kByKeyOf = by_key(std::make_index_sequence<kByKey>{});
  if (m >= 1 && m <= kByKey) {  // a few queries: keys in the lanes instead (scores_by_key)
    return kByKeyOf[static_cast<size_t>(m - 1)](q, depth, runs, n, stride, scale, out);
  }
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < m; i0 += decode::kScoreQueries) {
    const int64_t valid = std::min(decode::kScoreQueries, m - i0),
                  tiles = decode::transpose_queries(q + i0, valid, depth, 16, qt);
    Lookahead ahead(runs, n, stride, depth);
    int64_t at = 0;
    for (size_t r = 0; r < n; at += runs[r].count, ++r) {
      if (tiles == 2) {
        score_tiles<2>(qt, depth, runs[r].data, stride, runs[r].count, scale16, out + i0, at, valid,
                       ahead);
      } else {
        score_tiles<1>(qt, depth, runs[r].data, stride, runs[r].count, scale16, out + i0, at, valid,
                       ahead);
      }
    }
  }
}

// T queries, 32 value columns in two vectors each, over the pieces in order; other widths and the
// rest fall to fma. The sums stay in registers from the first piece to the last. The first tile
// over a span fetches ahead (Fetch), 8 columns at a time; the others find its columns in the
// caches.
template <int T, bool Fetch>
[[gnu::target("avx512f,fma")]] inline void weigh_avx512_tile(const float* const* w,
                                                             const decode::Piece* pieces, size_t n,
                                                             int64_t stride, int64_t v0,
                                                             float* const* out, Lookahead& ahead) {
  __m512 lo[T], hi[T];
  for (int t = 0; t < T; ++t) {
    lo[t] = _mm512_loadu_ps(out[t] + v0);
    hi[t] = _mm512_loadu_ps(out[t] + v0 + 16);
  }
  for (size_t p = 0; p < n; ++p) {
    const float* values = pieces[p].values + v0;
    const int64_t column = pieces[p].column, count = pieces[p].count;
    for (int64_t c0 = 0; c0 < count; c0 += 8) {
      const int64_t end = std::min(count, c0 + 8);
      if constexpr (Fetch) ahead.fetch(end - c0);
      for (int64_t c = c0; c < end; ++c) {
        const __m512 a = _mm512_loadu_ps(values + c * stride);
        const __m512 b = _mm512_loadu_ps(values + c * stride + 16);
        for (int t = 0; t < T; ++t) {
          const __m512 x = _mm512_set1_ps(w[t][column + c]);
          lo[t] = _mm512_fmadd_ps(x, a, lo[t]);
          hi[t] = _mm512_fmadd_ps(x, b, hi[t]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    _mm512_storeu_ps(out[t] + v0, lo[t]);
    _mm512_storeu_ps(out[t] + v0 + 16, hi[t]);
  }
}

template <int T>
[[gnu::target("avx512f,fma")]] void weigh_tile(bool fetch, const float* const* w,
                                               const decode::Piece* pieces, size_t n,
                                               int64_t stride, int64_t v0, float* const* out,
                                               Lookahead& ahead) {
  if (fetch) return weigh_avx512_tile<T, true>(w, pieces, n, stride, v0, out, ahead);
  weigh_avx512_tile<T, false>(w, pieces, n, stride, v0, out, ahead);
}

// The runs' columns in spans (for_each_span): every query tile goes over a span before the next
// span, so its values come from memory once.
[[gnu::target("avx512f,fma")]] void weigh_avx512(const float* const* w, int64_t m,
                                                 const ColumnRun* runs, size_t n_runs,
                                                 int64_t stride, int64_t value_depth,
                                                 float* const* out) {
  const int64_t wide = value_depth / 32 * 32;
  Lookahead ahead(runs, n_runs, stride, value_depth);
  for_each_span(runs, n_runs, stride, [&](const decode::Piece* span, size_t pieces) {
    for (int64_t v0 = 0; v0 < wide; v0 += 32) {
      int64_t i = 0;
      for (; i + 8 <= m; i += 8) {
        weigh_tile<8>(v0 == 0 && i == 0, w + i, span, pieces, stride, v0, out + i, ahead);
      }
      for (; i + 4 <= m; i += 4) {
        weigh_tile<4>(v0 == 0 && i == 0, w + i, span, pieces, stride, v0, out + i, ahead);
      }
      for (; i < m; ++i) {
        weigh_tile<1>(v0 == 0 && i == 0, w + i, span, pieces, stride, v0, out + i, ahead);
      }
    }
  });
  weigh_tail(w, m, runs, n_runs, stride, wide, value_depth, out);
}
#pragma GCC diagnostic pop
#endif

std::atomic<int> kernels_off{0};  // live DecodeKernelsOff guards

const DecodeKernelVariant* chosen() {
  static const std::vector<DecodeKernelVariant> all = decode_kernel_variants();
  return all.empty() ? nullptr : &all.back();
}

}  // namespace

std::vector<DecodeKernelVariant> decode_kernel_variants() {
  std::vector<DecodeKernelVariant> out;
  if (decode::scores_avx2() != nullptr) {
    out.push_back({"avx2", decode::scores_avx2(), decode::weigh_avx2()});
  }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (vector_isa() == VectorIsa::avx512) out.push_back({"avx512", scores_avx512, weigh_avx512});
#endif
  return out;
}

bool decode_kernels_available() {
  return kernels_off.load(std::memory_order_relaxed) == 0 && chosen() != nullptr;
}

DecodeKernelsOff::DecodeKernelsOff() { kernels_off.fetch_add(1, std::memory_order_relaxed); }
DecodeKernelsOff::~DecodeKernelsOff() { kernels_off.fetch_sub(1, std::memory_order_relaxed); }

void decode_scores(const float* const* queries, int64_t m, int64_t depth, const ColumnRun* runs,
                   size_t n_runs, int64_t key_stride, float scale, float* const* out,
                   std::vector<float>& scratch) {
  scratch.resize(static_cast<size_t>(depth * decode::kScoreQueries));
  chosen()->scores(queries, m, depth, runs, n_runs, key_stride, scale, out, scratch.data());
}

void decode_weigh(const float* const* weights, int64_t m, const ColumnRun* runs, size_t n_runs,
                  int64_t value_stride, int64_t value_depth, float* const* out) {
  chosen()->weigh(weights, m, runs, n_runs, value_stride, value_depth, out);
}

}  // namespace kvsnap::detail
