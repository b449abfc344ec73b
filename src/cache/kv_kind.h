// Internal: what KVCache and RotatingKVCache share above the KV core — the offset, the capture
// schedule and the skeleton of their calls (checks, padding, accounting) — so a kind supplies only
// its policy: how a write lands in the store, what a capture holds, what its history is.
#pragma once

#include <fmt/format.h>

#include <array>
#include <span>
#include <string>
#include <vector>

#include "cache/capture_schedule.h"
#include "cache/kv_store.h"
#include "cache/sequences.h"

namespace kvsnap::detail {

class KVKind {
 public:
  // `name` ("KVCache") prefixes every error message.
  explicit KVKind(const char* name);
  virtual ~KVKind() = default;
  KVKind(const KVKind&) = delete;
  KVKind& operator=(const KVKind&) = delete;

  // Checks the one-row batch and arrays, writes the real tokens through the kind's policy,
  // advances the offset, captures what the schedule reached and returns the history.
  KVHistory update(const Batch& batch, const Array& keys, const Array& values);
  // Throws Error unless update(batch, keys, values) would be accepted; changes nothing.
  void check(const Batch& batch, const Array& keys, const Array& values) const;
  // Throws Error unless 0 <= from_offset <= offset.
  void check_snapshot_from(int64_t from_offset) const;
  void prepare(std::span<const int64_t> offsets);
  std::vector<SnapshotPtr> take();
  void take_into(std::vector<SnapshotPtr>& into);
  std::vector<SnapshotPtr> take_reached() { return schedule.take_reached(); }
  void cancel() { schedule.clear(); }
  // Drops the state (copying out what lazy snapshots name) and the schedule.
  virtual void reset() {
    schedule.clear();
    store.clear();
    offset = 0;
  }
  // Throws Error naming "<name>::restore" while captures are scheduled.
  void require_idle() const { schedule.require_idle(calls_.restore.c_str()); }

  virtual KVHistory history() const = 0;
  // Cache::exposed_bytes of this sequence.
  virtual int64_t exposed_bytes() const = 0;

  KVStore store;  // before `schedule`: captured snapshots unlink from it
  int64_t offset = 0;
  CaptureSchedule schedule;

  // Error-message prefixes, made once so the hot paths format nothing.
  struct Calls {
    std::string update, snapshot, prepare, take, restore, merge, split;
  };
  const Calls& calls() const { return calls_; }

 protected:
  // Writes `keys`/`values` [B, H, n, *] (n >= 1 real tokens) at the offset, which has not moved
  // yet.
  virtual void write(const Array& keys, const Array& values) = 0;
  // Records a capture for every scheduled offset the writes have reached.
  virtual void capture_reached() = 0;

 private:
  Calls calls_;
};

// update() of a batch over a cache's sequences: a one-row batch is its sequence's update; more
// rows are checked first (all of them, so a refusal changes nothing), then written one by one
// into their sequences, and the history is ragged. `sequence(id)` gives a sequence's KVKind.
template <class SequenceOf>
KVHistory update_rows(const Batch& batch, const Array& keys, const Array& values, const char* call,
                      SequenceOf&& sequence) {
  batch.validate(call);
  const int64_t rows = batch.batch_size();
  if (rows == 1) return sequence(batch.seq_id(0)).update(batch, keys, values);
  if (keys.ndim() != 4 || values.ndim() != 4 || keys.dim(0) != rows || values.dim(0) != rows) {
    throw Error(fmt::format("{}: keys {} and values {} must be [B, H, L, D] with B = {} rows", call,
                            keys.describe(), values.describe(), rows));
  }
  std::vector<Batch> one(static_cast<size_t>(rows));
  for (int64_t b = 0; b < rows; ++b) {
    one[static_cast<size_t>(b)] = batch.row(b);
    sequence(batch.seq_id(b))
        .check(one[static_cast<size_t>(b)], keys.slice(0, b, b + 1), values.slice(0, b, b + 1));
  }
  std::vector<KVHistory> histories;
  for (int64_t b = 0; b < rows; ++b) {
    histories.push_back(sequence(batch.seq_id(b))
                            .update(one[static_cast<size_t>(b)], keys.slice(0, b, b + 1),
                                    values.slice(0, b, b + 1)));
  }
  return KVHistory::of_rows(std::move(histories));
}

// view() of a batch: its one row's history, or a ragged one.
template <class HistoryOf>
KVHistory view_rows(const Batch& batch, HistoryOf&& history_of) {
  if (batch.batch_size() <= 1) return history_of(batch.batch_size() == 0 ? 0 : batch.seq_id(0));
  std::vector<KVHistory> histories;
  for (int64_t b = 0; b < batch.batch_size(); ++b) histories.push_back(history_of(batch.seq_id(b)));
  return KVHistory::of_rows(std::move(histories));
}

// What both attention caches are around their sequences: the sequences, the lock they and their
// snapshots share, copies that belong to no sequence, and the calls that only route to a
// sequence. Every member function takes the lock.
template <class Seq>
class KVCacheCore {
 public:
  // `name` ("KVCache") prefixes error messages; `make` makes an empty sequence.
  KVCacheCore(const char* name, std::function<std::unique_ptr<Seq>()> make)
      : name_(name),
        update_call_(fmt::format("{}::update", name)),
        sequences([this, make = std::move(make)] {
          std::unique_ptr<Seq> sequence = make();
          sequence->store.lock = shared_lock;
          return sequence;
        }) {}

  Seq& at(SeqId id) { return sequences.at(id, name_); }
  const Seq* find(SeqId id) const { return sequences.find(id); }

  KVHistory update(const Batch& batch, const Array& keys, const Array& values) {
    const Guard guard(lock);
    return update_rows(batch, keys, values, update_call_.c_str(),
                       [&](SeqId id) -> KVKind& { return at(id); });
  }
  KVHistory view(const Batch& batch) const {
    const Guard guard(lock);
    return view_rows(batch, [&](SeqId id) {
      const Seq* sequence = find(id);
      return sequence == nullptr ? KVHistory() : sequence->history();
    });
  }
  void reset_all() {
    const Guard guard(lock);
    sequences.for_each([](SeqId, Seq& sequence) { sequence.reset(); });
  }
  void reset(SeqId seq) {
    const Guard guard(lock);
    if (Seq* sequence = sequences.find(seq)) sequence->reset();
  }
  int64_t offset(SeqId seq) const {
    const Guard guard(lock);
    const Seq* sequence = find(seq);
    return sequence == nullptr ? 0 : sequence->offset;
  }
  int64_t exposed_bytes(SeqId seq) const {
    const Guard guard(lock);
    const Seq* sequence = find(seq);
    return sequence == nullptr ? 0 : sequence->exposed_bytes();
  }
  std::vector<SeqId> ids() const {
    const Guard guard(lock);
    std::vector<SeqId> out;
    sequences.for_each([&](SeqId id, const Seq&) { out.push_back(id); });
    return out;
  }
  void prepare(SeqId seq, std::span<const int64_t> offsets) {
    const Guard guard(lock);
    at(seq).prepare(offsets);
  }
  std::vector<SnapshotPtr> take(SeqId seq) {
    const Guard guard(lock);
    return at(seq).take();
  }
  void take_into(SeqId seq, std::vector<SnapshotPtr>& into) {
    const Guard guard(lock);
    at(seq).take_into(into);
  }
  std::vector<SnapshotPtr> take_reached(SeqId seq) {
    const Guard guard(lock);
    return at(seq).take_reached();
  }
  void cancel(SeqId seq) {
    const Guard guard(lock);
    if (Seq* sequence = sequences.find(seq)) sequence->cancel();
  }
  CopyStats stats() const {
    const Guard guard(lock);
    CopyStats total = unattributed;
    sequences.for_each([&](SeqId, const Seq& sequence) { add(total, sequence.store.stats); });
    return total;
  }

 private:
  const char* name_;
  std::string update_call_;

 public:
  // Before `sequences`: their snapshots lock it as they go. Snapshots lazy in them share it,
  // so one that outlives the cache can still take it (and find itself owned).
  std::shared_ptr<CacheLock> shared_lock = std::make_shared<CacheLock>();
  CacheLock& lock = *shared_lock;
  CopyStats unattributed;  // merge and split copies
  Sequences<Seq> sequences;
};

// Holds `ours` and the lock of whatever each snapshot's data lives in — the store a KVCache
// snapshot is lazy in, the pool of a PagedKVCache snapshot — taken together with std::lock's
// deadlock avoidance: two caches restoring, merging or splitting each other's snapshots at once
// never wait on each other (taking ours first, then theirs, could). Null snapshots, owned ones
// and locks met twice add nothing.
class SnapshotLocks {
 public:
  SnapshotLocks(CacheLock& ours, const Snapshot* first, const Snapshot* second = nullptr);
  ~SnapshotLocks();
  SnapshotLocks(const SnapshotLocks&) = delete;
  SnapshotLocks& operator=(const SnapshotLocks&) = delete;

 private:
  std::array<CacheLock*, 3> held_{};
  size_t count_ = 0;
};

}  // namespace kvsnap::detail
