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
  // array is an additive bias on the scores (-inf = hidden).
  [[nodiscard]] static AttentionMask from_array(Array additive_or_bool);
  // Keys visible under both masks.
  [[nodiscard]] AttentionMask intersect(const AttentionMask&) const;

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

// Keys and values a cache hands back for one layer's attention, with the position each key
// column holds. Columns hold consecutive positions, possibly rotated (a ring buffer read in
// slot order): column `oldest_column` holds `first_position`, the next column the next
// position, wrapping at the end.
class KVSNAP_EXPORT KVHistory {
 public:
  KVHistory() = default;
  // keys [B, H, K, D] and values [B, H, K, Dv] of the same B, H and K.
  KVHistory(Array keys, Array values, int64_t first_position = 0, int64_t oldest_column = 0,
            int64_t window = 0);

  const Array& keys() const { return keys_; }
  const Array& values() const { return values_; }
  // Key columns K.
  int64_t length() const { return keys_.empty() ? 0 : keys_.dim(2); }
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
  // key is visible to every query, otherwise an f32 additive array [B, 1|Hq, L, K].
  AttentionMask apply_mask(const Batch&, const AttentionMask& logical) const;

 private:
  Array keys_;
  Array values_;
  int64_t first_position_ = 0;
  int64_t oldest_column_ = 0;
  int64_t window_ = 0;
};

// Recurrent layer state handed back by a RecurrentCache: conv tail [B, conv_tail, conv_dim]
// in the activation dtype and delta state [B, v_heads, v_dim, k_dim] in f32.
class KVSNAP_EXPORT RecurrentHistory {
 public:
  RecurrentHistory() = default;
  RecurrentHistory(Array conv_state, Array delta_state)
      : conv_state_(std::move(conv_state)), delta_state_(std::move(delta_state)) {}
  const Array& conv_state() const { return conv_state_; }
  const Array& delta_state() const { return delta_state_; }

 private:
  Array conv_state_;
  Array delta_state_;
};

}  // namespace kvsnap
