// A Cache that forwards every call of the single-sequence interface to another: tests derive
// from it to change one call (a failure on demand, a schedule it does not report).
#pragma once

#include <kvsnap/cache.h>

#include <span>
#include <utility>
#include <vector>

namespace kvsnap::testing {

class DelegatingCache : public Cache {
 public:
  explicit DelegatingCache(Cache& inner) : inner_(inner) {}
  std::vector<Array> state() const override { return inner_.state(); }
  void reset() override { inner_.reset(); }
  int64_t offset() const override { return inner_.offset(); }
  SnapshotPtr snapshot(int64_t from) override { return inner_.snapshot(from); }
  void prepare_snapshots(std::span<const int64_t> o) override { inner_.prepare_snapshots(o); }
  void cancel_snapshots() override { inner_.cancel_snapshots(); }
  std::vector<SnapshotPtr> take_snapshots() override { return inner_.take_snapshots(); }
  std::vector<SnapshotPtr> take_reached_snapshots() override {
    return inner_.take_reached_snapshots();
  }
  bool restore(Snapshot* s, int64_t target) override { return inner_.restore(s, target); }
  SnapshotPtr merge(SnapshotPtr a, SnapshotPtr b) override {
    return inner_.merge(std::move(a), std::move(b));
  }
  std::pair<SnapshotPtr, SnapshotPtr> split(SnapshotPtr s, int64_t at) override {
    return inner_.split(std::move(s), at);
  }
  CopyStats copy_stats() const override { return inner_.copy_stats(); }
  RestoreRule restore_rule() const override { return inner_.restore_rule(); }

 protected:
  Cache& inner_;
};

}  // namespace kvsnap::testing
