// Shared helpers for cache tests: deterministic per-token keys/values whose first value element
// is the token's id, so any history can be read back as "which token is in which column".
#pragma once

#include <kvsnap/kvsnap.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace kvsnap::testing {

// Keys/values of tokens by id: value[h][0] == id exactly (a tag); the rest a fixed function of
// (id, head, element) of magnitude <= 1, so stored data can be compared bit for bit and
// attention over it stays well conditioned.
struct TokenKV {
  int64_t heads = 2;
  int64_t depth = 4;
  DType dtype = DType::f32;

  float key(int64_t id, int64_t h, int64_t d) const {
    return std::sin(static_cast<float>(id) * 1.37f + static_cast<float>(h * 31 + d) * 0.71f);
  }
  float value(int64_t id, int64_t h, int64_t d) const {
    if (d == 0) return static_cast<float>(id);
    return std::cos(static_cast<float>(id) * 0.93f + static_cast<float>(h * 17 + d) * 1.13f);
  }

  // [rows, H, L, D] for tokens `ids` (every row the same).
  Array keys(std::span<const int64_t> ids, int64_t rows = 1) const { return make(ids, rows, true); }
  Array values(std::span<const int64_t> ids, int64_t rows = 1) const {
    return make(ids, rows, false);
  }

  Array make(std::span<const int64_t> ids, int64_t rows, bool is_key) const {
    const auto length = static_cast<int64_t>(ids.size());
    std::vector<float> data;
    data.reserve(static_cast<size_t>(rows * heads * length * depth));
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t id : ids)
          for (int64_t d = 0; d < depth; ++d)
            data.push_back(is_key ? key(id, h, d) : value(id, h, d));
    return Array::from_floats(data, {rows, heads, length, depth}, dtype);
  }

  // Keys (or values) [rows.size(), H, L, D], row b for tokens rows[b] (all of one length L).
  Array stacked(const std::vector<std::vector<int64_t>>& rows, bool is_key) const {
    std::vector<float> data;
    for (const std::vector<int64_t>& ids : rows) {
      const std::vector<float> row = make(ids, 1, is_key).to_floats();
      data.insert(data.end(), row.begin(), row.end());
    }
    return Array::from_floats(data,
                              {static_cast<int64_t>(rows.size()), heads,
                               static_cast<int64_t>(rows.front().size()), depth},
                              dtype);
  }
};

// `a` followed by `b`.
inline std::vector<int64_t> concat_ids(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The token id held by each column of a history (row 0, head 0), in column order.
inline std::vector<int64_t> column_ids(const KVHistory& history) {
  if (history.paged()) return column_ids(history.contiguous());
  std::vector<int64_t> ids;
  if (history.keys().empty()) return ids;
  const auto values = history.values().slice(0, 0, 1).slice(1, 0, 1).to_floats();
  const int64_t depth = history.values().dim(3);
  for (int64_t k = 0; k < history.length(); ++k) {
    ids.push_back(static_cast<int64_t>(values[static_cast<size_t>(k * depth)]));
  }
  return ids;
}

// The token id at each absolute position the history holds, ordered by position.
inline std::vector<std::pair<int64_t, int64_t>> position_ids(const KVHistory& history) {
  const auto ids = column_ids(history);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t k = 0; k < history.length(); ++k) out.emplace_back(history.position(k), ids[k]);
  std::sort(out.begin(), out.end());
  return out;
}

// Range [first, first + count) of token ids.
inline std::vector<int64_t> id_range(int64_t first, int64_t count) {
  std::vector<int64_t> ids(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) ids[static_cast<size_t>(i)] = first + i;
  return ids;
}

// Writes tokens `ids` into an attention cache at its offset; returns the history.
inline KVHistory write(Attention& cache, const TokenKV& kv, std::span<const int64_t> ids,
                       int64_t rows = 1) {
  const auto batch = Batch::uniform(rows, static_cast<int64_t>(ids.size()), cache.offset());
  return cache.update(batch, kv.keys(ids, rows), kv.values(ids, rows));
}

}  // namespace kvsnap::testing
