// RotatingKVCache — a sliding-window attention cache of `max_size` tokens.
//
// Single-token writes go into a ring buffer; multi-token writes linearize the window, keep the
// last max_size-1 old tokens and append the chunk, so every query of the chunk sees its full
// window. The history it returns (ring-order columns after decode) carries the window as a
// lookback (KVHistory::window(), AttentionMask::lookback): a query at position i sees no key at
// a position <= i - max_size. Nothing else: the caller's logical mask decides causality, so
// causal() gives sliding-window attention and none() or an explicit array keeps bidirectional
// spans (an image's tokens, a prefix-LM prompt) inside the window.
//
// Snapshots hold the whole window at their end offset e (from() == to() == e): every token
// while e <= max_size, else the last max_size-1 tokens [e - max_size + 1, e) — exactly what the
// next query (at position e) needs besides its own key. So after restoring one, view() holds
// those tokens: it answers queries at e and later (once update() appends them), but not a query
// at e-1 or earlier, whose window reached one position further back. Snapshots are lazy views of
// the buffer: of the linear buffer after a chunked write (or before the ring wraps), of a wrapped
// ring in two runs of columns; a write copies out the columns a lazy snapshot still names before
// reusing them. A snapshot restores only into a cache of the same max_size.
//
// Memory follows the tokens held, not max_size: the buffer grows in steps of kStep tokens, at
// most to twice what the window holds (a chunk gets room for as much again, up to a window more),
// so a short prompt in a long window takes room for its tokens only.
//
//   kvsnap::RotatingKVCache cache(4096);
//   auto history = cache.update(batch, keys, values);
//   auto out = kvsnap::sdpa(batch, q, history, kvsnap::AttentionMask::causal(), scale);
#pragma once

#include <memory>

#include "kvsnap/cache.h"
#include "kvsnap/export.h"

namespace kvsnap {

namespace detail {
class RotatingKVCacheImpl;
}

class KVSNAP_EXPORT RotatingKVCache final : public Attention {
 public:
  // Growth step for the buffer, in tokens.
  static constexpr int64_t kStep = 256;

  // Throws Error unless 1 <= max_size <= 2^60 (no array holds more tokens).
  explicit RotatingKVCache(int64_t max_size);
  // Materializes every outstanding lazy snapshot: they outlive the cache (out of memory, they
  // keep the cache's buffers alive instead).
  ~RotatingKVCache() override;

  int64_t max_size() const;

  KVHistory update(const Batch&, const Array& keys, const Array& values) override;
  KVHistory view(const Batch&) const override;

  std::vector<Array> state() const override;
  void reset() override;
  int64_t offset() const override;
  // The whole window at offset() (from_offset is only range-checked); null at offset 0. It
  // restores only into a cache of the same max_size.
  [[nodiscard]] SnapshotPtr snapshot(int64_t from_offset) override;
  void prepare_snapshots(std::span<const int64_t> offsets) override;
  [[nodiscard]] std::vector<SnapshotPtr> take_snapshots() override;
  [[nodiscard]] std::vector<SnapshotPtr> take_reached_snapshots() override;
  void cancel_snapshots() override;
  // nullptr: rewind, only while offset() <= max_size. A snapshot ending at e: target == e, or
  // any 0 <= target < e when e <= max_size (nothing was evicted). Otherwise false.
  // Restoring this cache's own lazy snapshot copies nothing.
  [[nodiscard]] bool restore(Snapshot* snapshot, int64_t target) override;
  // Keeps the child (the window at the later offset); the parent is released.
  [[nodiscard]] SnapshotPtr merge(SnapshotPtr parent, SnapshotPtr child) override;
  // (null, snapshot): the window stays with the later half.
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
  ScheduleState schedule_state(SeqId seq) const override;

  CopyStats copy_stats() const override;
  RestoreRule restore_rule() const override;

 private:
  std::unique_ptr<detail::RotatingKVCacheImpl> impl_;
};

}  // namespace kvsnap
