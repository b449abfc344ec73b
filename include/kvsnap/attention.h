// Attention masks and the histories caches hand back to a layer (reference attention over them,
// `sdpa`, is in ops.h).
//
// Positions are absolute token positions. A *logical* mask says which key positions a query
// position may see (causal, sliding window, an explicit array); a KVHistory knows which
// position each of its key columns holds and turns a logical mask into a *physical* one over
// its columns with `apply_mask`:
//
//   auto history = cache.update(batch, keys, values);       // keys [B, H, K, D]
//   auto out = kvsnap::sdpa(batch, q, history, kvsnap::AttentionMask::causal(), 0.125f);
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvsnap/array.h"
#include "kvsnap/batch.h"
#include "kvsnap/export.h"

namespace kvsnap {

// Which keys each query may see. Canonical form: an optional causal rule (no key after the
// query), an optional lookback (no key `window` or more positions before the query) and a list
// of explicit arrays, all intersected. Causal and lookback are independent: a sliding-window
// cache imposes only the lookback, the caller's mask decides causality.
class KVSNAP_EXPORT AttentionMask {
 public:
  enum class Kind { none, causal, sliding_window, array, intersection, lookback };

  // Every key visible.
  [[nodiscard]] static AttentionMask none();
  // Query at position i sees keys at positions j <= i.
  [[nodiscard]] static AttentionMask causal();
  // The causal sliding window of sliding-window attention: query at position i sees keys at
  // positions j with i - window < j <= i (window >= 1). Same as causal() ∩ lookback(window).
  [[nodiscard]] static AttentionMask sliding_window(int64_t window);
  // Query at position i sees keys at positions j > i - window, later keys included (window
  // >= 1): what a RotatingKVCache's history imposes on top of the caller's mask, so
  // bidirectional spans (an image's tokens, a prefix-LM prompt) keep working inside the window.
  [[nodiscard]] static AttentionMask lookback(int64_t window);
  // Explicit mask [B|1, Hq|1, L, P] indexed by batch row, query head, query index within the
  // chunk and absolute key position. An i32 array is boolean (nonzero = visible); a float
  // array is an additive bias on the scores (-inf = hidden). A score the bias brings to -1e30 or
  // below counts as hidden too, so a query that sees only such keys gets zeros (as one that sees
  // nothing), not the mean of their values: a padding row biased by finfo(float32).min, say.
  [[nodiscard]] static AttentionMask from_array(Array additive_or_bool);
  // Keys visible under both masks.
  [[nodiscard]] AttentionMask intersect(const AttentionMask&) const;
  // The mask of batch row `row` alone: explicit arrays with one slice per row are cut to it
  // (Error for a row outside theirs); broadcast ones (one slice) serve every row unchanged.
  [[nodiscard]] AttentionMask for_row(int64_t row) const;

  Kind kind() const;
  // Whether keys after the query are hidden.
  bool is_causal() const { return causal_; }
  // Lookback window, or 0 when there is none.
  int64_t window() const { return window_; }
  const std::vector<Array>& arrays() const { return arrays_; }
  // True when the positional rules (causal, lookback) let query position `query` see `key`.
  bool allows(int64_t query, int64_t key) const {
    if (causal_ && key > query) return false;
    return window_ == 0 || query - key < window_;
  }

 private:
  bool causal_ = false;
  int64_t window_ = 0;
  std::vector<Array> arrays_;
};

// The key and value columns of one sequence in a paged cache: column k lives in slot
// k % block_tokens of block table[k / block_tokens]. Blocks are stored in chunks of the pool,
// head-major: block i holds columns [r * T, (r + 1) * T) of chunk i / blocks_per_chunk, where
// r = i % blocks_per_chunk, so a head's columns of consecutive blocks are consecutive.
struct KVSNAP_EXPORT PagedColumns {
  std::vector<Array> key_chunks;    // each [1, H, blocks_per_chunk * T, D]
  std::vector<Array> value_chunks;  // each [1, H, blocks_per_chunk * T, Dv]
  int64_t blocks_per_chunk = 0;
  int64_t block_tokens = 0;    // T
  std::vector<int32_t> table;  // block ids, in position order
  int64_t length = 0;          // columns K (the last block may be partly used)

  // Keys [1, H, T, D] and values [1, H, T, Dv] of table entry `i` (views of its chunk).
  Array key_block(size_t i) const;
  Array value_block(size_t i) const;
};

namespace detail {
struct HistoryParts;  // how the caches make histories of parts they keep for reuse
}  // namespace detail

// Keys and values a cache hands back for one layer's attention, with the position each key
// column holds. Columns hold consecutive positions, possibly rotated (a ring buffer read in
// slot order): column `oldest_column` holds `first_position`, the next column the next
// position, wrapping at the end. Three forms:
//   - contiguous: keys [B, H, K, D] and values [B, H, K, Dv];
//   - paged: one sequence's columns in the blocks of a paged cache (paged_columns());
//   - ragged: one history per batch row, for batches whose rows are different sequences with
//     their own lengths (row(b)).
class KVSNAP_EXPORT KVHistory {
 public:
  KVHistory() = default;
  // keys [B, H, K, D] and values [B, H, K, Dv] of the same B, H and K. Throws Error unless
  // first_position, window and oldest_column are >= 0, oldest_column < K (0 when K is 0), and
  // the last column's position, first_position + K - 1, fits in int64.
  KVHistory(Array keys, Array values, int64_t first_position = 0, int64_t oldest_column = 0,
            int64_t window = 0);
  // A paged history of one sequence, its columns in position order. Throws Error unless
  // blocks_per_chunk and block_tokens are >= 1, length fits the table's blocks, there is at
  // least one chunk and every chunk is [1, H, blocks_per_chunk * T, D] with one shape, dtype
  // and strides per side (H the same for keys and values), every block id names a block of the
  // chunks, first_position and window are >= 0, and first_position + length - 1 fits in int64. It
  // serves one batch row (sdpa refuses it for several: give KVHistory::of_rows).
  explicit KVHistory(PagedColumns paged, int64_t first_position = 0, int64_t window = 0);
  // One history per batch row (each of one row).
  [[nodiscard]] static KVHistory of_rows(std::vector<KVHistory> rows);

  // Contiguous form only (empty arrays for paged and ragged histories).
  const Array& keys() const { return keys_; }
  const Array& values() const { return values_; }
  bool paged() const { return paged_ != nullptr; }
  const PagedColumns& paged_columns() const { return *paged_; }
  bool ragged() const { return rows_ != nullptr; }
  // Rows: a ragged history's, a contiguous one's B, 1 for a paged one. Row `b`'s history: this
  // one unless ragged (Error for a ragged history's row outside [0, rows())).
  int64_t rows() const;
  const KVHistory& row(int64_t b) const;
  // A contiguous copy of a paged history (for consumers that need plain arrays); a contiguous
  // history is returned as is. Throws Error for a ragged one (take its rows).
  [[nodiscard]] KVHistory contiguous() const;

  // Key columns K (a ragged history: its longest row).
  int64_t length() const;
  // Absolute position held by key column `column` (0 <= column < length()).
  int64_t position(int64_t column) const {
    const int64_t k = length();
    return first_position_ + (column - oldest_column_ + k) % k;
  }
  int64_t first_position() const { return first_position_; }
  int64_t oldest_column() const { return oldest_column_; }
  // The cache's own window (0 = none): a rotating cache's history hides, for a query at
  // position i, the keys at positions <= i - window (AttentionMask::lookback). It never hides
  // later keys: the caller's logical mask decides causality.
  int64_t window() const { return window_; }

  // The physical mask for `batch`'s queries over this history's columns: `logical` intersected
  // with the history's lookback window, padding queries seeing nothing. Returns none() when every
  // key is visible to every query, otherwise an f32 additive array [B, 1|Hq, L, K]. The batch has
  // a row per row of the history, or any rows over a history of one (each over its columns);
  // mask arrays have 1 or B rows. Throws Error otherwise.
  AttentionMask apply_mask(const Batch&, const AttentionMask& logical) const;

 private:
  friend struct detail::HistoryParts;
  AttentionMask apply_ragged_mask(const Batch&, const AttentionMask& logical) const;

  Array keys_;
  Array values_;
  int64_t first_position_ = 0;
  int64_t oldest_column_ = 0;
  int64_t window_ = 0;
  std::shared_ptr<const PagedColumns> paged_;           // set for a paged history
  std::shared_ptr<const std::vector<KVHistory>> rows_;  // set for a ragged history
};

// Recurrent layer state handed back by a RecurrentCache: conv tail [B, conv_tail, conv_dim]
// in the activation dtype and delta state [B, v_heads, v_dim, k_dim] in f32.
// For a batch whose rows are different sequences: one history per row (row(b)).
class KVSNAP_EXPORT RecurrentHistory {
 public:
  RecurrentHistory() = default;
  RecurrentHistory(Array conv_state, Array delta_state)
      : conv_state_(std::move(conv_state)), delta_state_(std::move(delta_state)) {}
  [[nodiscard]] static RecurrentHistory of_rows(std::vector<RecurrentHistory> rows) {
    RecurrentHistory history;
    history.rows_ = std::make_shared<const std::vector<RecurrentHistory>>(std::move(rows));
    return history;
  }
  // One row's states (empty arrays for a history of several rows: take row(b)).
  const Array& conv_state() const { return conv_state_; }
  const Array& delta_state() const { return delta_state_; }
  int64_t rows() const { return rows_ == nullptr ? 1 : static_cast<int64_t>(rows_->size()); }
  // Row `b`'s state: this one unless ragged (Error for a row outside [0, rows())).
  const RecurrentHistory& row(int64_t b) const {
    if (rows_ == nullptr) return *this;
    if (b < 0 || b >= rows()) bad_row(b, rows());
    return (*rows_)[static_cast<size_t>(b)];
  }

 private:
  friend struct detail::HistoryParts;
  [[noreturn]] static void bad_row(int64_t b, int64_t rows);
  Array conv_state_;
  Array delta_state_;
  std::shared_ptr<const std::vector<RecurrentHistory>> rows_;
};

}  // namespace kvsnap
