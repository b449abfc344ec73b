#include "kvsnap/rotating_kv_cache.h"

#include <fmt/format.h>

#include <algorithm>

#include "cache/kv_kind.h"

namespace kvsnap {
namespace detail {

using Kind = SnapshotRecord::Kind;

// The ring policy over the KV core. Invariant: columns [start, start + length) of the store are
// valid; ring index i (0 = the oldest) lives in column start + (oldest + i) % length and holds
// position offset - length + i. The buffer is linear when oldest == 0; it wraps only as a full
// ring (length == max_size, start == 0) fed by single-token writes.
class RotatingSequence final : public KVKind {
 public:
  explicit RotatingSequence(int64_t max_size) : KVKind("RotatingKVCache"), max_size(max_size) {}

  void reset() override {
    KVKind::reset();
    start = length = oldest = 0;
  }

  int64_t first_position() const { return offset - length; }
  bool linear() const { return oldest == 0; }
  int64_t window_tokens(int64_t end) const { return rotating_window_tokens(end, max_size); }
  int64_t column_of(int64_t ring_index) const { return start + (oldest + ring_index) % length; }

  // Copies ring indices [first, first + count) in position order into columns [0, count) of
  // `dst_keys`/`dst_values` (at most two runs: the ring may wrap once).
  void gather(int64_t first, int64_t count, const Array& dst_keys, const Array& dst_values) const {
    int64_t done = 0;
    while (done < count) {
      const int64_t column = column_of(first + done);
      const int64_t run = std::min(count - done, start + length - column);
      dst_keys.assign_slice(2, done, store.keys.slice(2, column, column + run));
      dst_values.assign_slice(2, done, store.values.slice(2, column, column + run));
      done += run;
    }
  }

  // Replaces the buffers by fresh ones of `new_capacity` columns holding the newest `keep`
  // tokens, in position order, from column 0 (lazy windows are copied out first: their columns
  // go away).
  void relinearize(int64_t keep, int64_t new_capacity) {
    auto [new_keys, new_values] = store.layout.allocate_uninitialized(new_capacity);
    if (keep > 0) gather(length - keep, keep, new_keys, new_values);
    store.replace(std::move(new_keys), std::move(new_values));
    store.stats.growth_bytes += keep * store.token_bytes();
    start = 0;
    length = keep;
    oldest = 0;
  }

  // The window ending at `end` (first_position() <= end - window_tokens(end), end <= offset;
  // a wrapped ring only at end == offset), lazy: one run of columns, or two when it wraps around
  // the ring. Null only at offset 0 (the empty state); a window that needs no old token
  // (max_size 1) is a real, empty snapshot: a restore point.
  SnapshotPtr capture_window(int64_t end) {
    if (end == 0) return nullptr;
    const int64_t count = window_tokens(end);
    if (count == 0) {
      auto [k, v] = store.layout.allocate_uninitialized(0);
      return std::make_unique<KVStateSnapshot>(Kind::rotating, store.layout, std::move(k),
                                               std::move(v), end, end, max_size);
    }
    const int64_t first_column = column_of(end - count - first_position());
    const int64_t run = std::min(count, start + length - first_column);
    auto window = store.capture(Kind::rotating, first_column, run, end, end, max_size);
    if (run < count) window->append_run(start, count - run);
    return window;
  }

  // Writes may reach any column of the buffer (a ring wraps; a chunk relinearizes): all that
  // lazy windows name is exposed — but the captures a schedule made and nobody took yet, which
  // are their taker's (cache.h). An upper bound: single-token writes to a full ring never reach
  // columns beyond it that a long chunk left windows in.
  int64_t exposed_bytes() const override {
    int64_t captured = 0;
    schedule.for_each_captured([&](const Snapshot& s) {
      const auto* window = dynamic_cast<const KVStateSnapshot*>(&s);
      if (window != nullptr && window->owner() == &store) captured += window->unbacked_tokens();
    });
    return store.unbacked_bytes(INT64_MIN) - captured * store.token_bytes();
  }

  // Captures are whole windows.
  void capture_reached() override {
    while (schedule.active() && schedule.next() >= 0 && schedule.next() <= offset) {
      schedule.record_or_lose([&] { return capture_window(schedule.next()); });
    }
  }

  // The ring policy: one token into the ring, a chunk into a linearized window.
  void write(const Array& keys, const Array& values) override {
    if (keys.dim(2) == 1) {
      write_one(keys, values);
    } else {
      write_chunk(keys, values);
    }
  }

  void write_one(const Array& k, const Array& v) {
    if (length < max_size && linear()) {  // filling the window: append
      if (start + length >= store.capacity()) {
        // Stepped, geometric growth, never past the window (length < max_size here).
        const int64_t grown = std::max(round_up(length + 1, RotatingKVCache::kStep), 2 * length);
        if (start == 0) {  // columns stay where they are: lazy windows stay lazy
          store.resize(std::min(grown, max_size), length);
        } else {
          relinearize(length, std::min(grown, max_size));
        }
      }
      store.write(start + length, k, v);
      ++length;
    } else if (length == max_size && start == 0) {  // full ring: overwrite the oldest
      store.write(oldest, k, v);
      oldest = (oldest + 1) % max_size;
    } else {  // longer than the window (after a chunk): keep the newest max_size-1, append
      const int64_t keep = max_size - 1;
      if (linear() && store.capacity() >= max_size) {
        const int64_t source = start + length - keep;
        store.preserve(0, keep);
        if (keep > 0 && source != 0) {
          // Shift along the token axis of every head; runs overlap only within a head (memmove).
          store.keys.slice(2, 0, keep).assign(store.keys.slice(2, source, source + keep));
          store.values.slice(2, 0, keep).assign(store.values.slice(2, source, source + keep));
          store.stats.growth_bytes += keep * store.token_bytes();
        }
        start = 0;
        length = keep;
      } else {
        relinearize(keep, round_up(max_size, RotatingKVCache::kStep));
      }
      store.write(keep, k, v);
      length = max_size;
    }
  }

  void write_chunk(const Array& k, const Array& v) {
    const int64_t chunk = k.dim(2);
    const int64_t kept = std::min(length, max_size - 1);
    if (linear() && start + length + chunk <= store.capacity()) {
      // In place: the oldest tokens drop off by moving `start`; nothing old is copied.
      store.write(start + length, k, v);
      start += length - kept;
      length = kept + chunk;
      return;
    }
    const int64_t need = kept + chunk;
    if (linear() && store.capacity() >= need) {
      // Room once the kept tokens move to column 0: the buffer is reused (the verify chunk of
      // every speculation round allocates nothing); lazy windows naming [0, kept) copy out.
      const int64_t source = start + length - kept;
      store.preserve(0, kept);
      if (kept > 0 && source != 0) {
        // Along the token axis of every head; runs overlap only within a head (memmove).
        store.keys.slice(2, 0, kept).assign(store.keys.slice(2, source, source + kept));
        store.values.slice(2, 0, kept).assign(store.values.slice(2, source, source + kept));
        store.stats.growth_bytes += kept * store.token_bytes();
      }
      start = 0;
      length = kept;  // what the columns hold now, should the write below run out
    } else {
      // A buffer with room to grow in place by as much again, at most a window: its size follows
      // the tokens held (a short prompt in a long window takes what it holds). A window still
      // filling from column 0 keeps its columns where they are (lazy windows stay lazy);
      // otherwise the kept tokens move to column 0 of a fresh one.
      const int64_t columns = round_up(need + std::min(need, max_size), RotatingKVCache::kStep);
      if (linear() && start == 0 && kept == length) {
        store.resize(columns, length);
      } else {
        relinearize(kept, columns);
      }
    }
    store.write(kept, k, v);
    length = need;
  }

  // Restores `tokens` tokens of `s` as the whole window, ending at `target`.
  void restore_window(KVStateSnapshot& s, int64_t tokens, int64_t target) {
    const Piece* piece = s.only_piece();
    if (s.owner() == &store && piece != nullptr) {
      // One run of this buffer's columns: write back what was copied out, and the window is
      // those columns again.
      const int64_t owned = std::min(piece->owned, tokens);
      if (owned > 0) {
        store.write(piece->column, piece->keys.slice(2, 0, owned),
                    piece->values.slice(2, 0, owned));
        store.stats.restored_bytes += owned * store.token_bytes();
      }
      start = piece->column;
    } else {
      if (s.owner() == &store) store.materialize(s);  // it is read while the buffer is rewritten
      if (store.capacity() < tokens || store.capacity() == 0) {
        auto [k, v] = store.layout.allocate_uninitialized(
            round_up(std::max<int64_t>(tokens, 1), RotatingKVCache::kStep));
        store.replace(std::move(k), std::move(v));
      }
      // Every lazy window over the columns written is copied out first: the writes then
      // allocate nothing, and one that ran out cannot leave the ring half rewritten.
      store.preserve(0, tokens);
      s.for_each_part(tokens, [&](int64_t first, const Array& k, const Array& v, int64_t) {
        store.write(first, k, v);
        store.stats.restored_bytes += k.dim(2) * store.token_bytes();
      });
      start = 0;
    }
    length = tokens;
    oldest = 0;
    offset = target;
  }

  KVHistory history() const override {
    if (!store.has_layout) return KVHistory();
    if (store.keys.empty()) {
      auto [k, v] = store.layout.allocate(0);
      return KVHistory(std::move(k), std::move(v), offset, 0, max_size);
    }
    return KVHistory(store.keys.slice(2, start, start + length),
                     store.values.slice(2, start, start + length), first_position(), oldest,
                     max_size);
  }

  const int64_t max_size;
  int64_t start = 0, length = 0, oldest = 0;
};

// The snapshot as a window (null stays null); throws Error naming `call` for another kind.
KVStateSnapshot* as_window(Snapshot* snapshot, const char* call) {
  if (snapshot == nullptr) return nullptr;
  return &as_kv_state(snapshot, Kind::rotating, call);
}

// Throws Error naming `call` unless `s` fits `c`: the same window, and the same layout once the
// cache has one.
void check_fits(const RotatingSequence& c, const KVStateSnapshot& s, const char* call) {
  check_one_row(s.layout, call);
  if (s.window == c.max_size && (!c.store.has_layout || s.layout == c.store.layout)) return;
  throw Error(fmt::format(
      "{}: the snapshot (window {}, {}) does not fit this cache (window {}, {}): a window "
      "restores only into a cache of the same window and layout",
      call, s.window, s.layout.describe(), c.max_size,
      c.store.has_layout ? c.store.layout.describe() : "no layout yet"));
}

// The cache: its sequences, each a window of max_size.
class RotatingKVCacheImpl : public KVCacheCore<RotatingSequence> {
 public:
  explicit RotatingKVCacheImpl(int64_t max_size)
      : KVCacheCore("RotatingKVCache",
                    [max_size] { return std::make_unique<RotatingSequence>(max_size); }),
        max_size(max_size) {}
  const int64_t max_size;
};

}  // namespace detail

using detail::Guard;
using detail::KVStateSnapshot;

RotatingKVCache::RotatingKVCache(int64_t max_size) {
  if (max_size < 1 || max_size > detail::kMaxTokens) {
    throw Error(fmt::format(
        "RotatingKVCache: max_size {} must be in [1, 2^60] (no array holds more tokens)",
        max_size));
  }
  impl_ = std::make_unique<detail::RotatingKVCacheImpl>(max_size);
}

// As ~KVCache: outliving snapshots are copied out under the lock they keep.
RotatingKVCache::~RotatingKVCache() { impl_->reset_all(); }

int64_t RotatingKVCache::max_size() const { return impl_->max_size; }

KVHistory RotatingKVCache::update(const Batch& batch, const Array& keys, const Array& values) {
  return impl_->update(batch, keys, values);
}
KVHistory RotatingKVCache::view(const Batch& batch) const { return impl_->view(batch); }

std::vector<Array> RotatingKVCache::state() const { return state(0); }
std::vector<Array> RotatingKVCache::state(SeqId seq) const {
  const Guard guard(impl_->lock);
  const detail::RotatingSequence* sequence = impl_->find(seq);
  if (sequence == nullptr) return {};
  const KVHistory history = sequence->history();
  if (history.keys().empty()) return {};
  return {history.keys(), history.values()};
}

void RotatingKVCache::reset() { impl_->reset_all(); }
void RotatingKVCache::reset(SeqId seq) { impl_->reset(seq); }
int64_t RotatingKVCache::offset() const { return impl_->offset(0); }
int64_t RotatingKVCache::offset(SeqId seq) const { return impl_->offset(seq); }
std::vector<SeqId> RotatingKVCache::sequences() const { return impl_->ids(); }
int64_t RotatingKVCache::exposed_bytes(SeqId seq) const { return impl_->exposed_bytes(seq); }
ScheduleState RotatingKVCache::schedule_state(SeqId seq) const {
  return impl_->schedule_state(seq);
}

SnapshotPtr RotatingKVCache::snapshot(int64_t from_offset) { return snapshot(0, from_offset); }
SnapshotPtr RotatingKVCache::snapshot(SeqId seq, int64_t from_offset) {
  const Guard guard(impl_->lock);
  const detail::RotatingSequence& current = impl_->peek(seq);
  current.check_snapshot_from(from_offset);
  if (current.offset == 0) return nullptr;  // the empty state (all an absent sequence holds)
  detail::RotatingSequence& sequence = impl_->at(seq);
  return sequence.capture_window(sequence.offset);
}

void RotatingKVCache::prepare_snapshots(std::span<const int64_t> offsets) {
  impl_->prepare(0, offsets);
}
void RotatingKVCache::prepare_snapshots(SeqId seq, std::span<const int64_t> offsets) {
  impl_->prepare(seq, offsets);
}
std::vector<SnapshotPtr> RotatingKVCache::take_snapshots() { return impl_->take(0); }
std::vector<SnapshotPtr> RotatingKVCache::take_snapshots(SeqId seq) { return impl_->take(seq); }
void RotatingKVCache::take_snapshots_into(SeqId seq, std::vector<SnapshotPtr>& into) {
  impl_->take_into(seq, into);
}
std::vector<SnapshotPtr> RotatingKVCache::take_reached_snapshots() {
  return impl_->take_reached(0);
}
std::vector<SnapshotPtr> RotatingKVCache::take_reached_snapshots(SeqId seq) {
  return impl_->take_reached(seq);
}
void RotatingKVCache::cancel_snapshots() { impl_->cancel(0); }
void RotatingKVCache::cancel_snapshots(SeqId seq) { impl_->cancel(seq); }

bool RotatingKVCache::restore(Snapshot* snapshot, int64_t target) {
  return restore(0, snapshot, target);
}

bool RotatingKVCache::restore(SeqId seq, Snapshot* snapshot, int64_t target) {
  constexpr const char* call = "RotatingKVCache::restore";
  const detail::SnapshotLocks locks(impl_->lock, snapshot);
  // Checked on what the sequence is now (an empty one when absent); a sequence is created
  // only when the restore gives it tokens.
  const detail::RotatingSequence& current = impl_->peek(seq);
  current.require_idle();
  if (snapshot == nullptr) {
    // Exact only while nothing was evicted: then the window holds every position [0, offset).
    if (current.offset > current.max_size || target < 0 || target > current.offset) return false;
    if (target == current.offset && current.length == target) return true;
    detail::RotatingSequence& c = impl_->at(seq);
    c.length = target;
    c.offset = target;
    return true;
  }
  KVStateSnapshot& s = *detail::as_window(snapshot, call);
  detail::check_fits(current, s, call);
  if (target < 0 || target > s.end || (target < s.end && s.end > current.max_size)) return false;
  if (target == 0 && current.offset == 0) return true;  // empty, and stays so
  impl_->sequences.change(seq, call, [&](detail::RotatingSequence& c) {
    // Clamping below the end keeps positions [0, target): the window then starts at position 0.
    c.with_layout(s.layout,
                  [&] { c.restore_window(s, target < s.end ? target : s.tokens(), target); });
  });
  return true;
}

SnapshotPtr RotatingKVCache::merge(SnapshotPtr parent, SnapshotPtr child) {
  constexpr const char* call = "RotatingKVCache::merge";
  const KVStateSnapshot* first = detail::as_window(parent.get(), call);
  const KVStateSnapshot* second = detail::as_window(child.get(), call);
  for (const KVStateSnapshot* s : {first, second}) {
    if (s != nullptr && s->window != impl_->max_size) {
      throw Error(fmt::format(
          "{}: a snapshot of a window of {} tokens, where this cache's window is {} (a window "
          "merges only snapshots of its own size)",
          call, s->window, impl_->max_size));
    }
  }
  if (first != nullptr && second != nullptr && !(first->layout == second->layout)) {
    throw Error(fmt::format("{}: the snapshots' layouts differ ({} and {})", call,
                            first->layout.describe(), second->layout.describe()));
  }
  return child;
}

std::pair<SnapshotPtr, SnapshotPtr> RotatingKVCache::split(SnapshotPtr snapshot, int64_t) {
  (void)detail::as_window(snapshot.get(), "RotatingKVCache::split");
  return {nullptr, std::move(snapshot)};
}

CopyStats RotatingKVCache::copy_stats() const { return impl_->stats(); }

RestoreRule RotatingKVCache::restore_rule() const {
  return {RestoreRule::Kind::whole_state, impl_->max_size};
}

}  // namespace kvsnap
