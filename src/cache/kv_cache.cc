// KVCache: the append policy over the KV core. Column c of the store holds position c.
#include "kvsnap/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>

#include "cache/capture_schedule.h"
#include "cache/kv_layout.h"
#include "cache/kv_store.h"

namespace kvsnap {
namespace detail {

using Kind = SnapshotRecord::Kind;

class KVCacheImpl {
 public:
  // Grows to hold `tokens` columns, keeping every column still named by the offset or a lazy
  // snapshot in place. Geometric growth keeps the bytes moved by a long prefill linear in its
  // length.
  void ensure_capacity(int64_t tokens) {
    const int64_t current = store.capacity();
    if (tokens <= current) return;
    const int64_t wanted = std::max({tokens, 2 * current, reserved});
    store.resize(round_up(wanted, KVCache::kStep), std::max(offset, store.lazy_end()));
  }

  // Records a capture for every scheduled offset the writes have reached: the edge
  // [previous scheduled offset, offset), lazy.
  void capture_reached() {
    while (schedule.active() && schedule.next() >= 0 && schedule.next() <= offset) {
      const int64_t start = schedule.edge_start();
      const int64_t end = schedule.next();
      schedule.record(start == end ? nullptr : lazy_snapshot(start, end));
    }
  }

  SnapshotPtr lazy_snapshot(int64_t from, int64_t to) {
    return store.capture(Kind::kv, from, to - from, from, to, 0);
  }

  KVHistory history() const {
    if (!store.has_layout) return KVHistory();
    if (store.keys.empty()) {  // a zero-length first update: an empty history of the layout
      auto [k, v] = store.layout.allocate(0);
      return KVHistory(std::move(k), std::move(v));
    }
    return KVHistory(store.keys.slice(2, 0, offset), store.values.slice(2, 0, offset));
  }

  // Writes the snapshot's tokens [from, target) that are not already in their columns: owned
  // parts, and parts lazy in another cache.
  void write_back(const KVStateSnapshot& s, int64_t target) {
    ensure_capacity(target);
    s.for_each_part(target - s.begin,
                    [&](int64_t first, const Array& k, const Array& v, int64_t lazy_column) {
                      const int64_t position = s.begin + first;
                      if (s.owner == &store && lazy_column == position) return;  // in place
                      store.write(position, k, v);
                      store.stats.restored_bytes += k.dim(2) * store.token_bytes();
                    });
  }

  KVStore store;  // before `schedule`: captured snapshots unlink from it
  int64_t offset = 0;
  int64_t reserved = 0;
  CaptureSchedule schedule;
};

}  // namespace detail

using detail::Kind;
using detail::KVStateSnapshot;

KVCache::KVCache() : impl_(std::make_unique<detail::KVCacheImpl>()) {}
KVCache::~KVCache() = default;

void KVCache::reserve(int64_t tokens) {
  if (tokens < 0) throw Error(fmt::format("KVCache::reserve: tokens {} must be >= 0", tokens));
  impl_->reserved = std::max(impl_->reserved, tokens);
  if (impl_->store.has_layout) impl_->ensure_capacity(tokens);
}

int64_t KVCache::capacity() const { return impl_->store.capacity(); }

int64_t KVCache::lazy_bytes(int64_t from, int64_t to) const {
  return impl_->store.has_layout ? impl_->store.lazy_bytes(from, to) : 0;
}

KVHistory KVCache::update(const Batch& batch, const Array& keys, const Array& values) {
  detail::KVCacheImpl& c = *impl_;
  detail::KVStore& store = c.store;
  const int64_t length = detail::check_update(
      batch, keys, values, c.offset, store.has_layout ? &store.layout : nullptr, "KVCache::update");
  if (!store.has_layout) store.adopt_layout(detail::KVLayout::of(keys, values));
  if (length > 0) {
    c.ensure_capacity(c.offset + length);
    if (length == keys.dim(2)) {  // no padding columns: write the arrays as given
      store.write(c.offset, keys, values);
    } else {
      store.write(c.offset, keys.slice(2, 0, length), values.slice(2, 0, length));
    }
    c.offset += length;
    store.stats.appended_bytes += length * store.token_bytes();
  }
  c.capture_reached();
  return c.history();
}

KVHistory KVCache::view(const Batch&) const { return impl_->history(); }

std::vector<Array> KVCache::state() const {
  const detail::KVStore& store = impl_->store;
  if (store.keys.empty()) return {};
  return {store.keys.slice(2, 0, impl_->offset), store.values.slice(2, 0, impl_->offset)};
}

void KVCache::reset() {
  impl_->schedule.clear();
  impl_->store.clear();
  impl_->offset = 0;
}

int64_t KVCache::offset() const { return impl_->offset; }

SnapshotPtr KVCache::snapshot(int64_t from_offset) {
  detail::KVCacheImpl& c = *impl_;
  if (from_offset < 0 || from_offset > c.offset) {
    throw Error(
        fmt::format("KVCache::snapshot: from_offset {} out of range [0, {}] (the cache "
                    "offset)",
                    from_offset, c.offset));
  }
  if (from_offset == c.offset) return nullptr;
  return c.lazy_snapshot(from_offset, c.offset);
}

void KVCache::prepare_snapshots(std::span<const int64_t> offsets) {
  impl_->schedule.prepare(offsets, impl_->offset, "KVCache::prepare_snapshots");
  impl_->capture_reached();
}

std::vector<SnapshotPtr> KVCache::take_snapshots() {
  return impl_->schedule.take(impl_->offset, "KVCache::take_snapshots");
}

bool KVCache::restore(Snapshot* snapshot, int64_t target) {
  detail::KVCacheImpl& c = *impl_;
  c.schedule.require_idle("KVCache::restore");
  if (snapshot == nullptr) {
    if (target < 0 || target > c.offset) return false;
    c.offset = target;
    return true;
  }
  KVStateSnapshot& s = detail::as_kv_state(snapshot, Kind::kv, "KVCache::restore");
  if (c.store.has_layout) detail::check_same_layout(c.store.layout, s.layout, "KVCache::restore");
  if (target < 0 || target > s.end || c.offset < s.begin) return false;
  if (target > s.begin) {
    if (!c.store.has_layout) c.store.adopt_layout(s.layout);
    c.write_back(s, target);  // nothing for this cache's own lazy snapshot: an offset move
  }
  c.offset = target;
  return true;
}

SnapshotPtr KVCache::merge(SnapshotPtr parent, SnapshotPtr child) {
  if (parent == nullptr || child == nullptr) return nullptr;
  KVStateSnapshot& a = detail::as_kv_state(parent.get(), Kind::kv, "KVCache::merge");
  KVStateSnapshot& b = detail::as_kv_state(child.get(), Kind::kv, "KVCache::merge");
  if (a.end != b.begin) {
    throw Error(
        fmt::format("KVCache::merge: parent [{}, {}) and child [{}, {}) are not adjacent "
                    "(parent must end where child begins)",
                    a.begin, a.end, b.begin, b.end));
  }
  detail::check_same_layout(a.layout, b.layout, "KVCache::merge");
  a.append(b);
  return parent;
}

std::pair<SnapshotPtr, SnapshotPtr> KVCache::split(SnapshotPtr snapshot, int64_t at) {
  if (snapshot == nullptr) return {nullptr, nullptr};
  KVStateSnapshot& s = detail::as_kv_state(snapshot.get(), Kind::kv, "KVCache::split");
  if (at <= s.begin) return {nullptr, std::move(snapshot)};
  if (at >= s.end) return {std::move(snapshot), nullptr};
  SnapshotPtr after = s.split_off(at, impl_->store.stats);
  return {std::move(snapshot), std::move(after)};
}

CopyStats KVCache::copy_stats() const { return impl_->store.stats; }

RestoreRule KVCache::restore_rule() const { return {RestoreRule::Kind::ranges, 0}; }

void KVCache::cancel_snapshots() { impl_->schedule.clear(); }

std::vector<SnapshotPtr> KVCache::take_reached_snapshots() {
  return impl_->schedule.take_reached();
}

}  // namespace kvsnap
