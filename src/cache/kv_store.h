// Internal: the one KV core under KVCache and RotatingKVCache — buffers of columns, the lazy
// snapshots that name them, and copy-before-overwrite — with the append and ring policies on
// top in kv_cache.cc and rotating_kv_cache.cc.
//
// A KVStore owns keys [B, H, capacity, D] and values [B, H, capacity, Dv]. A KVStateSnapshot is
// a run of tokens made of Pieces (lazy_index.h): while a piece is lazy it names columns of the
// store and owns nothing. Before any write overwrites columns a lazy piece names, the store
// copies exactly those columns into the piece's storage ("materializes" that part) — copying
// happens only when data would otherwise be lost, and only the data that would be. The pieces
// overlapping a write are found through a LazyIndex, so a write costs the same however many
// snapshots are outstanding.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "cache/kv_layout.h"
#include "cache/lazy_index.h"
#include "cache/sequences.h"
#include "cache/state_snapshot.h"

namespace kvsnap::detail {

class KVStore;

// A KVCache range [from, to) (kind kv) or a RotatingKVCache window ending at to (kind
// rotating, from == to), held as pieces in token order.
class KVStateSnapshot final : public StateSnapshot, public Pooled<KVStateSnapshot> {
 public:
  using Pooled<KVStateSnapshot>::operator new;
  using Pooled<KVStateSnapshot>::operator delete;

  // `tokens` lazy tokens in columns [column, column + tokens) of `owner`.
  KVStateSnapshot(SnapshotRecord::Kind kind, KVStore& owner, int64_t column, int64_t tokens,
                  int64_t from, int64_t to, int64_t window);
  // Owned tokens: `keys` [B, H, T, D] and `values` [B, H, T, Dv].
  KVStateSnapshot(SnapshotRecord::Kind kind, const KVLayout& layout, Array keys, Array values,
                  int64_t from, int64_t to, int64_t window);
  ~KVStateSnapshot() override;

  int64_t size() const override;
  void set_materialize_hook(std::function<void(int64_t)> hook) override {
    (void)hook_and_size(std::move(hook));
  }
  int64_t hook_and_size(std::function<void(int64_t)> hook) override;
  int64_t from() const override { return begin; }
  int64_t to() const override { return end; }
  bool is_lazy() const override { return owner() != nullptr; }
  SnapshotRecord record() const override;
  void copy_record(bool second, Array& place, int64_t column = 0) const override;

  // Tokens held: to - from for ranges, the window's tokens for windows.
  int64_t tokens() const { return tokens_; }
  // Calls visit(first token, keys, values) for consecutive parts covering the first `limit`
  // tokens, each part's arrays [B, H, n, *] views of a piece's storage or of a store's buffer;
  // `lazy_column` is the part's first column in `owner`'s buffers, or -1 for owned data.
  void for_each_part(int64_t limit,
                     const std::function<void(int64_t first, const Array& keys, const Array& values,
                                              int64_t lazy_column)>& visit) const;
  // The tokens as single arrays: views when held in one part, else compact copies.
  Array keys() const;
  Array values() const;
  // Adds `tokens` lazy tokens in columns [column, column + tokens) of `owner` after the others
  // (a window that wraps around a ring is two runs of columns).
  void append_run(int64_t column, int64_t tokens);
  // The single piece when the snapshot is one run of columns, else null.
  const Piece* only_piece() const { return head_.next == nullptr ? &head_ : nullptr; }

  // Splits off [at, to) (from < at < to) as a new snapshot; this one keeps [from, at). Lazy
  // parts split without a copy, owned parts are copied (counted in `stats`).
  std::unique_ptr<KVStateSnapshot> split_off(int64_t at, CopyStats& stats);
  // Appends `next`'s pieces (next.from() == to()); nothing is copied unless the two are lazy in
  // different stores (then `next` is materialized first).
  void append(KVStateSnapshot& next);

  // Called by the store when a piece's storage changed size by `delta` bytes, and when the
  // snapshot's last lazy piece became owned.
  void storage_changed(int64_t delta);
  void became_owned() { set_owner(nullptr); }

  // The store it names columns of: non-null exactly while a piece is lazy. Read from any
  // thread; changed only under that store's cache lock.
  KVStore* owner() const { return owner_.load(std::memory_order_acquire); }
  void set_owner(KVStore* store);
  // The lock of the store it is (or last was) lazy in; alive while the snapshot is.
  CacheLock* lock() const { return lock_.get(); }
  // Runs `read()` consistently with the store's writers: under its lock while lazy. The lock
  // is the snapshot's to keep (a cache destroyed meanwhile copies everything out under it and
  // leaves it behind), so `read` must look at owner() again: it may have become null.
  template <class Read>
  decltype(auto) locked(Read&& read) const {
    if (owner() == nullptr) return read();
    const Guard guard(*lock_);
    return read();
  }

  // Its lazy columns that have no storage yet: what KVStore::unbacked_bytes counts of it, in
  // tokens.
  int64_t unbacked_tokens() const;

  const KVLayout layout;
  int64_t begin, end;
  const int64_t window;  // rotating: the max_size of its cache

 private:
  friend class KVStore;
  template <class Visit>
  void for_each_piece(Visit&& visit);
  template <class Visit>
  void for_each_piece(Visit&& visit) const;
  // An empty shell for [from, to) of `like`'s kind, layout, window and owner.
  KVStateSnapshot(const KVStateSnapshot& like, int64_t from, int64_t to);
  // Moves `source`'s fields into `target` (re-linking a lazy piece in `store`'s index).
  void move_piece(Piece& source, Piece& target, KVStore* store);
  bool has_lazy_piece() const;
  // Whether keys() and values() are views of the store's buffers: one part, a lazy one.
  bool viewed_live() const;
  void insert_after(Piece& piece, std::unique_ptr<Piece> next);

  std::atomic<KVStore*> owner_;
  // The lock of the last store it was lazy in; kept alive with the snapshot (see locked()).
  std::shared_ptr<CacheLock> lock_;
  int64_t tokens_;
  // The first piece, inline (a capture allocates none); the others follow through Piece::next,
  // owned by the snapshot and drawn from a pool.
  Piece head_;
  std::function<void(int64_t)> hook_;
};

class KVStore {
 public:
  KVStore() = default;
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;
  // Outstanding lazy snapshots outlive the store: they are handed their columns first.
  ~KVStore() { let_go(); }

  int64_t capacity() const { return keys.empty() ? 0 : keys.dim(2); }
  int64_t token_bytes() const { return layout.token_bytes(); }
  // One past the last column a lazy piece names (0 when none).
  int64_t lazy_end() const { return index.end(); }

  void adopt_layout(const KVLayout& incoming) {
    layout = incoming;
    has_layout = true;
  }
  // Hands every lazy snapshot its columns (let_go), drops the buffers and the layout. Never
  // throws: a reset, like a destruction, cannot fail for lack of memory.
  void clear() noexcept;
  // Fresh buffers of `columns` columns; columns [0, keep) are copied over at the same columns
  // (counted as growth), so lazy pieces naming them stay valid; pieces beyond `keep` are
  // materialized first.
  void resize(int64_t columns, int64_t keep);
  // Swaps in buffers whose columns mean something else: every lazy piece is materialized first.
  void replace(Array new_keys, Array new_values);
  // Writes keys/values [B, H, n, *] into columns [column, column + n), first copying out the
  // lazy parts of snapshots that name those columns.
  void write(int64_t column, const Array& new_keys, const Array& new_values);
  // Copies out the lazy parts of snapshots that name columns in [from, to).
  void preserve(int64_t from, int64_t to);
  // Bytes preserve(from, to) would copy: each lazy piece's columns in [from, to).
  int64_t lazy_bytes(int64_t from, int64_t to) const;
  // The most snapshots' size() can grow by through writes from column `from` on: the lazy
  // columns there of pieces with no storage yet (a piece's storage is allocated, for its
  // columns from the first one written to its end, when a write first reaches it).
  int64_t unbacked_bytes(int64_t from) const {
    return index.end() <= from ? 0 : index.unbacked_from(from) * token_bytes();
  }
  void materialize_all();
  void materialize(KVStateSnapshot& snapshot);
  // Before the buffers go (clear, destruction): every lazy piece gets its columns, copied into
  // storage of its own; a piece whose storage cannot be allocated (std::bad_alloc) takes views
  // of the buffers' columns instead, keeping the buffers alive (no write reaches them once the
  // store has let them go; they are freed with the last such piece). Never throws.
  void let_go() noexcept;

  // A lazy snapshot of `tokens` columns from `column`.
  std::unique_ptr<KVStateSnapshot> capture(SnapshotRecord::Kind kind, int64_t column,
                                           int64_t tokens, int64_t from, int64_t to,
                                           int64_t window);

  // Piece bookkeeping for KVStateSnapshot.
  void link(Piece& piece) { index.insert(&piece); }
  void unlink(Piece& piece) {
    if (piece.indexed) index.erase(&piece);
  }
  // Splits a lazy or partly owned piece at token `cut` (0 < cut < tokens); returns the second
  // half. Owned tokens are copied into compact storage for each half (counted as snapshot
  // bytes), lazy ones are split by arithmetic.
  std::unique_ptr<Piece> split_piece(Piece& piece, int64_t cut, CopyStats& copies);

  Array keys, values;  // [B, H, capacity, D] / [B, H, capacity, Dv]
  // The lock of the cache this store belongs to (set by the cache): held by every call that
  // reads or changes the store, its index or its snapshots' pieces. Shared with the snapshots
  // lazy in the store, which may outlive it.
  std::shared_ptr<CacheLock> lock;
  KVLayout layout;
  bool has_layout = false;
  CopyStats stats;

 private:
  // Copies the piece's lazy columns up to column `to` into its storage.
  void copy_out(Piece& piece, int64_t to);

  LazyIndex index;
  std::vector<Piece*> overlapping_;  // reused by preserve: no allocation per write
};

inline void KVStateSnapshot::set_owner(KVStore* store) {
  if (store != nullptr) lock_ = store->lock;
  owner_.store(store, std::memory_order_release);
}

// The snapshot `snapshot` as a KV-state snapshot of `kind`; throws Error naming `call` when it
// is another kind ("snapshots restore only into a cache of their own kind").
KVStateSnapshot& as_kv_state(Snapshot* snapshot, SnapshotRecord::Kind kind, const char* call);

}  // namespace kvsnap::detail
