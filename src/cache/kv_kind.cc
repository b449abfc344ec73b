#include "cache/kv_kind.h"

#include <fmt/format.h>

#include <initializer_list>
#include <mutex>

#include "cache/block_pool.h"

namespace kvsnap::detail {

KVKind::KVKind(const char* name)
    : calls_{fmt::format("{}::update", name),
             fmt::format("{}::snapshot", name),
             fmt::format("{}::prepare_snapshots", name),
             fmt::format("{}::take_snapshots", name),
             fmt::format("{}::restore", name),
             fmt::format("{}::merge", name),
             fmt::format("{}::split", name)} {}

void KVKind::check(const Batch& batch, const Array& keys, const Array& values, int64_t row,
                   SeqId seq) const {
  (void)check_update(batch, keys, values, offset, store.has_layout ? &store.layout : nullptr,
                     calls_.update.c_str(), row, seq);
}

KVHistory KVKind::update(const Batch& batch, const Array& keys, const Array& values, int64_t row,
                         SeqId seq) {
  const int64_t length =
      check_update(batch, keys, values, offset, store.has_layout ? &store.layout : nullptr,
                   calls_.update.c_str(), row, seq);
  // A write that fails leaves no layout taken either (with_layout), nor does one of no tokens
  // (below: it answers with an empty history of its layout, then lets the layout go).
  const bool had_layout = store.has_layout;
  with_layout(KVLayout::of(keys, values), [&] {
    if (length == 0) return;
    if (length == keys.dim(2)) {  // no padding columns: write the arrays as given
      write(keys, values);
    } else {
      write(keys.slice(2, 0, length), values.slice(2, 0, length));
    }
  });
  if (length > 0) {
    offset += length;
    store.stats.appended_bytes += length * store.token_bytes();
  }
  capture_reached();
  if (length > 0 || had_layout) return history();
  try {
    KVHistory out = history();
    store.clear();
    return out;
  } catch (...) {  // out of memory making the empty history: the layout goes all the same
    store.clear();
    throw;
  }
}

void KVKind::check_snapshot_from(int64_t from_offset) const {
  if (from_offset < 0 || from_offset > offset) {
    throw Error(fmt::format("{}: from_offset {} out of range [0, {}] (the cache offset)",
                            calls_.snapshot, from_offset, offset));
  }
}

void KVKind::prepare(std::span<const int64_t> offsets) {
  schedule.prepare(offsets, offset, calls_.prepare.c_str(), [&] { capture_reached(); });
}

std::vector<SnapshotPtr> KVKind::take() { return schedule.take(offset, calls_.take.c_str()); }
void KVKind::take_into(std::vector<SnapshotPtr>& into) {
  schedule.take_into(into, offset, calls_.take.c_str());
}

namespace {

// The lock guarding a snapshot's data when that is not the snapshot itself, or null. KV
// snapshots first: the calls of KVCache and RotatingKVCache, the most frequent, get them.
CacheLock* lock_of(const Snapshot* snapshot) {
  if (snapshot == nullptr) return nullptr;
  if (const auto* state = dynamic_cast<const KVStateSnapshot*>(snapshot)) {
    return state->owner() != nullptr ? state->lock() : nullptr;
  }
  const auto* paged = dynamic_cast<const PagedSnapshot*>(snapshot);
  return paged != nullptr ? &paged->pool()->lock : nullptr;
}

}  // namespace

SnapshotLocks::SnapshotLocks(CacheLock& ours, const Snapshot* first, const Snapshot* second) {
  held_[count_++] = &ours;
  for (const Snapshot* snapshot : {first, second}) {
    CacheLock* lock = lock_of(snapshot);
    if (lock != nullptr &&
        std::find(held_.begin(), held_.begin() + count_, lock) == held_.begin() + count_) {
      held_[count_++] = lock;
    }
  }
  if (count_ == 1) held_[0]->lock();
  if (count_ == 2) std::lock(*held_[0], *held_[1]);
  if (count_ == 3) std::lock(*held_[0], *held_[1], *held_[2]);
}

SnapshotLocks::~SnapshotLocks() {
  for (size_t i = 0; i < count_; ++i) held_[i]->unlock();
}

}  // namespace kvsnap::detail
