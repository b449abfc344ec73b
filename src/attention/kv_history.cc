#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <string>

#include "array/f32_in_order.h"
#include "attention/paged_gather.h"
#include "kvsnap/attention.h"

namespace kvsnap {
namespace {

constexpr float kHidden = -std::numeric_limits<float>::infinity();

// An explicit mask array as f32 in order (read in place when it already is: a large mask is not
// copied) with its broadcastable extents.
struct DenseMask {
  Array data;
  const float* values;
  bool boolean;
  int64_t rows, heads, queries, keys;

  DenseMask(const Array& array, bool boolean)
      : data(detail::f32_in_order(array)),
        values(data.data<float>()),
        boolean(boolean),
        rows(array.dim(0)),
        heads(array.dim(1)),
        queries(array.dim(2)),
        keys(array.dim(3)) {}

  float at(int64_t b, int64_t h, int64_t l, int64_t position) const {
    const int64_t index =
        (((rows == 1 ? 0 : b) * heads + (heads == 1 ? 0 : h)) * queries + l) * keys + position;
    const float value = values[index];
    if (boolean) return value != 0.0f ? 0.0f : kHidden;
    return value;
  }
};

// Error unless every column's position, first_position + k for k < `columns`, fits int64 (the
// masks compute the last one).
void check_positions(int64_t first_position, int64_t columns) {
  if (columns > 0 && first_position > std::numeric_limits<int64_t>::max() - (columns - 1)) {
    throw Error(fmt::format(
        "KVHistory: first position {} and {} columns: the last column's position must fit in "
        "int64",
        first_position, columns));
  }
}

}  // namespace

KVHistory::KVHistory(Array keys, Array values, int64_t first_position, int64_t oldest_column,
                     int64_t window)
    : keys_(std::move(keys)),
      values_(std::move(values)),
      first_position_(first_position),
      oldest_column_(oldest_column),
      window_(window) {
  const Shape& k_shape = keys_.shape();
  const Shape& v_shape = values_.shape();
  if (k_shape.size() != 4 || v_shape.size() != 4 || k_shape[0] != v_shape[0] ||
      k_shape[1] != v_shape[1] || k_shape[2] != v_shape[2]) {
    throw Error(
        fmt::format("KVHistory: keys {} and values {} must be [B, H, K, D] with equal B, "
                    "H and K",
                    keys_.describe(), values_.describe()));
  }
  const int64_t k = k_shape[2];
  if (first_position < 0 || window < 0 || oldest_column < 0 || (k > 0 && oldest_column >= k) ||
      (k == 0 && oldest_column != 0)) {
    throw Error(
        fmt::format("KVHistory: first position {}, oldest column {} and window {} must be "
                    "non-negative with oldest column < K = {}",
                    first_position, oldest_column, window, k));
  }
  check_positions(first_position, k);
}

Array PagedColumns::key_block(size_t i) const {
  const int64_t block = table[i];
  const int64_t first = block % blocks_per_chunk * block_tokens;
  return key_chunks[static_cast<size_t>(block / blocks_per_chunk)].slice(2, first,
                                                                         first + block_tokens);
}

Array PagedColumns::value_block(size_t i) const {
  const int64_t block = table[i];
  const int64_t first = block % blocks_per_chunk * block_tokens;
  return value_chunks[static_cast<size_t>(block / blocks_per_chunk)].slice(2, first,
                                                                           first + block_tokens);
}

namespace {

// Why `paged` cannot be read as its header describes (empty when it can): every chunk
// [1, H, blocks_per_chunk * T, D] with one shape, dtype and strides per side and the heads of
// both sides equal, and every block id within the chunks.
std::string paged_problem(const PagedColumns& paged) {
  if (paged.block_tokens < 1 || paged.blocks_per_chunk < 1 ||
      paged.blocks_per_chunk > std::numeric_limits<int64_t>::max() / paged.block_tokens) {
    return fmt::format("blocks_per_chunk {} and block_tokens {} must be >= 1",
                       paged.blocks_per_chunk, paged.block_tokens);
  }
  // Divided, not multiplied: a hand-built header's sizes may be anything (no overflow).
  const int64_t blocks_needed =
      paged.length / paged.block_tokens + (paged.length % paged.block_tokens != 0 ? 1 : 0);
  if (paged.length < 0 || blocks_needed > static_cast<int64_t>(paged.table.size())) {
    return fmt::format("{} columns do not fit its {} blocks of {} tokens", paged.length,
                       paged.table.size(), paged.block_tokens);
  }
  if (paged.key_chunks.empty()) {  // its heads and depth would be unknown (sdpa reads them)
    return "it needs at least one chunk";
  }
  if (paged.key_chunks.size() != paged.value_chunks.size()) {
    return fmt::format("{} key chunks and {} value chunks", paged.key_chunks.size(),
                       paged.value_chunks.size());
  }
  const int64_t columns = paged.blocks_per_chunk * paged.block_tokens;
  for (const std::vector<Array>* side : {&paged.key_chunks, &paged.value_chunks}) {
    for (const Array& chunk : *side) {
      const Array& first = side->front();
      if (chunk.ndim() != 4 || chunk.dim(0) != 1 || chunk.dim(2) != columns ||
          chunk.dim(1) != paged.key_chunks.front().dim(1) || chunk.shape() != first.shape() ||
          chunk.dtype() != first.dtype() || chunk.strides() != first.strides()) {
        return fmt::format(
            "chunk {} does not fit [1, H, {} * {}, D] with the first chunk's shape {}, dtype "
            "and strides (and the keys' heads)",
            chunk.describe(), paged.blocks_per_chunk, paged.block_tokens, first.describe());
      }
    }
  }
  const auto chunks = static_cast<int64_t>(paged.key_chunks.size());
  for (const int32_t block : paged.table) {
    if (block < 0 || block / paged.blocks_per_chunk >= chunks) {
      return fmt::format("block {} is outside the chunks' [0, {} x {})", block, chunks,
                         paged.blocks_per_chunk);
    }
  }
  return "";
}

}  // namespace

KVHistory::KVHistory(PagedColumns paged, int64_t first_position, int64_t window)
    : first_position_(first_position), window_(window) {
  if (first_position < 0 || window < 0) {
    throw Error(
        fmt::format("KVHistory: a paged history's first position {} and window {} must be "
                    "non-negative",
                    first_position, window));
  }
  if (const std::string problem = paged_problem(paged); !problem.empty()) {
    throw Error(fmt::format("KVHistory: a paged history of {} columns in {} blocks: {}",
                            paged.length, paged.table.size(), problem));
  }
  check_positions(first_position, paged.length);
  paged_ = std::make_shared<const PagedColumns>(std::move(paged));
}

KVHistory KVHistory::of_rows(std::vector<KVHistory> rows) {
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].ragged() || rows[i].rows() != 1) {
      throw Error(fmt::format(
          "KVHistory::of_rows: row {} is a {}history of {} rows: each row needs a one-row history",
          i, rows[i].ragged() ? "ragged " : "", rows[i].rows()));
    }
  }
  KVHistory history;
  history.rows_ = std::make_shared<const std::vector<KVHistory>>(std::move(rows));
  return history;
}

int64_t KVHistory::rows() const {
  if (rows_ != nullptr) return static_cast<int64_t>(rows_->size());
  if (paged_ != nullptr) return 1;
  return keys_.empty() ? 1 : keys_.dim(0);
}

const KVHistory& KVHistory::row(int64_t b) const {
  if (rows_ == nullptr) return *this;
  if (b < 0 || b >= rows()) {
    throw Error(fmt::format("KVHistory::row: row {} of a history of {} rows: need 0 <= row < {}", b,
                            rows(), rows()));
  }
  return (*rows_)[static_cast<size_t>(b)];
}

void RecurrentHistory::bad_row(int64_t b, int64_t rows) {
  throw Error(fmt::format(
      "RecurrentHistory::row: row {} of a history of {} rows: need 0 <= row < {}", b, rows, rows));
}

int64_t KVHistory::length() const {
  if (paged_ != nullptr) return paged_->length;
  if (rows_ != nullptr) {
    int64_t longest = 0;
    for (const KVHistory& row : *rows_) longest = std::max(longest, row.length());
    return longest;
  }
  return keys_.empty() ? 0 : keys_.dim(2);
}

KVHistory KVHistory::contiguous() const {
  if (rows_ != nullptr) {
    throw Error(fmt::format("KVHistory::contiguous: a ragged history of {} rows; take its rows",
                            rows_->size()));
  }
  if (paged_ == nullptr) return *this;
  const PagedColumns& p = *paged_;
  if (p.key_chunks.empty()) return KVHistory();
  const Array& k0 = p.key_chunks.front();
  const Array& v0 = p.value_chunks.front();
  Array keys = Array::uninitialized(k0.dtype(), {1, k0.dim(1), p.length, k0.dim(3)});
  Array values = Array::uninitialized(v0.dtype(), {1, v0.dim(1), p.length, v0.dim(3)});
  detail::gather_paged(p, keys, values);
  return KVHistory(std::move(keys), std::move(values), first_position_, 0, window_);
}

// Row by row, padded to the longest row's columns (hidden).
AttentionMask KVHistory::apply_ragged_mask(const Batch& batch, const AttentionMask& logical) const {
  const int64_t rows = batch.batch_size(), queries = batch.length(), keys = length();
  if (rows != this->rows()) {
    throw Error(fmt::format("KVHistory::apply_mask: a batch of {} rows for a history of {}", rows,
                            this->rows()));
  }
  for (const Array& array : logical.arrays()) {  // each row takes its own slice, or the one
    if (array.dim(0) != 1 && array.dim(0) != rows) {
      throw Error(fmt::format(
          "KVHistory::apply_mask: mask array {} does not fit a batch of {} rows (need [1|{}, ...])",
          array.describe(), rows, rows));
    }
  }
  std::vector<Array> masks;
  int64_t heads = 1;
  bool every_key_visible = true;  // to every query: none(), as for a history of one row
  for (int64_t b = 0; b < rows; ++b) {
    const AttentionMask physical = row(b).apply_mask(batch.row(b), logical.for_row(b));
    every_key_visible = every_key_visible && physical.arrays().empty() && row(b).length() == keys;
    Array mask = physical.arrays().empty()
                     ? Array::zeros(DType::f32, {1, 1, queries, row(b).length()})
                     : physical.arrays().front();
    heads = std::max(heads, mask.dim(1));
    masks.push_back(std::move(mask));
  }
  if (every_key_visible) return AttentionMask::none();
  std::vector<float> out(static_cast<size_t>(rows * heads * queries * keys), kHidden);
  for (int64_t b = 0; b < rows; ++b) {
    const std::vector<float> m = masks[static_cast<size_t>(b)].to_floats();
    const int64_t mh = masks[static_cast<size_t>(b)].dim(1),
                  mk = masks[static_cast<size_t>(b)].dim(3);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t l = 0; l < queries; ++l)
        for (int64_t k = 0; k < mk; ++k)
          out[static_cast<size_t>(((b * heads + h) * queries + l) * keys + k)] =
              m[static_cast<size_t>(((mh == 1 ? 0 : h) * queries + l) * mk + k)];
  }
  return AttentionMask::from_array(Array::from_floats(out, {rows, heads, queries, keys}));
}

AttentionMask KVHistory::apply_mask(const Batch& batch, const AttentionMask& logical) const {
  batch.validate("KVHistory::apply_mask");
  if (rows_ != nullptr) return apply_ragged_mask(batch, logical);
  // One row of the batch per row of keys, or any rows over one row of keys (each row's queries
  // over the same columns).
  if (rows() != 1 && batch.batch_size() != rows()) {
    throw Error(fmt::format("KVHistory::apply_mask: a batch of {} rows for a history of {}",
                            batch.batch_size(), rows()));
  }
  const AttentionMask effective =
      window_ > 0 ? logical.intersect(AttentionMask::lookback(window_)) : logical;
  const int64_t rows = batch.batch_size();
  const int64_t queries = batch.length();
  const int64_t keys = length();
  const int64_t last_position = first_position_ + keys - 1;

  int64_t heads = 1;
  std::vector<DenseMask> dense;
  for (const Array& array : effective.arrays()) {
    const int64_t r = array.dim(0), h = array.dim(1), l = array.dim(2), p = array.dim(3);
    if ((r != 1 && r != rows) || l != queries || p <= last_position ||
        (h != 1 && heads != 1 && h != heads)) {
      throw Error(fmt::format(
          "KVHistory::apply_mask: mask array {} does not fit a batch of {} rows x {} queries over "
          "key positions up to {} (need [1|{}, 1|Hq, {}, >{}])",
          array.describe(), rows, queries, last_position, rows, queries, last_position));
    }
    heads = std::max(heads, h);
    dense.emplace_back(array, array.dtype() == DType::i32);
  }

  // Fast path: no arrays and every real query sees every key (e.g. decode in the window).
  if (dense.empty()) {
    bool everything_visible = true;
    for (int64_t b = 0; b < rows && everything_visible; ++b) {
      const int64_t first_query = batch.seq_offsets[b];
      const int64_t last_query = first_query + batch.seq_query_lens[b] - 1;
      everything_visible = batch.seq_query_lens[b] == queries &&
                           (keys == 0 || (effective.allows(first_query, last_position) &&
                                          effective.allows(last_query, first_position_)));
    }
    if (everything_visible) return AttentionMask::none();
  }

  Array physical = Array::zeros(DType::f32, {rows, heads, queries, keys});
  float* out = physical.mutable_data<float>();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t l = 0; l < queries; ++l) {
        const int64_t query = batch.seq_offsets[b] + l;
        const bool real = l < batch.seq_query_lens[b];
        for (int64_t k = 0; k < keys; ++k) {
          const int64_t key = position(k);
          // Hidden by any rule is hidden whatever the other masks add there (-inf plus an
          // infinite or NaN bias would be NaN: a visible score for the row's softmax).
          float value = real && effective.allows(query, key) ? 0.0f : kHidden;
          for (const DenseMask& mask : dense) {
            if (value == kHidden) break;
            const float bias = mask.at(b, h, l, key);
            value = bias == kHidden ? kHidden : value + bias;
          }
          *out++ = value;
        }
      }
    }
  }
  return AttentionMask::from_array(std::move(physical));
}

}  // namespace kvsnap

namespace kvsnap::detail {

void gather_paged(const PagedColumns& p, const Array& keys, const Array& values) {
  for (size_t i = 0; static_cast<int64_t>(i) * p.block_tokens < p.length; ++i) {
    const int64_t first = static_cast<int64_t>(i) * p.block_tokens;
    const int64_t count = std::min(p.block_tokens, p.length - first);
    keys.assign_slice(2, first, p.key_block(i).slice(2, 0, count));
    values.assign_slice(2, first, p.value_block(i).slice(2, 0, count));
  }
}

}  // namespace kvsnap::detail
