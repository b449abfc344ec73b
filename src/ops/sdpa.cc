#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvsnap/attention.h"
#include "ops/checks.h"
#include "ops/softmax.h"

namespace kvsnap {

Array sdpa(const Batch& batch, const Array& q, const KVHistory& history,
           const AttentionMask& logical, float scale) {
  constexpr const char* kCall = "sdpa";
  const Array& keys = history.keys();
  const Array& values = history.values();
  detail::require_ndim(q, 4, kCall, "q", "[B, Hq, L, D]");
  detail::require_ndim(keys, 4, kCall, "keys", "[B, H, K, D]");
  detail::require_float(q, kCall, "q");
  detail::require_float(keys, kCall, "keys");
  detail::require_float(values, kCall, "values");
  batch.validate(kCall);
  const int64_t rows = q.dim(0), query_heads = q.dim(1), queries = q.dim(2), depth = q.dim(3);
  const int64_t kv_heads = keys.dim(1), columns = keys.dim(2), value_depth = values.dim(3);
  detail::require_extent(keys, 0, rows, kCall, "keys");
  detail::require_extent(keys, 3, depth, kCall, "keys");
  if (batch.batch_size() != rows || batch.length() != queries) {
    throw Error(fmt::format("sdpa: q {} does not match the batch ({} rows of {} queries)",
                            q.describe(), batch.batch_size(), batch.length()));
  }
  if (kv_heads == 0 || query_heads % kv_heads != 0) {
    throw Error(fmt::format("sdpa: {} query heads is not a multiple of {} key/value heads (GQA)",
                            query_heads, kv_heads));
  }
  if (!std::isfinite(scale)) throw Error(fmt::format("sdpa: scale {} is not finite", scale));

  // Positional rules (causal, window) are applied on the fly; only explicit arrays are
  // materialized, through the history's apply_mask.
  const AttentionMask effective =
      history.window() > 0 ? logical.intersect(AttentionMask::lookback(history.window())) : logical;
  const bool positional = effective.arrays().empty();
  std::vector<float> mask;
  int64_t mask_heads = 1;
  if (!positional) {
    const AttentionMask physical = history.apply_mask(batch, logical);
    const Array& array = physical.arrays().front();
    mask_heads = array.dim(1);
    if (mask_heads != 1 && mask_heads != query_heads) {
      throw Error(fmt::format("sdpa: mask {} has {} heads; need 1 or Hq = {}", array.describe(),
                              mask_heads, query_heads));
    }
    mask = array.to_floats();
  }
  // Column k of a history in position order holds position first + k, so the keys a query
  // sees under causal/window rules are one contiguous range of columns.
  const bool ordered = positional && history.oldest_column() == 0;
  const int64_t first = history.first_position();
  const auto visible_range = [&](int64_t position) {
    int64_t lo = 0, hi = columns;
    if (effective.is_causal()) hi = std::clamp<int64_t>(position - first + 1, 0, columns);
    if (effective.window() > 0) {
      lo = std::clamp<int64_t>(position - effective.window() + 1 - first, 0, columns);
    }
    return std::pair{lo, std::max(lo, hi)};
  };

  // f32 views whose rows (the last axis) are unit-strided can be read in place; anything else
  // is converted once.
  const auto rows_f32 = [](const Array& a) {
    return a.dtype() == DType::f32 && a.strides()[3] == 1 ? a : a.astype(DType::f32);
  };
  const Array qf = rows_f32(q), kf = rows_f32(keys), vf = rows_f32(values);
  Array out = Array::zeros(DType::f32, {rows, query_heads, queries, value_depth});
  const int64_t group = query_heads / kv_heads;
  // Queries go through in blocks so the score matrix stays small for long prefills.
  constexpr int64_t kBlock = 128;
  std::vector<float> scores(static_cast<size_t>(std::min(queries, kBlock) * columns));
  // A hidden score: finite (the vectorized exp needs finite inputs) and so low its weight is
  // exactly 0 next to any visible score.
  constexpr float kMasked = -1e30f;
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
        int64_t lo = 0, hi = columns;
        if (ordered) {
          lo = visible_range(offset + l0).first;
          hi = visible_range(offset + l0 + block - 1).second;
        }
        const int64_t width = hi - lo;
        if (width <= 0) continue;
        // scores = scale * Q K^T over the block's columns [lo, hi).
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(block),
                    static_cast<int>(width), static_cast<int>(depth), scale,
                    query_base + l0 * q_row, static_cast<int>(q_row), key_base + lo * k_row,
                    static_cast<int>(k_row), 0.0f, scores.data(), static_cast<int>(width));
        for (int64_t r = 0; r < block; ++r) {
          float* row = scores.data() + r * width;
          const int64_t l = l0 + r, position = offset + l;
          // [begin, end): the columns this row may see; hidden ones inside get kMasked.
          int64_t begin = 0, end = width;
          if (ordered) {
            const auto [row_lo, row_hi] = visible_range(position);
            begin = row_lo - lo;
            end = row_hi - lo;
          } else if (positional) {
            for (int64_t k = 0; k < width; ++k) {
              if (!effective.allows(position, history.position(lo + k))) row[k] = kMasked;
            }
          } else {
            const float* bias =
                mask.data() +
                ((b * mask_heads + (mask_heads == 1 ? 0 : h)) * queries + l) * columns;
            for (int64_t k = 0; k < width; ++k) row[k] = std::max(row[k] + bias[lo + k], kMasked);
          }
          std::fill(row, row + begin, 0.0f);
          std::fill(row + end, row + width, 0.0f);
          float best = kMasked;
          for (int64_t k = begin; k < end; ++k) best = std::max(best, row[k]);
          if (best <= kMasked) {  // sees nothing (padding, or everything masked): zero weights
            std::fill(row + begin, row + end, 0.0f);
            continue;
          }
          const float inverse = 1.0f / detail::exp_shifted(row + begin, end - begin, best);
          for (int64_t k = begin; k < end; ++k) row[k] *= inverse;
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
