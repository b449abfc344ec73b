// Internal: what KVCache and RotatingKVCache share above the KV core — the offset, the capture
// schedule and the skeleton of their calls (checks, padding, accounting) — so a kind supplies only
// its policy: how a write lands in the store, what a capture holds, what its history is.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "cache/capture_schedule.h"
#include "cache/kv_store.h"

namespace kvsnap::detail {

class KVKind {
 public:
  // `name` ("KVCache") prefixes every error message.
  explicit KVKind(const char* name);
  virtual ~KVKind() = default;
  KVKind(const KVKind&) = delete;
  KVKind& operator=(const KVKind&) = delete;

  // Checks the batch and arrays, writes the real tokens through the kind's policy, advances the
  // offset, captures what the schedule reached and returns the history.
  KVHistory update(const Batch& batch, const Array& keys, const Array& values);
  // Throws Error unless 0 <= from_offset <= offset.
  void check_snapshot_from(int64_t from_offset) const;
  void prepare(std::span<const int64_t> offsets);
  std::vector<SnapshotPtr> take();
  std::vector<SnapshotPtr> take_reached() { return schedule.take_reached(); }
  void cancel() { schedule.clear(); }
  // Throws Error naming "<name>::restore" while captures are scheduled.
  void require_idle() const { schedule.require_idle(calls_.restore.c_str()); }

  virtual KVHistory history() const = 0;

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

}  // namespace kvsnap::detail
