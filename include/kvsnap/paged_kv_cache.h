// PagedKVCache — an attention cache whose sequences are lists of fixed-size blocks drawn from
// one pool, so sequences and snapshots share memory instead of copying it.
//
// A block holds `block_tokens` tokens of every head. Blocks are reference counted: a snapshot
// is a list of block references, and restoring it into any sequence splices those references
// in — no token is copied, except for the one block where a sequence and a snapshot meet in the
// middle of a block (their tokens are joined in a fresh block). A write into a block that a
// snapshot or another sequence also references copies that one block first (copy on write).
// Histories are paged (KVHistory::paged_columns()): sdpa reads the blocks in place.
//
//   kvsnap::PagedKVCache cache({.block_tokens = 16});
//   auto history = cache.update(batch, keys, values);      // rows are sequences
//   auto shared = cache.snapshot(/*seq=*/0, /*from=*/0);    // block references, size() == 0
//   (void)cache.restore(/*seq=*/1, shared.get(), 4000);     // sequence 1 shares the prefix
//
// The pool's layout (heads, depths, dtypes) binds while any block is in use: a reset cache whose
// snapshots are gone takes any layout (blocks of another are dropped; of the same, reused).
//
// A snapshot holds no bytes of its own while a sequence still uses its blocks; when the last
// sequence lets go of a block that snapshots still reference, one of them becomes its owner
// (size() grows by the block, and the materialize hook runs). Snapshots keep the pool alive
// and outlive the cache.
#pragma once

#include <memory>

#include "kvsnap/cache.h"
#include "kvsnap/export.h"

namespace kvsnap {

namespace detail {
class PagedKVCacheImpl;
struct PagedCacheAccess;
}  // namespace detail

class KVSNAP_EXPORT PagedKVCache final : public Attention {
 public:
  struct Options {
    int64_t block_tokens = 16;      // tokens per block (>= 1)
    int64_t blocks_per_chunk = 64;  // the pool grows by this many blocks at a time (>= 1)
  };
  // Throws Error unless both options are >= 1, block_tokens * blocks_per_chunk <= 2^60 (a chunk
  // of the pool is one array, and no array holds more tokens) and blocks_per_chunk < 2^31.
  explicit PagedKVCache(Options options);
  PagedKVCache();
  // Sequences let go of their blocks; snapshots keep the ones they reference.
  ~PagedKVCache() override;

  int64_t block_tokens() const;

  struct PoolStats {
    int64_t blocks = 0;         // blocks the pool has allocated
    int64_t blocks_in_use = 0;  // referenced by a sequence or a snapshot
    int64_t bytes_in_use = 0;   // their keys and values
    int64_t blocks_copied = 0;  // copies on write and joins at restore
    int64_t live_blocks = 0;    // used by sequences (a block shared by several counts once)
    int64_t live_bytes = 0;     // their keys and values
  };
  PoolStats pool_stats() const;

  KVHistory update(const Batch&, const Array& keys, const Array& values) override;
  KVHistory view(const Batch&) const override;

  std::vector<Array> state() const override;
  void reset() override;
  int64_t offset() const override;
  // Block references of [from_offset, offset()); null when from_offset == offset().
  [[nodiscard]] SnapshotPtr snapshot(int64_t from_offset) override;
  void prepare_snapshots(std::span<const int64_t> offsets) override;
  [[nodiscard]] std::vector<SnapshotPtr> take_snapshots() override;
  [[nodiscard]] std::vector<SnapshotPtr> take_reached_snapshots() override;
  void cancel_snapshots() override;
  // As KVCache::restore: nullptr rewinds; a snapshot of [from, to) needs offset() >= from and
  // restores any target in [from, to]. This cache's snapshots splice block references; KVCache
  // snapshots (and other pools') are copied in.
  [[nodiscard]] bool restore(Snapshot* snapshot, int64_t target) override;
  // [a, b) + [b, c) as one snapshot: block lists joined (a block where they meet mid-block is
  // shared when it is the same block, else joined in a fresh one).
  [[nodiscard]] SnapshotPtr merge(SnapshotPtr parent, SnapshotPtr child) override;
  // [from, at) and [at, to), sharing the block that holds `at`: no token is copied.
  [[nodiscard]] std::pair<SnapshotPtr, SnapshotPtr> split(SnapshotPtr, int64_t at) override;

  // Sequence `seq` (the calls above address sequence 0; see cache.h).
  std::vector<Array> state(SeqId seq) const override;
  void reset(SeqId seq) override;
  int64_t offset(SeqId seq) const override;
  [[nodiscard]] SnapshotPtr snapshot(SeqId seq, int64_t from_offset) override;
  void prepare_snapshots(SeqId seq, std::span<const int64_t> offsets) override;
  void cancel_snapshots(SeqId seq) override;
  [[nodiscard]] std::vector<SnapshotPtr> take_snapshots(SeqId seq) override;
  [[nodiscard]] std::vector<SnapshotPtr> take_reached_snapshots(SeqId seq) override;
  void take_snapshots_into(SeqId seq, std::vector<SnapshotPtr>& into) override;
  [[nodiscard]] bool restore(SeqId seq, Snapshot* snapshot, int64_t target) override;
  std::vector<SeqId> sequences() const override;
  int64_t exposed_bytes(SeqId seq) const override;
  int64_t exposed_bytes_after_rewind(SeqId seq, int64_t offset) const override;
  ScheduleState schedule_state(SeqId seq) const override;

  CopyStats copy_stats() const override;
  RestoreRule restore_rule() const override;

 private:
  friend struct detail::PagedCacheAccess;
  std::unique_ptr<detail::PagedKVCacheImpl> impl_;
};

}  // namespace kvsnap
