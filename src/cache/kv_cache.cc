// KVCache: the append policy over the KV core. Column c of the store holds position c.
#include "kvsnap/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>

#include "cache/kv_kind.h"

namespace kvsnap {
namespace detail {

using Kind = SnapshotRecord::Kind;

class KVCacheImpl final : public KVKind {
 public:
  KVCacheImpl() : KVKind("KVCache") {}

  // Grows to hold `tokens` columns, keeping every column still named by the offset or a lazy
  // snapshot in place. Geometric growth keeps the bytes moved by a long prefill linear in its
  // length.
  void ensure_capacity(int64_t tokens) {
    const int64_t current = store.capacity();
    if (tokens <= current) return;
    const int64_t wanted = std::max({tokens, 2 * current, reserved});
    store.resize(round_up(wanted, KVCache::kStep), std::max(offset, store.lazy_end()));
  }

  // The append policy: the tokens go to the columns of their positions.
  void write(const Array& keys, const Array& values) override {
    ensure_capacity(offset + keys.dim(2));
    store.write(offset, keys, values);
  }

  // Captures are edges [previous scheduled offset, offset), lazy.
  void capture_reached() override {
    while (schedule.active() && schedule.next() >= 0 && schedule.next() <= offset) {
      const int64_t start = schedule.edge_start();
      const int64_t end = schedule.next();
      schedule.record(start == end ? nullptr : lazy_snapshot(start, end));
    }
  }

  SnapshotPtr lazy_snapshot(int64_t from, int64_t to) {
    return store.capture(Kind::kv, from, to - from, from, to, 0);
  }

  KVHistory history() const override {
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

  int64_t reserved = 0;
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
  return impl_->update(batch, keys, values);
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
  impl_->check_snapshot_from(from_offset);
  if (from_offset == impl_->offset) return nullptr;
  return impl_->lazy_snapshot(from_offset, impl_->offset);
}

void KVCache::prepare_snapshots(std::span<const int64_t> offsets) { impl_->prepare(offsets); }
std::vector<SnapshotPtr> KVCache::take_snapshots() { return impl_->take(); }
std::vector<SnapshotPtr> KVCache::take_reached_snapshots() { return impl_->take_reached(); }
void KVCache::cancel_snapshots() { impl_->cancel(); }

bool KVCache::restore(Snapshot* snapshot, int64_t target) {
  detail::KVCacheImpl& c = *impl_;
  c.require_idle();
  if (snapshot == nullptr) {
    if (target < 0 || target > c.offset) return false;
    c.offset = target;
    return true;
  }
  const char* call = c.calls().restore.c_str();
  KVStateSnapshot& s = detail::as_kv_state(snapshot, Kind::kv, call);
  if (c.store.has_layout) detail::check_same_layout(c.store.layout, s.layout, call);
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

}  // namespace kvsnap
