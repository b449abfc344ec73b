// Internal: which key columns each query of an attention call sees, and the softmax of one
// row of scores under it (shared by the general and the decode paths of sdpa).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "array/f32_in_order.h"
#include "kvsnap/attention.h"
#include "kvsnap/batch.h"
#include "kvsnap/error.h"
#include "ops/decode_kernels.h"
#include "ops/softmax.h"

namespace kvsnap::detail {

// A hidden score: finite (the vectorized exp needs finite inputs) and so low its weight is
// exactly 0 next to any visible score.
constexpr float kMasked = -1e30f;
// Which key columns each query sees. Positional rules (causal, lookback) apply on the fly; only
// explicit arrays are materialized, through the history's apply_mask.
class Visibility {
 public:
  Visibility(const Batch& batch, const KVHistory& history, const AttentionMask& logical,
             int64_t query_heads)
      : history_(history),
        effective_(history.window() > 0
                       ? logical.intersect(AttentionMask::lookback(history.window()))
                       : logical),
        positional_(effective_.arrays().empty()),
        // Column k of a history in position order holds position first + k, so the keys a
        // query sees under positional rules are one contiguous range of columns.
        ordered_(positional_ && history.oldest_column() == 0),
        columns_(history.length()),
        queries_(batch.length()) {
    if (positional_) return;
    const AttentionMask physical = history.apply_mask(batch, logical);
    const Array& array = physical.arrays().front();
    mask_heads_ = array.dim(1);
    if (mask_heads_ != 1 && mask_heads_ != query_heads) {
      throw Error(fmt::format("sdpa: mask {} has {} heads; need 1 or Hq = {}", array.describe(),
                              mask_heads_, query_heads));
    }
    // Read where apply_mask built it (f32, in order): no second copy of a mask that may be large.
    bias_array_ = detail::f32_in_order(array);
    bias_ = bias_array_.data<float>();
  }

  // The columns [lo, hi) queries at positions [first, last] may see (all when not ordered).
  // Whether only positional rules apply and columns are in position order (one range per query).
  bool ordered() const { return ordered_; }

  std::pair<int64_t, int64_t> columns(int64_t first, int64_t last) const {
    if (!ordered_) return {0, columns_};
    return {visible(first).first, visible(last).second};
  }

  // Hides the columns query `l` (of row b, head h, at `position`) may not see in `row`, its
  // scores over columns [lo, lo + width); returns the range [begin, end) of the row it may see.
  std::pair<int64_t, int64_t> mask(float* row, int64_t lo, int64_t width, int64_t b, int64_t h,
                                   int64_t l, int64_t position) const {
    if (ordered_) {
      const auto [row_lo, row_hi] = visible(position);
      return {row_lo - lo, row_hi - lo};
    }
    if (positional_) {  // a rotated history: column c holds position first + (c - oldest) mod n
      const int64_t n = columns_, first = history_.first_position();
      int64_t at = width > 0 ? (lo - history_.oldest_column() + n) % n : 0;
      for (int64_t k = 0; k < width; ++k) {
        if (!effective_.allows(position, first + at)) row[k] = kMasked;
        if (++at == n) at = 0;
      }
      return {0, width};
    }
    const float* bias =
        bias_ + ((b * mask_heads_ + (mask_heads_ == 1 ? 0 : h)) * queries_ + l) * columns_;
    // A column the mask hides is hidden whatever its score (a NaN or infinite key's included:
    // NaN + -inf stays NaN, and would reach every output of the row).
    for (int64_t k = 0; k < width; ++k) {
      const float biased = row[k] + bias[lo + k];
      row[k] = bias[lo + k] == -std::numeric_limits<float>::infinity() || biased < kMasked ? kMasked
                                                                                           : biased;
    }
    return {0, width};
  }

 private:
  std::pair<int64_t, int64_t> visible(int64_t position) const {
    const int64_t first = history_.first_position();
    int64_t lo = 0, hi = columns_;
    if (effective_.is_causal()) hi = std::clamp<int64_t>(position - first + 1, 0, columns_);
    if (effective_.window() > 0) {  // the columns before the window's; no overflow for any window
      const int64_t through = position - first + 1;  // columns up to the query's position
      lo = std::clamp<int64_t>(through > effective_.window() ? through - effective_.window() : 0, 0,
                               columns_);
    }
    return {lo, std::max(lo, hi)};
  }

  const KVHistory& history_;
  const AttentionMask effective_;
  const bool positional_, ordered_;
  const int64_t columns_, queries_;
  int64_t mask_heads_ = 1;
  Array bias_array_;             // the built mask, [B, 1 or Hq, L, K] f32 in order
  const float* bias_ = nullptr;  // its values
};

// The numerators of a softmax over row[begin, end), in place: exp(row - its maximum) there, 0 in
// the rest of the row's `width` columns. Returns their sum — what the caller divides the weighed
// values by (one division per output instead of one per column) — or 0 for a row that sees
// nothing (padding, or everything masked), whose weights are all 0. Scores that are NaN (a NaN
// query or key: a model that diverged) give NaN weights and sum, so the outputs they reach are
// NaN: max_of may drop a NaN, and a row of nothing but NaN would otherwise read as one that
// sees nothing, its outputs a silent 0 (in some builds, not others).
inline float softmax_numerators(float* row, int64_t width, int64_t begin, int64_t end) {
  std::fill(row, row + begin, 0.0f);
  std::fill(row + end, row + width, 0.0f);
  const float best = detail::max_of(row + begin, end - begin, kMasked);
  if (best <= kMasked) {  // sees nothing — or only NaN (rare: the scan costs nothing otherwise)
    const bool nan = std::any_of(row + begin, row + end, [](float v) { return std::isnan(v); });
    const float weight = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    std::fill(row + begin, row + end, weight);
    return weight;
  }
  return detail::exp_shifted(row + begin, end - begin, best);
}

// Whether the kernels read `a` ([*, H, K, D] keys or values) in place: f32, its rows (the last
// axis) unit-strided and apart — a row stride of at least their length, as a BLAS leading
// dimension must be (not a broadcast column of stride 0, nor rows that overlap). Anything else
// is converted first.
inline bool rows_in_place(const Array& a) {
  return a.dtype() == DType::f32 && a.strides()[3] == 1 &&
         a.strides()[2] >= std::max<int64_t>(a.dim(3), 1);
}

// Whether out[0, n) holds only finite values.
inline bool all_finite(const float* out, int64_t n) {
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(out[i]);
  return finite;
}

// out[0, value_depth) += weights[c] * value(c) over the runs' columns (a row of `stride` floats
// each) in order, as the weighing kernels' fma chains add them, but for the columns whose weight
// is 0: a column the query does not see but that lies in the range the kernels weigh for it (a
// later query's, a window's older one, another row's part of a shared block) holds a value that
// must not reach it, and 0 times an infinite or NaN value is NaN. The kernels weigh every column
// of their range; a row whose sum came out not finite is weighed again with this. A non-finite
// value it sees with a weight above 0 (or NaN) still reaches it; one whose weight underflowed to
// exactly 0 adds nothing, as in any other call that weighs it.
inline void weigh_seen(const float* weights, const ColumnRun* runs, size_t n_runs, int64_t stride,
                       int64_t value_depth, float* out) {
  for (size_t r = 0; r < n_runs; ++r) {
    for (int64_t c = 0; c < runs[r].count; ++c) {
      const float w = *weights++;
      if (w == 0.0f) continue;
      const float* value = runs[r].data + c * stride;
      for (int64_t v = 0; v < value_depth; ++v) out[v] = std::fma(w, value[v], out[v]);
    }
  }
}

// out[0, n) /= sum (a softmax's denominator from softmax_numerators; 0 leaves zeros, NaN makes
// them NaN).
inline void divide_by(float* out, int64_t n, float sum) {
  const float inverse = sum > 0.0f ? 1.0f / sum : std::isnan(sum) ? sum : 0.0f;
  for (int64_t i = 0; i < n; ++i) out[i] *= inverse;
}

}  // namespace kvsnap::detail
