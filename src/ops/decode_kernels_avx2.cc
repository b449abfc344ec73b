// Decode attention's products (decode_kernels.h) for CPUs with AVX2 and FMA: scores with 8 queries
// per vector (one lane each), up to three vectors and 12 / vectors key columns at a time, stored
// transposed in registers (a query's scores of four columns in one store); outputs
// with 32 value columns in four vectors for up to 3 queries at a time, over runs of columns. Each
// lane is the same fma chain in the same order as the AVX-512 variant's (the depth from zero, then
// the scale, for a score; the columns in order onto the output for an output), so the two give
// bitwise the same results, and tiles and sharing never change one.
#include <algorithm>
#include <array>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ops/decode_kernels_common.h"
#include "ops/vector_isa.h"

namespace kvsnap::detail::decode {
namespace {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

// The sums a tile keeps in flight: fmas take five cycles and two issue a cycle, so ten chains at
// least keep them busy; twelve leave room for the loads.
constexpr int kSums = 12;

// T tiles of 8 queries (qt: [T][depth][8]) against U key columns: each key element broadcast
// once for all T tiles. T * U = 12 sums, T query vectors and a key: at most 16 registers.
template <int T, int U>
[[gnu::target("avx2,fma"), gnu::always_inline]] inline void score_group(
    const float* qt, int64_t depth, const float* k, int64_t stride, __m256 (&sums)[T][U]) {
  for (int t = 0; t < T; ++t) {
    for (int u = 0; u < U; ++u) sums[t][u] = _mm256_setzero_ps();
  }
  for (int64_t d = 0; d < depth; ++d) {
    __m256 x[T];
    for (int t = 0; t < T; ++t) x[t] = _mm256_loadu_ps(qt + (t * depth + d) * 8);
    for (int u = 0; u < U; ++u) {
      const __m256 key = _mm256_broadcast_ss(k + u * stride + d);
      for (int t = 0; t < T; ++t) sums[t][u] = _mm256_fmadd_ps(key, x[t], sums[t][u]);
    }
  }
}

// Four vectors of columns c..c+3 (lane i: query i) transposed in registers: query i's four
// scores become one 128-bit store at out[i] + c, for the queries below `queries`.
[[gnu::target("avx2,fma"), gnu::always_inline]] inline void store4(const __m256* v,
                                                                   float* const* out, int64_t c,
                                                                   int64_t queries) {
  const __m256 lo01 = _mm256_unpacklo_ps(v[0], v[1]), hi01 = _mm256_unpackhi_ps(v[0], v[1]),
               lo23 = _mm256_unpacklo_ps(v[2], v[3]), hi23 = _mm256_unpackhi_ps(v[2], v[3]);
  // Query i (i < 4) in the low half of row[i], query i + 4 in its high half.
  const __m256 row[4] = {_mm256_shuffle_ps(lo01, lo23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(lo01, lo23, _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm256_shuffle_ps(hi01, hi23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(hi01, hi23, _MM_SHUFFLE(3, 2, 3, 2))};
  for (int64_t i = 0; i < std::min<int64_t>(4, queries); ++i) {
    _mm_storeu_ps(out[i] + c, _mm256_castps256_ps128(row[i]));
  }
  for (int64_t i = 4; i < queries; ++i) {
    _mm_storeu_ps(out[i] + c, _mm256_extractf128_ps(row[i - 4], 1));
  }
}

// Two vectors of columns c, c+1 transposed: query i's two scores one 64-bit store.
[[gnu::target("avx2,fma"), gnu::always_inline]] inline void store2(const __m256* v,
                                                                   float* const* out, int64_t c,
                                                                   int64_t queries) {
  const __m256 lo = _mm256_unpacklo_ps(v[0], v[1]), hi = _mm256_unpackhi_ps(v[0], v[1]);
  // Queries 0, 1 | 4, 5 in lo; 2, 3 | 6, 7 in hi.
  const __m128 half[4] = {_mm256_castps256_ps128(lo), _mm256_castps256_ps128(hi),
                          _mm256_extractf128_ps(lo, 1), _mm256_extractf128_ps(hi, 1)};
  for (int64_t i = 0; i < queries; i += 2) {
    _mm_storel_pi(reinterpret_cast<__m64*>(out[i] + c), half[i / 2]);
    if (i + 1 < queries) _mm_storeh_pi(reinterpret_cast<__m64*>(out[i + 1] + c), half[i / 2]);
  }
}

// sums[t][u] lane i is query 8t + i's score of column c + u: scaled, to out[8t + i][c + u] for
// the queries below `valid`, transposed in registers four columns at a time (then two, then one).
template <int T, int U>
[[gnu::target("avx2,fma"), gnu::always_inline]] inline void store_group(__m256 (&sums)[T][U],
                                                                        __m256 scale,
                                                                        float* const* out,
                                                                        int64_t c, int64_t valid) {
  // Unrolled, so that the sums stay in registers (an indexed sums[t] made GCC store them all on
  // every step of the depth).
#pragma GCC unroll 3
  for (int t = 0; t < T; ++t) {
    const int64_t queries = std::min<int64_t>(8, valid - 8 * t);
    float* const* rows = out + 8 * t;
    __m256 v[U];
    for (int u = 0; u < U; ++u) v[u] = _mm256_mul_ps(sums[t][u], scale);
    int u = 0;
#pragma GCC unroll 3
    for (; u + 4 <= U; u += 4) store4(v + u, rows, c + u, queries);
    if constexpr (U % 4 >= 2) {
      store2(v + u, rows, c + u, queries);
      u += 2;
    }
    if constexpr (U % 2 == 1) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, v[u]);
      for (int64_t i = 0; i < queries; ++i) rows[i][c + u] = lanes[i];
    }
  }
}

// Scores of T tiles of queries (qt) over a span's pieces of key columns, into out[i][column]. The
// first tiles over a span fetch ahead (Fetch); the others find its keys in the caches.
template <int T, bool Fetch>
[[gnu::target("avx2,fma"), gnu::noinline]] void score_tiles(const float* qt, int64_t depth,
                                                            const Piece* pieces, size_t n,
                                                            int64_t stride, float scale_by,
                                                            float* const* out, int64_t valid,
                                                            Lookahead& ahead) {
  constexpr int U = kSums / T;
  const __m256 scale = _mm256_set1_ps(scale_by);
  for (size_t p = 0; p < n; ++p) {
    const float* keys = pieces[p].values;
    const int64_t count = pieces[p].count, at = pieces[p].column;
    int64_t c = 0;
    for (; c + U <= count; c += U) {
      if constexpr (Fetch) ahead.fetch(U);
      __m256 sums[T][U];
      score_group<T, U>(qt, depth, keys + c * stride, stride, sums);
      store_group<T, U>(sums, scale, out, at + c, valid);
    }
    if constexpr (Fetch) ahead.fetch(count - c);
    for (; c < count; ++c) {
      __m256 sums[T][1];
      score_group<T, 1>(qt, depth, keys + c * stride, stride, sums);
      store_group<T, 1>(sums, scale, out, at + c, valid);
    }
  }
}

using TilesFn = void (*)(const float*, int64_t, const Piece*, size_t, int64_t, float, float* const*,
                         int64_t, Lookahead&);
constexpr std::array<std::array<TilesFn, 2>, 3> kScoreTiles = {{
    {score_tiles<1, false>, score_tiles<1, true>},
    {score_tiles<2, false>, score_tiles<2, true>},
    {score_tiles<3, false>, score_tiles<3, true>},
}};

// Queries in passes of up to 32 (tiles of 8, one lane each; a partial tile's spare lanes are
// zero and never stored), transposed once per pass into qt; keys in spans (for_each_span), every
// group of tiles over a span before the next, so its keys come from memory once.
[[gnu::target("avx2,fma")]] void scores(const float* const* q, int64_t m, int64_t depth,
                                        const ColumnRun* runs, size_t n, int64_t stride,
                                        float scale, float* const* out, float* qt) {
  for (int64_t i0 = 0; i0 < m; i0 += kScoreQueries) {
    const int64_t valid = std::min(kScoreQueries, m - i0),
                  tiles = transpose_queries(q + i0, valid, depth, 8, qt);
    Lookahead ahead(runs, n, stride, depth);
    for_each_span(runs, n, stride, [&](const Piece* span, size_t pieces) {
      for (int64_t t = 0; t < tiles;) {
        const int64_t take = tiles - t == 4 ? 2 : tiles - t;  // groups of 3, 2 or 1 tiles
        kScoreTiles[static_cast<size_t>(take - 1)][t == 0 ? 1 : 0](
            qt + t * depth * 8, depth, span, pieces, stride, scale, out + i0 + 8 * t, valid - 8 * t,
            ahead);
        t += take;
      }
    });
  }
}

// T queries, 32 value columns in four vectors each (4T sums), over one piece's columns in order
// onto what the outputs hold. A column's weights are broadcast first, then each vector of its
// values loaded once for the T queries: 4T + T + 1 <= 16 registers. (Sums kept across pieces
// made GCC store all twelve on every column.) Fetch: 8 columns ahead at a time.
template <int T, bool Fetch>
[[gnu::target("avx2,fma"), gnu::always_inline]] inline void weigh_piece(const float* const* w,
                                                                        const Piece& piece,
                                                                        int64_t stride, int64_t v0,
                                                                        float* const* out,
                                                                        Lookahead& ahead) {
  __m256 sums[T][4];
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < 4; ++j) sums[t][j] = _mm256_loadu_ps(out[t] + v0 + 8 * j);
  }
  const float* values = piece.values + v0;
  const float* weights[T];
  for (int t = 0; t < T; ++t) weights[t] = w[t] + piece.column;
  for (int64_t c = 0; c < piece.count; ++c) {
    if constexpr (Fetch) {
      if (c % 8 == 0) ahead.fetch(std::min<int64_t>(8, piece.count - c));
    }
    __m256 x[T];
    for (int t = 0; t < T; ++t) x[t] = _mm256_broadcast_ss(weights[t] + c);
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(values + c * stride + 8 * j);
      for (int t = 0; t < T; ++t) sums[t][j] = _mm256_fmadd_ps(x[t], v, sums[t][j]);
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out[t] + v0 + 8 * j, sums[t][j]);
  }
}

// The first tile over a span fetches ahead; the others find its columns in the caches.
template <int T>
[[gnu::target("avx2,fma"), gnu::noinline]] void weigh_tiles(bool fetch, const float* const* w,
                                                            const Piece* pieces, size_t n,
                                                            int64_t stride, int64_t v0,
                                                            float* const* out, Lookahead& ahead) {
  for (size_t p = 0; p < n; ++p) {
    if (fetch) {
      weigh_piece<T, true>(w, pieces[p], stride, v0, out, ahead);
    } else {
      weigh_piece<T, false>(w, pieces[p], stride, v0, out, ahead);
    }
  }
}

using WeighTilesFn = void (*)(bool, const float* const*, const Piece*, size_t, int64_t, int64_t,
                              float* const*, Lookahead&);
constexpr std::array<WeighTilesFn, 3> kWeighTiles = {weigh_tiles<1>, weigh_tiles<2>,
                                                     weigh_tiles<3>};

// The runs' columns in spans (for_each_span): every query tile goes over a span before the next
// span, so its values come from memory once. Queries in tiles of 3 (12 sums), a rest of 4 as
// 2 + 2 and of 1 or 2 as one tile.
[[gnu::target("avx2,fma")]] void weigh(const float* const* w, int64_t m, const ColumnRun* runs,
                                       size_t n_runs, int64_t stride, int64_t value_depth,
                                       float* const* out) {
  const int64_t wide = value_depth / 32 * 32;
  Lookahead ahead(runs, n_runs, stride, value_depth);
  for_each_span(runs, n_runs, stride, [&](const Piece* span, size_t pieces) {
    for (int64_t v0 = 0; v0 < wide; v0 += 32) {
      for (int64_t i = 0; i < m;) {
        const int64_t left = m - i, take = left >= 5 || left == 3 ? 3 : std::min<int64_t>(2, left);
        kWeighTiles[static_cast<size_t>(take - 1)](v0 == 0 && i == 0, w + i, span, pieces, stride,
                                                   v0, out + i, ahead);
        i += take;
      }
    }
  });
  weigh_tail(w, m, runs, n_runs, stride, wide, value_depth, out);
}

bool runs_here() {
  const VectorIsa isa = vector_isa();
  return isa == VectorIsa::avx2 || isa == VectorIsa::avx512;
}
#else
constexpr ScoresFn scores = nullptr;
constexpr WeighFn weigh = nullptr;
bool runs_here() { return false; }
#endif

}  // namespace

ScoresFn scores_avx2() { return runs_here() ? scores : nullptr; }
WeighFn weigh_avx2() { return runs_here() ? weigh : nullptr; }

}  // namespace kvsnap::detail::decode
