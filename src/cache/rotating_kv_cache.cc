#include "kvsnap/rotating_kv_cache.h"

#include <fmt/format.h>

#include <algorithm>

#include "cache/capture_schedule.h"
#include "cache/kv_layout.h"
#include "cache/lazy_snapshot.h"
#include "cache/snapshot_record.h"

namespace kvsnap {
namespace detail {

class RotatingKVCacheImpl;

// The window of `count` tokens ending at `end`, in position order: lazy columns
// [column, column + count) of the owner's linear buffer, or owned compact arrays.
class RotatingSnapshot final : public LazySnapshot {
 public:
  RotatingSnapshot(RotatingKVCacheImpl* owner, int64_t column, int64_t count, int64_t end,
                   int64_t window)
      : owner(owner), column(column), count(count), end(end), window(window) {}
  RotatingSnapshot(Array keys, Array values, int64_t end, int64_t window)
      : owned_keys(std::move(keys)),
        owned_values(std::move(values)),
        count(owned_keys.dim(2)),
        end(end),
        window(window) {}

  int64_t size() const override {
    return owner != nullptr ? 0 : owned_keys.nbytes() + owned_values.nbytes();
  }
  int64_t from() const override { return end; }
  int64_t to() const override { return end; }

  Array keys() const;
  Array values() const;
  KVLayout layout() const;

  RotatingKVCacheImpl* owner = nullptr;  // non-null exactly while lazy
  Array owned_keys, owned_values;
  int64_t column = 0;
  int64_t count;
  int64_t end;
  int64_t window;  // max_size of the cache it came from: it restores only into the same window
};

// Invariant: columns [start, start + length) of the buffers are valid; ring index i (0 = the
// oldest) lives in column start + (oldest + i) % length and holds position
// offset - length + i. The buffer is linear when oldest == 0; it wraps only as a full ring
// (length == max_size, start == 0) fed by single-token writes.
class RotatingKVCacheImpl {
 public:
  explicit RotatingKVCacheImpl(int64_t max_size) : max_size(max_size) {}
  ~RotatingKVCacheImpl() { materialize_all(); }

  int64_t capacity() const { return keys.empty() ? 0 : keys.dim(2); }
  int64_t first_position() const { return offset - length; }
  bool linear() const { return oldest == 0; }
  int64_t token_bytes() const { return layout.token_bytes(); }
  int64_t window_tokens(int64_t end) const { return rotating_window_tokens(end, max_size); }
  int64_t column_of(int64_t ring_index) const { return start + (oldest + ring_index) % length; }

  // Copies ring indices [first, first + count) in position order into columns [0, count) of
  // `dst_keys`/`dst_values` (at most two runs: the ring may wrap once).
  void gather(int64_t first, int64_t count, const Array& dst_keys, const Array& dst_values) const {
    int64_t done = 0;
    while (done < count) {
      const int64_t column = column_of(first + done);
      const int64_t run = std::min(count - done, start + length - column);
      dst_keys.slice(2, done, done + run).assign(keys.slice(2, column, column + run));
      dst_values.slice(2, done, done + run).assign(values.slice(2, column, column + run));
      done += run;
    }
  }

  // Replaces the buffers by fresh ones of `new_capacity` columns holding the newest `keep`
  // tokens, in position order, from column 0.
  void relinearize(int64_t keep, int64_t new_capacity) {
    auto [new_keys, new_values] = layout.allocate(new_capacity);
    if (keep > 0) gather(length - keep, keep, new_keys, new_values);
    materialize_all();  // they name columns of the buffers about to be dropped
    keys = std::move(new_keys);
    values = std::move(new_values);
    stats.growth_bytes += keep * token_bytes();
    start = 0;
    length = keep;
    oldest = 0;
  }

  void materialize(RotatingSnapshot& s) { materialize_slots(s, lazy, stats); }
  // Before columns [from, to) are overwritten.
  void materialize_columns(int64_t from, int64_t to) {
    lazy.for_each([&](LazySnapshot& base) {
      auto& s = static_cast<RotatingSnapshot&>(base);
      if (s.column < to && from < s.column + s.count) materialize(s);
    });
  }
  void materialize_all() {
    lazy.for_each([&](LazySnapshot& s) { materialize(static_cast<RotatingSnapshot&>(s)); });
  }

  // The window ending at `end` (first_position() <= end - window_tokens(end), end <= offset;
  // a wrapped ring only at end == offset). Null only at offset 0 (the empty state); a window
  // that needs no old token (max_size 1) is a real, empty snapshot: a restore point.
  SnapshotPtr capture_window(int64_t end) {
    if (end == 0) return nullptr;
    const int64_t count = window_tokens(end);
    const int64_t first_index = end - count - first_position();
    if (count == 0) {
      auto [k, v] = layout.allocate(0);
      return std::make_unique<RotatingSnapshot>(std::move(k), std::move(v), end, max_size);
    }
    if (linear()) {
      auto s = std::make_unique<RotatingSnapshot>(this, start + first_index, count, end, max_size);
      lazy.push(s.get());
      return s;
    }
    auto [k, v] = layout.allocate(count);
    gather(first_index, count, k, v);
    stats.snapshot_bytes += count * token_bytes();
    return std::make_unique<RotatingSnapshot>(std::move(k), std::move(v), end, max_size);
  }

  void capture_reached() {
    while (schedule.active() && schedule.next() >= 0 && schedule.next() <= offset) {
      schedule.record(capture_window(schedule.next()));
    }
  }

  void write_columns(int64_t column, const Array& k, const Array& v) {
    const int64_t n = k.dim(2);
    materialize_columns(column, column + n);
    keys.assign_slice(2, column, k);
    values.assign_slice(2, column, v);
  }

  void write_one(const Array& k, const Array& v) {
    if (length < max_size && linear()) {  // filling the window: append
      if (start + length >= capacity()) {
        // Stepped, geometric growth, never past the window (length < max_size here).
        const int64_t grown = std::max(round_up(length + 1, RotatingKVCache::kStep), 2 * length);
        relinearize(length, std::min(grown, max_size));
      }
      write_columns(start + length, k, v);
      ++length;
    } else if (length == max_size && start == 0) {  // full ring: overwrite the oldest
      write_columns(oldest, k, v);
      oldest = (oldest + 1) % max_size;
    } else {  // longer than the window (after a chunk): keep the newest max_size-1, append
      const int64_t keep = max_size - 1;
      if (linear() && capacity() >= max_size) {
        const int64_t source = start + length - keep;
        materialize_columns(0, keep);
        if (keep > 0 && source != 0) {
          // Shift along the token axis of every head; runs overlap only within a head (memmove).
          keys.slice(2, 0, keep).assign(keys.slice(2, source, source + keep));
          values.slice(2, 0, keep).assign(values.slice(2, source, source + keep));
          stats.growth_bytes += keep * token_bytes();
        }
        start = 0;
        length = keep;
      } else {
        relinearize(keep, round_up(max_size, RotatingKVCache::kStep));
      }
      write_columns(keep, k, v);
      length = max_size;
    }
  }

  void write_chunk(const Array& k, const Array& v) {
    const int64_t chunk = k.dim(2);
    const int64_t kept = std::min(length, max_size - 1);
    if (linear() && start + length + chunk <= capacity()) {
      // In place: the oldest tokens drop off by moving `start`; nothing old is copied.
      write_columns(start + length, k, v);
      start += length - kept;
      length = kept + chunk;
      return;
    }
    // Fresh linear buffer with room for the window to keep growing by another window.
    const int64_t need = kept + chunk;
    relinearize(kept, round_up(std::max(need + std::min(need, max_size), max_size),
                               RotatingKVCache::kStep));
    write_columns(kept, k, v);
    length = need;
  }

  KVHistory history() const {
    if (!has_layout) return KVHistory();
    if (keys.empty()) {
      auto [k, v] = layout.allocate(0);
      return KVHistory(std::move(k), std::move(v), offset, 0, max_size);
    }
    return KVHistory(keys.slice(2, start, start + length), values.slice(2, start, start + length),
                     first_position(), oldest, max_size);
  }

  const int64_t max_size;
  Array keys, values;
  KVLayout layout;
  bool has_layout = false;
  int64_t offset = 0, start = 0, length = 0, oldest = 0;
  CopyStats stats;
  LazyList lazy;  // before `schedule`: captured snapshots unlink from it
  CaptureSchedule schedule;
};

Array RotatingSnapshot::keys() const {
  return owner != nullptr ? owner->keys.slice(2, column, column + count) : owned_keys;
}
Array RotatingSnapshot::values() const {
  return owner != nullptr ? owner->values.slice(2, column, column + count) : owned_values;
}
KVLayout RotatingSnapshot::layout() const {
  return owner != nullptr ? owner->layout : KVLayout::of(owned_keys, owned_values);
}

namespace {

RotatingSnapshot* as_rotating_snapshot(Snapshot* snapshot, const char* call) {
  if (snapshot == nullptr) return nullptr;
  auto* rotating = dynamic_cast<RotatingSnapshot*>(snapshot);
  if (rotating == nullptr) {
    throw Error(
        fmt::format("{}: the snapshot is not a RotatingKVCache snapshot (snapshots "
                    "restore only into a cache of their own kind)",
                    call));
  }
  return rotating;
}

}  // namespace

bool rotating_record(const Snapshot& snapshot, SnapshotRecord& record) {
  const auto* rotating = dynamic_cast<const RotatingSnapshot*>(&snapshot);
  if (rotating == nullptr) return false;
  record = {SnapshotRecord::Kind::rotating,
            rotating->keys(),
            rotating->values(),
            rotating->end,
            rotating->end,
            rotating->window};
  return true;
}

SnapshotPtr make_rotating_snapshot(Array keys, Array values, int64_t end, int64_t window) {
  return std::make_unique<RotatingSnapshot>(std::move(keys), std::move(values), end, window);
}

// Throws Error naming `call` unless `s` fits `c`: the same window, and the same layout once the
// cache has one.
void check_fits(const RotatingKVCacheImpl& c, const RotatingSnapshot& s, const char* call) {
  const KVLayout layout = s.layout();
  if (s.window == c.max_size && (!c.has_layout || layout == c.layout)) return;
  throw Error(fmt::format(
      "{}: the snapshot (window {}, {}) does not fit this cache (window {}, {}): a window "
      "restores only into a cache of the same window and layout",
      call, s.window, layout.describe(), c.max_size,
      c.has_layout ? c.layout.describe() : "no layout yet"));
}

}  // namespace detail

using detail::RotatingSnapshot;

RotatingKVCache::RotatingKVCache(int64_t max_size) {
  if (max_size < 1) {
    throw Error(fmt::format("RotatingKVCache: max_size {} must be >= 1", max_size));
  }
  impl_ = std::make_unique<detail::RotatingKVCacheImpl>(max_size);
}

RotatingKVCache::~RotatingKVCache() = default;

int64_t RotatingKVCache::max_size() const { return impl_->max_size; }

KVHistory RotatingKVCache::update(const Batch& batch, const Array& keys, const Array& values) {
  detail::RotatingKVCacheImpl& c = *impl_;
  const int64_t length = detail::check_update(
      batch, keys, values, c.offset, c.has_layout ? &c.layout : nullptr, "RotatingKVCache::update");
  if (!c.has_layout) {
    c.layout = detail::KVLayout::of(keys, values);
    c.has_layout = true;
  }
  const auto write = [&](const Array& k, const Array& v) {
    if (length == 1) {
      c.write_one(k, v);
    } else if (length > 1) {
      c.write_chunk(k, v);
    }
  };
  if (length == keys.dim(2)) {  // no padding columns: write the arrays as given
    write(keys, values);
  } else {
    write(keys.slice(2, 0, length), values.slice(2, 0, length));
  }
  c.offset += length;
  c.stats.appended_bytes += length * c.token_bytes();
  c.capture_reached();
  return c.history();
}

KVHistory RotatingKVCache::view(const Batch&) const { return impl_->history(); }

std::vector<Array> RotatingKVCache::state() const {
  const KVHistory history = impl_->history();
  if (history.keys().empty()) return {};
  return {history.keys(), history.values()};
}

void RotatingKVCache::reset() {
  detail::RotatingKVCacheImpl& c = *impl_;
  c.schedule.clear();
  c.materialize_all();
  c.keys = Array();
  c.values = Array();
  c.has_layout = false;
  c.offset = c.start = c.length = c.oldest = 0;
}

int64_t RotatingKVCache::offset() const { return impl_->offset; }

SnapshotPtr RotatingKVCache::snapshot(int64_t from_offset) {
  detail::RotatingKVCacheImpl& c = *impl_;
  if (from_offset < 0 || from_offset > c.offset) {
    throw Error(
        fmt::format("RotatingKVCache::snapshot: from_offset {} out of range [0, {}] (the "
                    "cache offset)",
                    from_offset, c.offset));
  }
  return c.capture_window(c.offset);
}

void RotatingKVCache::prepare_snapshots(std::span<const int64_t> offsets) {
  impl_->schedule.prepare(offsets, impl_->offset, "RotatingKVCache::prepare_snapshots");
  impl_->capture_reached();
}

std::vector<SnapshotPtr> RotatingKVCache::take_snapshots() {
  return impl_->schedule.take(impl_->offset, "RotatingKVCache::take_snapshots");
}

bool RotatingKVCache::restore(Snapshot* snapshot, int64_t target) {
  detail::RotatingKVCacheImpl& c = *impl_;
  c.schedule.require_idle("RotatingKVCache::restore");
  if (snapshot == nullptr) {
    // Exact only while nothing was evicted: then the window holds every position [0, offset).
    if (c.offset > c.max_size || target < 0 || target > c.offset) return false;
    c.length = target;
    c.offset = target;
    return true;
  }
  RotatingSnapshot& s = *detail::as_rotating_snapshot(snapshot, "RotatingKVCache::restore");
  detail::check_fits(c, s, "RotatingKVCache::restore");
  if (target < 0 || target > s.end || (target < s.end && s.end > c.max_size)) return false;
  // Clamping below the end keeps positions [0, target): the window then starts at position 0.
  const int64_t tokens = target < s.end ? target : s.count;
  if (s.owner == &c) {  // the data is still in the columns it names
    c.start = s.column;
    c.length = tokens;
    c.oldest = 0;
    c.offset = target;
    return true;
  }
  const detail::KVLayout layout = s.layout();
  const Array keys = s.keys().slice(2, 0, tokens);
  const Array values = s.values().slice(2, 0, tokens);
  if (!c.has_layout) {
    c.layout = layout;
    c.has_layout = true;
  }
  if (c.capacity() < tokens || c.capacity() == 0) {
    c.materialize_all();
    auto [k, v] = c.layout.allocate(detail::round_up(std::max<int64_t>(tokens, 1), kStep));
    c.keys = std::move(k);
    c.values = std::move(v);
  }
  if (tokens > 0) c.write_columns(0, keys, values);
  c.stats.restored_bytes += tokens * c.token_bytes();
  c.start = 0;
  c.length = tokens;
  c.oldest = 0;
  c.offset = target;
  return true;
}

SnapshotPtr RotatingKVCache::merge(SnapshotPtr parent, SnapshotPtr child) {
  (void)detail::as_rotating_snapshot(parent.get(), "RotatingKVCache::merge");
  (void)detail::as_rotating_snapshot(child.get(), "RotatingKVCache::merge");
  return child;
}

std::pair<SnapshotPtr, SnapshotPtr> RotatingKVCache::split(SnapshotPtr snapshot, int64_t) {
  (void)detail::as_rotating_snapshot(snapshot.get(), "RotatingKVCache::split");
  return {nullptr, std::move(snapshot)};
}

CopyStats RotatingKVCache::copy_stats() const { return impl_->stats; }

RestoreRule RotatingKVCache::restore_rule() const {
  return {RestoreRule::Kind::whole_state, impl_->max_size};
}

void RotatingKVCache::cancel_snapshots() { impl_->schedule.clear(); }

std::vector<SnapshotPtr> RotatingKVCache::take_reached_snapshots() {
  return impl_->schedule.take_reached();
}

}  // namespace kvsnap
