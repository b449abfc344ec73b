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

  const std::vector<float> qf = q.to_floats();
  const std::vector<float> kf = keys.to_floats();
  const std::vector<float> vf = values.to_floats();
  Array out = Array::zeros(DType::f32, {rows, query_heads, queries, value_depth});
  float* o = out.mutable_data<float>();
  const int64_t group = query_heads / kv_heads;
  std::vector<float> scores(static_cast<size_t>(columns));

  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < query_heads; ++h) {
      const int64_t kvh = h / group;
      const float* key_base = kf.data() + (b * kv_heads + kvh) * columns * depth;
      const float* value_base = vf.data() + (b * kv_heads + kvh) * columns * value_depth;
      for (int64_t l = 0; l < queries; ++l) {
        const float* query = qf.data() + ((b * query_heads + h) * queries + l) * depth;
        const float* bias =
            mask.empty()
                ? nullptr
                : mask.data() +
                      ((b * mask_heads + (mask_heads == 1 ? 0 : h)) * queries + l) * columns;
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < columns; ++k) {
          float dot = 0.0f;
          const float* key = key_base + k * depth;
          for (int64_t d = 0; d < depth; ++d) dot += query[d] * key[d];
          float score = dot * scale + (bias ? bias[k] : 0.0f);
          scores[static_cast<size_t>(k)] = score;
          best = std::max(best, score);
        }
        float* row = o + ((b * query_heads + h) * queries + l) * value_depth;
        if (best == -std::numeric_limits<float>::infinity()) continue;  // sees nothing: zeros
        float total = 0.0f;
        for (int64_t k = 0; k < columns; ++k) {
          const float weight = std::exp(scores[static_cast<size_t>(k)] - best);
          scores[static_cast<size_t>(k)] = weight;
          total += weight;
        }
        for (int64_t k = 0; k < columns; ++k) {
          const float weight = scores[static_cast<size_t>(k)] / total;
          const float* value = value_base + k * value_depth;
          for (int64_t d = 0; d < value_depth; ++d) row[d] += weight * value[d];
        }
      }
    }
  }
  return out;
}

}  // namespace kvsnap
