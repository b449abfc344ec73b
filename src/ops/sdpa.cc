#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvsnap/ops.h"
#include "ops/checks.h"
#include "ops/softmax.h"

namespace kvsnap {
namespace {

// A hidden score: finite (the vectorized exp needs finite inputs) and so low its weight is
// exactly 0 next to any visible score.
constexpr float kMasked = -1e30f;
// Queries go through in blocks so the score matrix stays small for long prefills.
constexpr int64_t kBlock = 128;

void check_inputs(const Batch& batch, const Array& q, const KVHistory& history, float scale) {
  constexpr const char* kCall = "sdpa";
  const Array& keys = history.keys();
  detail::require_ndim(q, 4, kCall, "q", "[B, Hq, L, D]");
  detail::require_ndim(keys, 4, kCall, "keys", "[B, H, K, D]");
  detail::require_float(q, kCall, "q");
  detail::require_float(keys, kCall, "keys");
  detail::require_float(history.values(), kCall, "values");
  batch.validate(kCall);
  detail::require_extent(keys, 0, q.dim(0), kCall, "keys");
  detail::require_extent(keys, 3, q.dim(3), kCall, "keys");
  if (batch.batch_size() != q.dim(0) || batch.length() != q.dim(2)) {
    throw Error(fmt::format("sdpa: q {} does not match the batch ({} rows of {} queries)",
                            q.describe(), batch.batch_size(), batch.length()));
  }
  if (keys.dim(1) == 0 || q.dim(1) % keys.dim(1) != 0) {
    throw Error(fmt::format("sdpa: {} query heads is not a multiple of {} key/value heads (GQA)",
                            q.dim(1), keys.dim(1)));
  }
  if (!std::isfinite(scale)) throw Error(fmt::format("sdpa: scale {} is not finite", scale));
}

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
    bias_ = array.to_floats();
  }

  // The columns [lo, hi) queries at positions [first, last] may see (all when not ordered).
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
    if (positional_) {
      for (int64_t k = 0; k < width; ++k) {
        if (!effective_.allows(position, history_.position(lo + k))) row[k] = kMasked;
      }
      return {0, width};
    }
    const float* bias =
        bias_.data() + ((b * mask_heads_ + (mask_heads_ == 1 ? 0 : h)) * queries_ + l) * columns_;
    for (int64_t k = 0; k < width; ++k) row[k] = std::max(row[k] + bias[lo + k], kMasked);
    return {0, width};
  }

 private:
  std::pair<int64_t, int64_t> visible(int64_t position) const {
    const int64_t first = history_.first_position();
    int64_t lo = 0, hi = columns_;
    if (effective_.is_causal()) hi = std::clamp<int64_t>(position - first + 1, 0, columns_);
    if (effective_.window() > 0) {
      lo = std::clamp<int64_t>(position - effective_.window() + 1 - first, 0, columns_);
    }
    return {lo, std::max(lo, hi)};
  }

  const KVHistory& history_;
  const AttentionMask effective_;
  const bool positional_, ordered_;
  const int64_t columns_, queries_;
  int64_t mask_heads_ = 1;
  std::vector<float> bias_;
};

// Softmax over row[begin, end) in place; the rest of the row's `width` columns get weight 0, as
// does a row that sees nothing (padding, or everything masked).
void softmax_row(float* row, int64_t width, int64_t begin, int64_t end) {
  std::fill(row, row + begin, 0.0f);
  std::fill(row + end, row + width, 0.0f);
  float best = kMasked;
  for (int64_t k = begin; k < end; ++k) best = std::max(best, row[k]);
  if (best <= kMasked) {
    std::fill(row + begin, row + end, 0.0f);
    return;
  }
  const float inverse = 1.0f / detail::exp_shifted(row + begin, end - begin, best);
  for (int64_t k = begin; k < end; ++k) row[k] *= inverse;
}

// f32 views whose rows (the last axis) are unit-strided are read in place; anything else is
// converted once.
Array rows_f32(const Array& a) {
  return a.dtype() == DType::f32 && a.strides()[3] == 1 ? a : a.astype(DType::f32);
}

}  // namespace

Array sdpa(const Batch& batch, const Array& q, const KVHistory& history,
           const AttentionMask& logical, float scale) {
  check_inputs(batch, q, history, scale);
  const int64_t rows = q.dim(0), query_heads = q.dim(1), queries = q.dim(2), depth = q.dim(3);
  const int64_t columns = history.length(), value_depth = history.values().dim(3);
  const Visibility visibility(batch, history, logical, query_heads);
  const Array qf = rows_f32(q), kf = rows_f32(history.keys()), vf = rows_f32(history.values());
  Array out = Array::zeros(DType::f32, {rows, query_heads, queries, value_depth});
  const int64_t group = query_heads / history.keys().dim(1);
  std::vector<float> scores(static_cast<size_t>(std::min(queries, kBlock) * columns));
  const int64_t q_row = qf.strides()[2], k_row = kf.strides()[2], v_row = vf.strides()[2];

  for (int64_t b = 0; b < rows; ++b) {
    const int64_t offset = batch.seq_offsets[b], real = batch.seq_query_lens[b];
    for (int64_t h = 0; h < query_heads; ++h) {
      const int64_t kvh = h / group;
      const float* key_base = kf.data<float>() + b * kf.strides()[0] + kvh * kf.strides()[1];
      const float* value_base = vf.data<float>() + b * vf.strides()[0] + kvh * vf.strides()[1];
      const float* query_base = qf.data<float>() + b * qf.strides()[0] + h * qf.strides()[1];
      float* out_base = out.mutable_data<float>() + (b * query_heads + h) * queries * value_depth;
      for (int64_t l0 = 0; l0 < real; l0 += kBlock) {
        const int64_t block = std::min(kBlock, real - l0);  // padding rows stay zero
        const auto [lo, hi] = visibility.columns(offset + l0, offset + l0 + block - 1);
        const int64_t width = hi - lo;
        if (width <= 0) continue;
        // scores = scale * Q K^T over the block's columns [lo, hi).
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(block),
                    static_cast<int>(width), static_cast<int>(depth), scale,
                    query_base + l0 * q_row, static_cast<int>(q_row), key_base + lo * k_row,
                    static_cast<int>(k_row), 0.0f, scores.data(), static_cast<int>(width));
        for (int64_t r = 0; r < block; ++r) {
          float* row = scores.data() + r * width;
          const auto [begin, end] = visibility.mask(row, lo, width, b, h, l0 + r, offset + l0 + r);
          softmax_row(row, width, begin, end);
        }
        // out = P V.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(block),
                    static_cast<int>(value_depth), static_cast<int>(width), 1.0f, scores.data(),
                    static_cast<int>(width), value_base + lo * v_row, static_cast<int>(v_row), 0.0f,
                    out_base + l0 * value_depth, static_cast<int>(value_depth));
      }
    }
  }
  return out;
}

}  // namespace kvsnap
