#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvsnap/attention.h"
#include "ops/checks.h"

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

  const AttentionMask physical = history.apply_mask(batch, logical);
  std::vector<float> mask;
  int64_t mask_heads = 0;
  if (!physical.arrays().empty()) {
    const Array& array = physical.arrays().front();
    mask_heads = array.dim(1);
    if (mask_heads != 1 && mask_heads != query_heads) {
      throw Error(fmt::format("sdpa: mask {} has {} heads; need 1 or Hq = {}", array.describe(),
                              mask_heads, query_heads));
    }
    mask = array.to_floats();
  }

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
  constexpr float kHidden = -std::numeric_limits<float>::infinity();

  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < query_heads; ++h) {
      const int64_t kvh = h / group;
      const float* key_base = kf.data<float>() + b * kf.strides()[0] + kvh * kf.strides()[1];
      const float* value_base = vf.data<float>() + b * vf.strides()[0] + kvh * vf.strides()[1];
      const float* query_base = qf.data<float>() + b * qf.strides()[0] + h * qf.strides()[1];
      float* out_base = out.mutable_data<float>() + (b * query_heads + h) * queries * value_depth;
      for (int64_t l0 = 0; l0 < queries; l0 += kBlock) {
        const int64_t block = std::min(kBlock, queries - l0);
        if (columns == 0) break;
        // scores = scale * Q K^T for this block of queries.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(block),
                    static_cast<int>(columns), static_cast<int>(depth), scale,
                    query_base + l0 * qf.strides()[2], static_cast<int>(qf.strides()[2]), key_base,
                    static_cast<int>(kf.strides()[2]), 0.0f, scores.data(),
                    static_cast<int>(columns));
        for (int64_t r = 0; r < block; ++r) {
          float* row = scores.data() + r * columns;
          const int64_t l = l0 + r;
          if (!mask.empty()) {
            const float* bias =
                mask.data() +
                ((b * mask_heads + (mask_heads == 1 ? 0 : h)) * queries + l) * columns;
            for (int64_t k = 0; k < columns; ++k) row[k] += bias[k];
          }
          float best = kHidden;
          for (int64_t k = 0; k < columns; ++k) best = std::max(best, row[k]);
          if (best == kHidden) {  // sees nothing (padding): a zero row of weights
            std::fill(row, row + columns, 0.0f);
            continue;
          }
          float total = 0.0f;
          for (int64_t k = 0; k < columns; ++k) {
            row[k] = std::exp(row[k] - best);
            total += row[k];
          }
          const float inverse = 1.0f / total;
          for (int64_t k = 0; k < columns; ++k) row[k] *= inverse;
        }
        // out = P V.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(block),
                    static_cast<int>(value_depth), static_cast<int>(columns), 1.0f, scores.data(),
                    static_cast<int>(columns), value_base, static_cast<int>(vf.strides()[2]), 0.0f,
                    out_base + l0 * value_depth, static_cast<int>(value_depth));
      }
    }
  }
  return out;
}

}  // namespace kvsnap
