#include "kvsnap/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>

#include "cache/capture_schedule.h"
#include "cache/kv_layout.h"
#include "cache/lazy_snapshot.h"
#include "cache/snapshot_record.h"

namespace kvsnap {
namespace detail {

class KVCacheImpl;

// Keys/values of [from, to): lazy (slots of `owner`'s buffers) or owned compact arrays.
class KVSnapshot final : public LazySnapshot {
 public:
  KVSnapshot(KVCacheImpl* owner, int64_t from, int64_t to) : owner(owner), begin(from), end(to) {}
  KVSnapshot(Array keys, Array values, int64_t from)
      : owned_keys(std::move(keys)),
        owned_values(std::move(values)),
        begin(from),
        end(from + owned_keys.dim(2)) {}

  int64_t size() const override {
    return owner != nullptr ? 0 : owned_keys.nbytes() + owned_values.nbytes();
  }
  int64_t from() const override { return begin; }
  int64_t to() const override { return end; }

  Array keys() const;    // [B, H, to - from, D], a view of the owner's buffer while lazy
  Array values() const;  // [B, H, to - from, Dv]
  KVLayout layout() const;

  KVCacheImpl* owner = nullptr;  // non-null exactly while lazy
  Array owned_keys, owned_values;
  int64_t begin, end;
};

class KVCacheImpl {
 public:
  ~KVCacheImpl() { materialize_all(); }

  int64_t capacity() const { return keys.empty() ? 0 : keys.dim(2); }
  int64_t token_bytes() const { return layout.token_bytes(); }

  // Grows to hold `tokens`, keeping every slot still named by the offset or a lazy snapshot.
  // Geometric growth keeps the bytes moved by a long prefill linear in its length.
  void ensure_capacity(int64_t tokens) {
    const int64_t current = capacity();
    if (tokens <= current) return;
    const int64_t wanted = std::max({tokens, 2 * current, reserved});
    const int64_t rounded = round_up(wanted, KVCache::kStep);
    auto [new_keys, new_values] = layout.allocate(rounded);
    const int64_t live = std::max(offset, lazy_end());
    if (live > 0) {
      new_keys.slice(2, 0, live).assign(keys.slice(2, 0, live));
      new_values.slice(2, 0, live).assign(values.slice(2, 0, live));
      stats.growth_bytes += live * token_bytes();
    }
    keys = std::move(new_keys);
    values = std::move(new_values);
  }

  int64_t lazy_end() {
    int64_t end = 0;
    lazy.for_each([&](LazySnapshot& s) { end = std::max(end, s.to()); });
    return end;
  }

  // Copies the snapshot's slots out; it owns its bytes from now on.
  void materialize(KVSnapshot& s) { materialize_slots(s, lazy, stats); }

  // Before slots [from, to) are overwritten: copy out every lazy snapshot naming one of them.
  void materialize_overlapping(int64_t from, int64_t to) {
    lazy.for_each([&](LazySnapshot& s) {
      if (s.from() < to && from < s.to()) materialize(static_cast<KVSnapshot&>(s));
    });
  }
  void materialize_all() {
    lazy.for_each([&](LazySnapshot& s) { materialize(static_cast<KVSnapshot&>(s)); });
  }

  std::unique_ptr<KVSnapshot> lazy_snapshot(int64_t from, int64_t to) {
    auto s = std::make_unique<KVSnapshot>(this, from, to);
    lazy.push(s.get());
    return s;
  }

  // Writes tokens [at, at + L) from keys/values [B, H, L, *].
  void write(int64_t at, const Array& new_keys, const Array& new_values) {
    const int64_t length = new_keys.dim(2);
    ensure_capacity(at + length);
    materialize_overlapping(at, at + length);
    keys.assign_slice(2, at, new_keys);
    values.assign_slice(2, at, new_values);
  }

  // Records a capture for every scheduled offset the writes have reached.
  void capture_reached() {
    while (schedule.active() && schedule.next() >= 0 && schedule.next() <= offset) {
      const int64_t start = schedule.edge_start();
      const int64_t end = schedule.next();
      schedule.record(start == end ? nullptr : lazy_snapshot(start, end));
    }
  }

  KVHistory history() const {
    if (!has_layout) return KVHistory();
    if (keys.empty()) {  // a zero-length first update: an empty history of the right layout
      auto [k, v] = layout.allocate(0);
      return KVHistory(std::move(k), std::move(v));
    }
    return KVHistory(keys.slice(2, 0, offset), values.slice(2, 0, offset));
  }

  Array keys, values;  // [B, H, capacity, D] / [B, H, capacity, Dv]
  KVLayout layout;
  bool has_layout = false;
  int64_t offset = 0;
  int64_t reserved = 0;
  CopyStats stats;
  LazyList lazy;  // declared before `schedule`: captured snapshots unlink from it
  CaptureSchedule schedule;
};

Array KVSnapshot::keys() const {
  return owner != nullptr ? owner->keys.slice(2, begin, end) : owned_keys;
}
Array KVSnapshot::values() const {
  return owner != nullptr ? owner->values.slice(2, begin, end) : owned_values;
}
KVLayout KVSnapshot::layout() const {
  return owner != nullptr ? owner->layout : KVLayout::of(owned_keys, owned_values);
}

namespace {

KVSnapshot& as_kv_snapshot(Snapshot* snapshot, const char* call) {
  auto* kv = dynamic_cast<KVSnapshot*>(snapshot);
  if (kv == nullptr) {
    throw Error(
        fmt::format("{}: the snapshot is not a KVCache snapshot (snapshots restore only "
                    "into a cache of their own kind)",
                    call));
  }
  return *kv;
}

}  // namespace

bool kv_record(const Snapshot& snapshot, SnapshotRecord& record) {
  const auto* kv = dynamic_cast<const KVSnapshot*>(&snapshot);
  if (kv == nullptr) return false;
  record = {SnapshotRecord::Kind::kv, kv->keys(), kv->values(), kv->begin, kv->end};
  return true;
}

SnapshotPtr make_kv_snapshot(Array keys, Array values, int64_t from) {
  return std::make_unique<KVSnapshot>(std::move(keys), std::move(values), from);
}

}  // namespace detail

using detail::KVSnapshot;

KVCache::KVCache() : impl_(std::make_unique<detail::KVCacheImpl>()) {}
KVCache::~KVCache() = default;

void KVCache::reserve(int64_t tokens) {
  if (tokens < 0) throw Error(fmt::format("KVCache::reserve: tokens {} must be >= 0", tokens));
  impl_->reserved = std::max(impl_->reserved, tokens);
  if (impl_->has_layout) impl_->ensure_capacity(tokens);
}

int64_t KVCache::capacity() const { return impl_->capacity(); }

KVHistory KVCache::update(const Batch& batch, const Array& keys, const Array& values) {
  detail::KVCacheImpl& c = *impl_;
  const int64_t length = detail::check_update(
      batch, keys, values, c.offset, c.has_layout ? &c.layout : nullptr, "KVCache::update");
  if (!c.has_layout) {
    c.layout = detail::KVLayout::of(keys, values);
    c.has_layout = true;
  }
  if (length > 0) {
    if (length == keys.dim(2)) {  // no padding columns: write the arrays as given
      c.write(c.offset, keys, values);
    } else {
      c.write(c.offset, keys.slice(2, 0, length), values.slice(2, 0, length));
    }
    c.offset += length;
    c.stats.appended_bytes += length * c.token_bytes();
  }
  c.capture_reached();
  return c.history();
}

KVHistory KVCache::view(const Batch&) const { return impl_->history(); }

std::vector<Array> KVCache::state() const {
  if (impl_->keys.empty()) return {};
  return {impl_->keys.slice(2, 0, impl_->offset), impl_->values.slice(2, 0, impl_->offset)};
}

void KVCache::reset() {
  detail::KVCacheImpl& c = *impl_;
  c.schedule.clear();
  c.materialize_all();
  c.keys = Array();
  c.values = Array();
  c.has_layout = false;
  c.offset = 0;
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
  KVSnapshot& s = detail::as_kv_snapshot(snapshot, "KVCache::restore");
  const detail::KVLayout layout = s.layout();
  if (c.has_layout) detail::check_same_layout(c.layout, layout, "KVCache::restore");
  if (target < 0 || target > s.end || c.offset < s.begin) return false;
  if (target <= s.begin || s.owner == &c) {
    // At or before the snapshot's start nothing needs writing; an own lazy snapshot's data is
    // still in the slots it names, so either way this is an offset move.
    c.offset = target;
    return true;
  }
  const Array keys = s.keys().slice(2, 0, target - s.begin);
  const Array values = s.values().slice(2, 0, target - s.begin);
  if (!c.has_layout) {
    c.layout = layout;
    c.has_layout = true;
  }
  c.write(s.begin, keys, values);
  c.stats.restored_bytes += (target - s.begin) * c.token_bytes();
  c.offset = target;
  return true;
}

SnapshotPtr KVCache::merge(SnapshotPtr parent, SnapshotPtr child) {
  if (parent == nullptr || child == nullptr) return nullptr;
  KVSnapshot& a = detail::as_kv_snapshot(parent.get(), "KVCache::merge");
  KVSnapshot& b = detail::as_kv_snapshot(child.get(), "KVCache::merge");
  if (a.end != b.begin) {
    throw Error(
        fmt::format("KVCache::merge: parent [{}, {}) and child [{}, {}) are not adjacent "
                    "(parent must end where child begins)",
                    a.begin, a.end, b.begin, b.end));
  }
  if (a.owner != nullptr && a.owner == b.owner) return a.owner->lazy_snapshot(a.begin, b.end);
  const detail::KVLayout layout = a.layout();
  detail::check_same_layout(layout, b.layout(), "KVCache::merge");
  auto [keys, values] = layout.allocate(b.end - a.begin);
  const int64_t split = a.end - a.begin;
  keys.slice(2, 0, split).assign(a.keys());
  keys.slice(2, split, b.end - a.begin).assign(b.keys());
  values.slice(2, 0, split).assign(a.values());
  values.slice(2, split, b.end - a.begin).assign(b.values());
  auto merged = std::make_unique<KVSnapshot>(std::move(keys), std::move(values), a.begin);
  impl_->stats.snapshot_bytes += merged->size();
  return merged;
}

std::pair<SnapshotPtr, SnapshotPtr> KVCache::split(SnapshotPtr snapshot, int64_t at) {
  if (snapshot == nullptr) return {nullptr, nullptr};
  KVSnapshot& s = detail::as_kv_snapshot(snapshot.get(), "KVCache::split");
  if (at <= s.begin) return {nullptr, std::move(snapshot)};
  if (at >= s.end) return {std::move(snapshot), nullptr};
  if (s.owner != nullptr) {
    SnapshotPtr after = s.owner->lazy_snapshot(at, s.end);
    s.end = at;
    s.clear_materialize_hook();
    return {std::move(snapshot), std::move(after)};
  }
  const int64_t cut = at - s.begin, length = s.end - s.begin;
  auto before = std::make_unique<KVSnapshot>(s.owned_keys.slice(2, 0, cut).contiguous(),
                                             s.owned_values.slice(2, 0, cut).contiguous(), s.begin);
  auto after = std::make_unique<KVSnapshot>(s.owned_keys.slice(2, cut, length).contiguous(),
                                            s.owned_values.slice(2, cut, length).contiguous(), at);
  impl_->stats.snapshot_bytes += before->size() + after->size();
  return {std::move(before), std::move(after)};
}

CopyStats KVCache::copy_stats() const { return impl_->stats; }

RestoreRule KVCache::restore_rule() const { return {RestoreRule::Kind::ranges, 0}; }

void KVCache::cancel_snapshots() { impl_->schedule.clear(); }

std::vector<SnapshotPtr> KVCache::take_reached_snapshots() {
  return impl_->schedule.take_reached();
}

}  // namespace kvsnap
