// Internal to the decode kernels (decode_kernels.h): what the kernels for each instruction set
// share — the signatures a variant provides, how far ahead they fetch, the spans the outputs go
// over, the cursor that fetches, and the plain fma chain for value columns past the vectors.
// Nothing here carries a target attribute, so it inlines into every variant.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "ops/decode_kernels.h"

namespace kvsnap::detail::decode {

// In a decode step these kernels read keys and values that the weights' stream has pushed out of
// the caches, in blocks 4 KB apart where the hardware's prefetch stops: they fetch the columns
// this far ahead of the product, across runs (Lookahead).
constexpr int64_t kAhead = 32;
// The outputs go over the columns in runs this long (32 KB of values at depth 32), every query
// tile over a run before the next, so the values come from memory once, not once per tile.
constexpr int64_t kWeighRun = 256;
// Queries per pass of the many-query scores (the scratch holds them transposed: depth x 32).
constexpr int64_t kScoreQueries = 32;

using ScoresFn = void (*)(const float* const* q, int64_t m, int64_t depth, const ColumnRun* runs,
                          size_t n, int64_t stride, float scale, float* const* out, float* qt);
using WeighFn = void (*)(const float* const* w, int64_t m, const ColumnRun* runs, size_t n,
                         int64_t stride, int64_t value_depth, float* const* out);

// Queries q[0, valid) (valid <= kScoreQueries) into qt as tiles of `lanes` queries, one lane each:
// qt[(t * depth + d) * lanes + i] = query lanes * t + i's element d; a partial tile's spare
// lanes 0. Returns the tile count.
inline int64_t transpose_queries(const float* const* q, int64_t valid, int64_t depth, int64_t lanes,
                                 float* qt) {
  const int64_t tiles = (valid + lanes - 1) / lanes;
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t d = 0; d < depth; ++d) {
      for (int64_t i = 0; i < lanes; ++i) {
        const int64_t query = lanes * t + i;
        qt[(t * depth + d) * lanes + i] = query < valid ? q[query][d] : 0.0f;
      }
    }
  }
  return tiles;
}

// A cursor kAhead columns ahead of a product over runs of columns (`depth` floats each, `stride`
// apart): fetch(n) asks the caches for the next n columns' lines, crossing into the next run
// where one ends. Prefetches are hints: they never fault and never change a result.
class Lookahead {
 public:
  Lookahead(const ColumnRun* runs, size_t n, int64_t stride, int64_t depth)
      : runs_(runs),
        n_(n),
        at_(n > 0 ? reinterpret_cast<uintptr_t>(runs[0].data) : 0),
        left_(n > 0 ? runs[0].count : 0),
        stride_(stride),
        bytes_(depth * 4) {
    fetch(kAhead);
  }

  // Within the current run inline (the kernels' loops stay in registers); across runs out of
  // line.
  [[gnu::always_inline]] void fetch(int64_t columns) {
    if (columns > left_) return fetch_across(columns);
    issue(columns);
  }

 private:
  [[gnu::always_inline]] void issue(int64_t columns) {
    for (int64_t c = 0; c < columns; ++c) {
      const uintptr_t column = at_ + static_cast<uintptr_t>(c * stride_) * sizeof(float);
      for (int64_t b = 0; b < bytes_; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(column + static_cast<uintptr_t>(b)), 0, 3);
      }
    }
    at_ += static_cast<uintptr_t>(columns * stride_) * sizeof(float);
    left_ -= columns;
  }

  [[gnu::noinline]] void fetch_across(int64_t columns) {
    while (columns > 0) {
      if (left_ == 0) {
        if (++r_ >= n_) return;
        at_ = reinterpret_cast<uintptr_t>(runs_[r_].data);
        left_ = runs_[r_].count;
        continue;
      }
      const int64_t take = std::min(columns, left_);
      issue(take);
      columns -= take;
    }
  }

  const ColumnRun* runs_;
  size_t n_, r_ = 0;
  uintptr_t at_;  // the next column to fetch: an integer, as it may step past a strided view
  int64_t left_, stride_, bytes_;
};

// A stretch of one run's columns that a span of the outputs' work covers: `count` value rows
// from `values` (stride apart), weighed by each query's weights from column `column` on.
struct Piece {
  const float* values;
  int64_t column, count;
};

// The runs' columns in spans of up to kWeighRun (a long run cut, short ones gathered), each
// handed to flush(pieces, n) in order.
template <class Flush>
void for_each_span(const ColumnRun* runs, size_t n_runs, int64_t stride, Flush&& flush) {
  std::array<Piece, kWeighRun> span;  // at most kWeighRun columns, so at most as many pieces
  size_t pieces = 0;
  int64_t filled = 0, column = 0;
  for (size_t r = 0; r < n_runs; ++r) {
    for (int64_t c = 0; c < runs[r].count;) {
      const int64_t take = std::min(kWeighRun - filled, runs[r].count - c);
      span[pieces++] = {runs[r].data + c * stride, column, take};
      c += take;
      column += take;
      filled += take;
      if (filled == kWeighRun) {
        flush(span.data(), pieces);
        pieces = 0;
        filled = 0;
      }
    }
  }
  if (pieces > 0) flush(span.data(), pieces);
}

// Value columns [from, value_depth) as plain fma chains over the runs' columns, in order.
inline void weigh_tail(const float* const* w, int64_t m, const ColumnRun* runs, size_t n_runs,
                       int64_t stride, int64_t from, int64_t value_depth, float* const* out) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t v = from; v < value_depth; ++v) {
      float acc = out[i][v];
      int64_t at = 0;
      for (size_t r = 0; r < n_runs; ++r) {
        for (int64_t c = 0; c < runs[r].count; ++c, ++at) {
          acc = std::fma(w[i][at], runs[r].data[c * stride + v], acc);
        }
      }
      out[i][v] = acc;
    }
  }
}

// The AVX2 variant (decode_kernels_avx2.cc); null where the build has none.
ScoresFn scores_avx2();
WeighFn weigh_avx2();

}  // namespace kvsnap::detail::decode
