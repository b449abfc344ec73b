// KVCache — an append-only attention cache, contiguous per head, with lazy snapshots.
//
// Keys and values live in [B, H, capacity, D] buffers. Capacity grows geometrically in steps of
// at least 256 tokens, so a long prefill copies each byte O(1) times. `snapshot(from)` records
// [from, offset) as a range of the live buffer: no bytes, no allocation. Before a write
// overwrites slots a lazy snapshot names (an append after a rewind) the cache copies exactly
// those slots out and fires the snapshot's materialize hook; reset and destruction copy out what
// is still named. A write costs the same however many snapshots are outstanding.
//
//   kvsnap::KVCache cache;
//   auto history = cache.update(kvsnap::Batch::uniform(1, 8, 0), keys, values);  // offset 8
//   auto s = cache.snapshot(0);             // lazy [0, 8)
//   (void)cache.restore(nullptr, 5);        // live rewind to 5
//   cache.update(kvsnap::Batch::uniform(1, 1, 5), k1, v1);  // slot 5 is copied out of s first
//   (void)cache.restore(s.get(), 8);        // back to the original 8 tokens (slot 5 written)
#pragma once

#include <memory>

#include "kvsnap/cache.h"
#include "kvsnap/export.h"

namespace kvsnap {

namespace detail {
class KVCacheImpl;
}

class KVSNAP_EXPORT KVCache final : public Attention {
 public:
  // Smallest growth step, in tokens.
  static constexpr int64_t kStep = 256;

  KVCache();
  // Materializes every outstanding lazy snapshot: they outlive the cache (out of memory, they
  // keep the cache's buffers alive instead).
  ~KVCache() override;

  // Makes room for `tokens` tokens in every sequence without further growth: at once for the
  // sequences written so far, and at its first write for every other. Never shrinks. When
  // growing a sequence throws (std::bad_alloc), the reservation is not raised: sequences grown
  // before keep their room, later ones are not held to the failed size. `tokens` must be in
  // [0, 2^31 - 1] (positions are int32).
  void reserve(int64_t tokens);
  // Tokens sequence 0's buffers hold room for.
  int64_t capacity() const;
  // Bytes that lazy snapshots name in slots [from, to): what writing those positions would copy
  // out first (a slot named by two snapshots is copied for each). 0 when nothing would be lost
  // (or to <= from).
  int64_t lazy_bytes(int64_t from, int64_t to) const;
  int64_t lazy_bytes(SeqId seq, int64_t from, int64_t to) const;

  KVHistory update(const Batch&, const Array& keys, const Array& values) override;
  KVHistory view(const Batch&) const override;

  std::vector<Array> state() const override;
  void reset() override;
  int64_t offset() const override;
  // Lazy [from_offset, offset()); null when from_offset == offset().
  [[nodiscard]] SnapshotPtr snapshot(int64_t from_offset) override;
  void prepare_snapshots(std::span<const int64_t> offsets) override;
  [[nodiscard]] std::vector<SnapshotPtr> take_snapshots() override;
  [[nodiscard]] std::vector<SnapshotPtr> take_reached_snapshots() override;
  void cancel_snapshots() override;
  // nullptr: rewind to target <= offset(). Own lazy snapshot: an offset move, no copy. Other
  // snapshots [from, to): rewind to from, write [from, target), offset = target. Unreachable
  // (target < 0, target > to, offset() < from): false.
  [[nodiscard]] bool restore(Snapshot* snapshot, int64_t target) override;
  // [a, b) + [b, c) as one snapshot [a, c): never a copy (the pieces are joined; lazy parts
  // stay lazy), except a part lazy in another cache, which is copied out first.
  [[nodiscard]] SnapshotPtr merge(SnapshotPtr parent, SnapshotPtr child) override;
  // [from, at) and [at, to); lazy splits are arithmetic, owned halves are compact copies.
  // Throws Error (consuming the snapshot, see cache.h) for `at` outside [from, to].
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
  std::unique_ptr<detail::KVCacheImpl> impl_;
};

}  // namespace kvsnap
