// Internal: the pieces lazy KV snapshots are made of, and the index a store keeps of the
// columns they still name.
//
// A Piece is a run of consecutive tokens of one snapshot stored in consecutive columns
// [column, column + tokens) of a store's buffers, except its first `owned` tokens, which were
// copied into the piece's own storage before a write overwrote their columns. Its lazy columns
// are [column + owned, column + tokens).
//
// LazyIndex is an intrusive treap of pieces keyed by their first lazy column and augmented with
// the largest lazy end in each subtree, so the pieces overlapping a write are found in
// O(log n + k) however many snapshots are outstanding. Linking and unlinking allocate nothing.
#pragma once

#include <cstdint>
#include <vector>

#include "cache/state_snapshot.h"
#include "kvsnap/array.h"

namespace kvsnap::detail {

class KVStateSnapshot;

struct Piece : Pooled<Piece> {
  KVStateSnapshot* snapshot = nullptr;
  Piece* next = nullptr;  // the snapshot's next piece (owned by the snapshot)
  int64_t tokens = 0;
  int64_t column = 0;
  int64_t owned = 0;
  Array keys, values;  // storage for all `tokens` ([B, H, tokens, D]) once a token was copied

  int64_t lazy_begin() const { return column + owned; }
  int64_t lazy_end() const { return column + tokens; }
  bool lazy() const { return owned < tokens; }

  // LazyIndex links.
  Piece* left = nullptr;
  Piece* right = nullptr;
  uint64_t priority = 0;
  int64_t max_end = 0;   // the largest lazy_end() in this subtree
  int64_t unbacked = 0;  // the lazy columns of the pieces without storage in this subtree
  bool indexed = false;
};

class LazyIndex {
 public:
  LazyIndex() = default;
  LazyIndex(const LazyIndex&) = delete;
  LazyIndex& operator=(const LazyIndex&) = delete;

  // Links a lazy piece (not yet linked). O(log n), no allocation.
  void insert(Piece* piece);
  // Unlinks a linked piece. O(log n).
  void erase(Piece* piece);
  bool empty() const { return root_ == nullptr; }
  // Some linked piece, or null when empty: drains the index without allocating. O(1).
  Piece* any() const { return root_; }
  // One past the last column any lazy piece names; 0 when empty. O(1).
  int64_t end() const { return root_ == nullptr ? 0 : root_->max_end; }

  // Appends to `out` (cleared first) every piece whose lazy columns meet [from, to).
  // O(log n + k); allocates only if `out` must grow.
  void overlapping(int64_t from, int64_t to, std::vector<Piece*>& out) const;
  // The lazy columns from `from` on of the pieces that have no storage yet: O(log n + the pieces
  // that straddle `from`), through the subtree sums.
  int64_t unbacked_from(int64_t from) const { return unbacked_from(root_, from); }
  // Appends every linked piece to `out` (cleared first).
  void all(std::vector<Piece*>& out) const { overlapping(INT64_MIN, INT64_MAX, out); }

 private:
  static bool before(const Piece* a, const Piece* b);
  static void update(Piece* node);
  static Piece* merge(Piece* a, Piece* b);
  // Splits `node` into the pieces ordered before `key` and the rest.
  static void split(Piece* node, const Piece* key, Piece*& low, Piece*& high);
  static Piece* erase(Piece* node, Piece* piece);
  static void collect(Piece* node, int64_t from, int64_t to, std::vector<Piece*>& out);
  static int64_t unbacked_from(const Piece* node, int64_t from);

  Piece* root_ = nullptr;
  uint64_t seed_ = 0x9e3779b97f4a7c15ull;
};

}  // namespace kvsnap::detail
