// KVCache: the append policy over the KV core. Column c of the store holds position c.
#include "kvsnap/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "cache/block_pool.h"
#include "cache/kv_kind.h"
#include "cache/sequences.h"

namespace kvsnap {
namespace detail {

using Kind = SnapshotRecord::Kind;

// One sequence: the append policy over the KV core.
class KVSequence final : public KVKind {
 public:
  explicit KVSequence(const int64_t& reserved) : KVKind("KVCache"), reserved(reserved) {}

  // Grows to hold `tokens` columns, keeping every column still named by the offset or a lazy
  // snapshot in place. Geometric growth keeps the bytes moved by a long prefill linear in its
  // length.
  void ensure_capacity(int64_t tokens) {
    const int64_t current = store.capacity();
    if (tokens <= current) return;
    const int64_t wanted = std::max({tokens, 2 * current, reserved});
    store.resize(round_up(wanted, KVCache::kStep), std::max(offset, store.lazy_end()));
  }

  // Room for `tokens` more tokens, and the lazy columns they overwrite copied out: the write
  // then allocates no storage. Nothing before the first write (no layout yet).
  void make_room(int64_t tokens) override {
    if (!store.has_layout || tokens <= 0) return;
    ensure_capacity(offset + tokens);
    store.preserve(offset, offset + tokens);
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

  // Writes land at the offset and beyond: only what lazy snapshots name there is exposed.
  int64_t exposed_bytes() const override { return store.unbacked_bytes(offset); }
  // A rewind moves nothing: the columns past it stay where the snapshots name them, until
  // written.
  int64_t exposed_bytes_after_rewind(int64_t to) const override {
    return store.unbacked_bytes(std::clamp<int64_t>(to, 0, offset));
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
  // What the parts overwrite is copied out of other snapshots first, all of it: the writes then
  // allocate nothing, and one that ran out cannot leave a part written over the history and
  // the rest as it was.
  void write_back(const KVStateSnapshot& s, int64_t target) {
    ensure_capacity(target);
    const auto moved = [&](int64_t position, int64_t lazy_column) {
      return !(s.owner() == &store && lazy_column == position);  // else in place
    };
    std::vector<std::pair<int64_t, int64_t>> ranges;
    s.for_each_part(target - s.begin,
                    [&](int64_t first, const Array& k, const Array&, int64_t lazy_column) {
                      const int64_t position = s.begin + first;
                      if (moved(position, lazy_column))
                        ranges.emplace_back(position, position + k.dim(2));
                    });
    for (const auto& [from, to] : ranges) store.preserve(from, to);
    s.for_each_part(target - s.begin,
                    [&](int64_t first, const Array& k, const Array& v, int64_t lazy_column) {
                      const int64_t position = s.begin + first;
                      if (!moved(position, lazy_column)) return;
                      store.write(position, k, v);
                      store.stats.restored_bytes += k.dim(2) * store.token_bytes();
                    });
  }

  // Restores [s.from(), target) of a PagedKVCache snapshot by writing its blocks' tokens (the
  // caller holds its pool's lock with ours: SnapshotLocks).
  bool restore_paged(const PagedSnapshot& s, int64_t target) {
    const char* call = calls().restore.c_str();
    if (store.has_layout) check_same_layout(store.layout, s.pool()->layout, call);
    if (target < 0 || target > s.to() || offset < s.from()) return false;
    if (target > s.from()) {
      with_layout(s.pool()->layout, [&] {
        ensure_capacity(target);
        store.preserve(s.from(), target);  // as write_back: the writes then allocate nothing
      });
      s.for_each_part(target - s.from(), [&](int64_t first, const Array& k, const Array& v) {
        store.write(s.from() + first, k, v);
        store.stats.restored_bytes += k.dim(2) * store.token_bytes();
      });
    }
    offset = target;
    return true;
  }

  const int64_t& reserved;  // the cache's reserve(), for every sequence
};

// The cache: its sequences (KVCacheCore) and the reserve every sequence grows to at once.
class KVCacheImpl : public KVCacheCore<KVSequence> {
 public:
  KVCacheImpl()
      : KVCacheCore("KVCache", [this] { return std::make_unique<KVSequence>(reserved); }) {}
  int64_t reserved = 0;
};

}  // namespace detail

using detail::Guard;
using detail::Kind;
using detail::KVStateSnapshot;

KVCache::KVCache() : impl_(std::make_unique<detail::KVCacheImpl>()) {}
// Snapshots that outlive the cache are copied out under its lock, which they keep: another
// thread reading one meanwhile sees it lazy or owned, never half-copied. Out of memory, they
// keep the buffers instead (KVStore::let_go): a destructor must not throw.
KVCache::~KVCache() { impl_->reset_all(); }

void KVCache::reserve(int64_t tokens) {
  // Positions are int32 (Batch): room past them could never be written, and growth rounding
  // it up would overflow.
  constexpr int64_t kMost = std::numeric_limits<int32_t>::max();
  if (tokens < 0 || tokens > kMost) {
    throw Error(fmt::format("KVCache::reserve: tokens {} must be in [0, {}]", tokens, kMost));
  }
  const Guard guard(impl_->lock);
  // Every sequence grows before the reservation is raised: when growing one throws
  // (std::bad_alloc), later sequences' first updates do not retry the failed size.
  impl_->sequences.for_each([&](SeqId, detail::KVSequence& sequence) {
    if (sequence.store.has_layout) sequence.ensure_capacity(tokens);
  });
  impl_->reserved = std::max(impl_->reserved, tokens);
}

int64_t KVCache::capacity() const {
  const Guard guard(impl_->lock);
  const detail::KVSequence* sequence = impl_->find(0);
  return sequence == nullptr ? 0 : sequence->store.capacity();
}

int64_t KVCache::lazy_bytes(int64_t from, int64_t to) const { return lazy_bytes(0, from, to); }

int64_t KVCache::lazy_bytes(SeqId seq, int64_t from, int64_t to) const {
  const Guard guard(impl_->lock);
  const detail::KVSequence* sequence = impl_->find(seq);
  return sequence == nullptr || !sequence->store.has_layout ? 0
                                                            : sequence->store.lazy_bytes(from, to);
}

KVHistory KVCache::update(const Batch& batch, const Array& keys, const Array& values) {
  return impl_->update(batch, keys, values);
}
KVHistory KVCache::view(const Batch& batch) const { return impl_->view(batch); }

std::vector<Array> KVCache::state() const { return state(0); }

std::vector<Array> KVCache::state(SeqId seq) const {
  const Guard guard(impl_->lock);
  const detail::KVSequence* sequence = impl_->find(seq);
  if (sequence == nullptr || sequence->store.keys.empty()) return {};
  return {sequence->store.keys.slice(2, 0, sequence->offset),
          sequence->store.values.slice(2, 0, sequence->offset)};
}

void KVCache::reset() { impl_->reset_all(); }
void KVCache::reset(SeqId seq) { impl_->reset(seq); }
int64_t KVCache::offset() const { return impl_->offset(0); }
int64_t KVCache::offset(SeqId seq) const { return impl_->offset(seq); }
std::vector<SeqId> KVCache::sequences() const { return impl_->ids(); }
int64_t KVCache::exposed_bytes(SeqId seq) const { return impl_->exposed_bytes(seq); }
int64_t KVCache::exposed_bytes_after_rewind(SeqId seq, int64_t offset) const {
  return impl_->exposed_bytes_after_rewind(seq, offset);
}
ScheduleState KVCache::schedule_state(SeqId seq) const { return impl_->schedule_state(seq); }

SnapshotPtr KVCache::snapshot(int64_t from_offset) { return snapshot(0, from_offset); }

SnapshotPtr KVCache::snapshot(SeqId seq, int64_t from_offset) {
  const Guard guard(impl_->lock);
  const detail::KVSequence& current = impl_->peek(seq);
  current.check_snapshot_from(from_offset);
  if (from_offset == current.offset) return nullptr;  // all an absent sequence can give
  detail::KVSequence& sequence = impl_->at(seq);
  return sequence.lazy_snapshot(from_offset, sequence.offset);
}

void KVCache::prepare_snapshots(std::span<const int64_t> offsets) { impl_->prepare(0, offsets); }
void KVCache::prepare_snapshots(SeqId seq, std::span<const int64_t> offsets) {
  impl_->prepare(seq, offsets);
}
std::vector<SnapshotPtr> KVCache::take_snapshots() { return impl_->take(0); }
std::vector<SnapshotPtr> KVCache::take_snapshots(SeqId seq) { return impl_->take(seq); }
void KVCache::take_snapshots_into(SeqId seq, std::vector<SnapshotPtr>& into) {
  impl_->take_into(seq, into);
}
std::vector<SnapshotPtr> KVCache::take_reached_snapshots() { return impl_->take_reached(0); }
std::vector<SnapshotPtr> KVCache::take_reached_snapshots(SeqId seq) {
  return impl_->take_reached(seq);
}
void KVCache::cancel_snapshots() { impl_->cancel(0); }
void KVCache::cancel_snapshots(SeqId seq) { impl_->cancel(seq); }

bool KVCache::restore(Snapshot* snapshot, int64_t target) { return restore(0, snapshot, target); }

bool KVCache::restore(SeqId seq, Snapshot* snapshot, int64_t target) {
  const detail::SnapshotLocks locks(impl_->lock, snapshot);
  // Checked on what the sequence is now (an empty one when absent); a sequence is created
  // only when the restore writes tokens into it.
  const detail::KVSequence& current = impl_->peek(seq);
  current.require_idle();
  if (snapshot == nullptr) {
    if (target < 0 || target > current.offset) return false;
    if (target != current.offset) impl_->at(seq).offset = target;
    return true;
  }
  const char* call = current.calls().restore.c_str();
  if (auto* paged = dynamic_cast<detail::PagedSnapshot*>(snapshot)) {
    if (current.store.has_layout)
      detail::check_same_layout(current.store.layout, paged->pool()->layout, call);
    if (target < 0 || target > paged->to() || current.offset < paged->from()) return false;
    if (target == current.offset && target <= paged->from()) return true;
    return impl_->sequences.change(seq, call, [&](detail::KVSequence& c) {
      return c.restore_paged(*paged, target);  // a PagedKVCache's blocks: copied in
    });
  }
  KVStateSnapshot& s = detail::as_kv_state(snapshot, Kind::kv, call);
  detail::check_one_row(s.layout, call);
  if (current.store.has_layout) detail::check_same_layout(current.store.layout, s.layout, call);
  if (target < 0 || target > s.end || current.offset < s.begin) return false;
  if (target == current.offset && target <= s.begin) return true;  // nothing to write or move
  impl_->sequences.change(seq, call, [&](detail::KVSequence& c) {
    if (target > s.begin) {
      // Nothing for this sequence's own lazy snapshot: an offset move.
      c.with_layout(s.layout, [&] { c.write_back(s, target); });
    }
    c.offset = target;
  });
  return true;
}

SnapshotPtr KVCache::merge(SnapshotPtr parent, SnapshotPtr child) {
  if (parent == nullptr || child == nullptr) return nullptr;
  const detail::SnapshotLocks locks(impl_->lock, parent.get(), child.get());
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
  const detail::SnapshotLocks locks(impl_->lock, snapshot.get());
  KVStateSnapshot& s = detail::as_kv_state(snapshot.get(), Kind::kv, "KVCache::split");
  detail::check_split_at(s, at, "KVCache::split");
  if (at <= s.begin) return {nullptr, std::move(snapshot)};
  if (at >= s.end) return {std::move(snapshot), nullptr};
  SnapshotPtr after = s.split_off(at, impl_->unattributed);
  return {std::move(snapshot), std::move(after)};
}

CopyStats KVCache::copy_stats() const { return impl_->stats(); }

RestoreRule KVCache::restore_rule() const { return {RestoreRule::Kind::ranges, 0}; }

}  // namespace kvsnap
