// PagedKVCache: sequences as block lists over one pool (block_pool.h).
#include "kvsnap/paged_kv_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "cache/block_pool.h"
#include "cache/cache_access.h"
#include "cache/capture_schedule.h"
#include "cache/kv_kind.h"
#include "cache/kv_store.h"
#include "cache/sequences.h"

namespace kvsnap {
namespace detail {
namespace {

constexpr const char* kUpdate = "PagedKVCache::update";
constexpr const char* kRestore = "PagedKVCache::restore";

}  // namespace

// One sequence: its blocks (blocks.size() == ceil(offset / T)), offset and capture schedule.
class PagedSequence {
 public:
  explicit PagedSequence(std::shared_ptr<BlockPool> pool) : pool_(std::move(pool)) {}
  ~PagedSequence() { rewind(0); }

  void check(const Batch& batch, const Array& keys, const Array& values, int64_t row,
             SeqId seq) const {
    (void)check_update(batch, keys, values, offset, pool_->fixed() ? &pool_->layout : nullptr,
                       kUpdate, row, seq);
  }

  KVHistory update(const Batch& batch, const Array& keys, const Array& values, int64_t row,
                   SeqId seq) {
    const int64_t length = check_update(
        batch, keys, values, offset, pool_->fixed() ? &pool_->layout : nullptr, kUpdate, row, seq);
    // A write of no tokens takes no layout (a reset pool's kept blocks stay).
    if (length > 0)
      with_layout(KVLayout::of(keys, values), [&] {
        write(keys.slice(2, 0, length), values.slice(2, 0, length), kUpdate);
        pool_->stats.appended_bytes += length * pool_->layout.token_bytes();
      });
    capture_reached();
    return history();
  }

  KVHistory history() const {
    if (!pool_->has_layout) return KVHistory();
    return pool_->history(blocks, offset);
  }

  // Runs `fill`, which may take the pool's first blocks, with the pool's layout `layout` (its
  // own, once it has one). When it takes none (it throws first: a chunk too large), it fixes none.
  template <class Fill>
  void with_layout(const KVLayout& layout, Fill&& fill) {
    const bool unset = !pool_->has_layout;
    if (!pool_->fixed()) adopt(layout);
    try {
      fill();
    } catch (...) {
      if (unset) pool_->drop_if_unused();
      throw;
    }
    if (unset) pool_->drop_if_unused();
  }

  // The layout of a pool whose blocks nobody uses (a fresh or reset cache, its snapshots gone):
  // the blocks it kept for reuse go first when they are of another layout.
  void adopt(const KVLayout& layout) {
    if (pool_->has_layout && !(pool_->layout == layout)) pool_->drop_if_unused();
    pool_->layout = layout;
    pool_->has_layout = true;
  }

  // Keeps positions [0, target).
  void rewind(int64_t target) {
    const auto keep = static_cast<size_t>(pool_->blocks_for(target));
    while (blocks.size() > keep) {
      pool_->release(blocks.back());
      blocks.pop_back();
    }
    offset = target;
  }

  // Blocks writing `tokens` tokens at the offset takes from the pool: new ones, and a copy of
  // the tail block when it is partly written and shared.
  int64_t blocks_to_write(int64_t tokens) const {
    if (tokens <= 0) return 0;
    const int64_t fresh = pool_->blocks_for(offset + tokens) - static_cast<int64_t>(blocks.size());
    const bool copy = offset % pool_->block_tokens != 0 && pool_->shared(blocks.back());
    return fresh + (copy ? 1 : 0);
  }
  // Room in `blocks` for writing `tokens` tokens (the pool's blocks: BlockPool::reserve).
  // Grows geometrically: a decode step allocates only every so many blocks.
  void make_room(int64_t tokens) {
    const auto need = static_cast<size_t>(pool_->blocks_for(offset + tokens));
    if (blocks.capacity() < need) blocks.reserve(std::max(need, 2 * blocks.capacity()));
  }

  // Block `index` of the sequence, ready to be written from slot `slot` on: appended when new,
  // copied first when anyone else references it.
  int32_t writable(size_t index, int64_t slot, const char* call) {
    if (index == blocks.size()) {
      const int32_t id = pool_->allocate(call);
      pool_->acquire(id);
      blocks.push_back(id);
      return id;
    }
    const int32_t old = blocks[index];
    if (!pool_->shared(old)) return old;
    const int32_t copy = pool_->allocate(call);
    pool_->copy(old, copy, slot);
    pool_->acquire(copy);
    pool_->release(old);
    blocks[index] = copy;
    pool_->stats.materialized_bytes += slot * pool_->layout.token_bytes();
    ++pool_->blocks_copied;
    return copy;
  }

  // Writes keys/values [1, H, n, *] at the offset, block by block; advances the offset. Takes
  // every block it needs (and room for their references) before writing any: running out of
  // memory leaves the sequence as it was.
  void write(const Array& keys, const Array& values, const char* call) {
    const int64_t n = keys.dim(2), block_tokens = pool_->block_tokens;
    make_room(n);
    pool_->reserve(blocks_to_write(n), call);
    for (int64_t done = 0; done < n;) {
      const int64_t position = offset + done;
      const int64_t slot = position % block_tokens;
      const int64_t run = std::min(block_tokens - slot, n - done);
      const int32_t id = writable(static_cast<size_t>(position / block_tokens), slot, call);
      pool_->keys(id).assign_slice(2, slot, keys.slice(2, done, done + run));
      pool_->values(id).assign_slice(2, slot, values.slice(2, done, done + run));
      pool_->written(id, slot, run);
      done += run;
    }
    offset += n;
  }

  // A write copies the tail block when it is partly written and shared: a snapshot may then
  // pay for the old one. Full blocks are never written.
  int64_t exposed_bytes() const {
    const bool tail = offset % pool_->block_tokens != 0 && pool_->shared(blocks.back());
    return tail && pool_->has_layout ? pool_->block_bytes() : 0;
  }
  // A rewind to `to` lets go of the blocks past it (a snapshot sharing one may be left its only
  // holder) and makes the one it ends in the tail: every shared block from there on counts.
  int64_t exposed_bytes_after_rewind(int64_t to) const {
    if (to >= offset || !pool_->has_layout) return exposed_bytes();
    const auto first = blocks.begin() + std::max<int64_t>(to, 0) / pool_->block_tokens;
    return std::count_if(first, blocks.end(), [&](int32_t b) { return pool_->shared(b); }) *
           pool_->block_bytes();
  }
  // References to the blocks of [from, to) (from < to <= offset).
  std::unique_ptr<PagedSnapshot> capture(int64_t from, int64_t to) const {
    const int64_t first = from / pool_->block_tokens;
    std::vector<int32_t> refs = pool_->take_list();
    refs.assign(blocks.begin() + first, blocks.begin() + pool_->blocks_for(to));
    return std::make_unique<PagedSnapshot>(pool_, std::move(refs), from, to);
  }

  void capture_reached() {
    while (schedule.active() && schedule.next() >= 0 && schedule.next() <= offset) {
      const int64_t start = schedule.edge_start(), end = schedule.next();
      schedule.record(start == end ? nullptr : capture(start, end));
    }
  }

  // Restores [s.from(), target) of this pool's snapshot: block references spliced in, and the
  // block where the sequence and the snapshot meet mid-block as BlockPool::meet gives it (the
  // snapshot's own when its first tokens are ours, else a fresh join).
  void splice(const PagedSnapshot& s, int64_t target) {
    const int64_t block_tokens = pool_->block_tokens, from = s.from();
    // Room for the references first: acquiring a block and then failing to list it would keep
    // it forever.
    blocks.reserve(static_cast<size_t>(pool_->blocks_for(target)));
    if (from % block_tokens != 0) pool_->reserve(1, kRestore);  // a join meet() may make, first
    rewind(from);
    size_t next = 0;  // the snapshot's next block to splice
    const int64_t slot = from % block_tokens;
    if (slot != 0) {
      const int64_t end = std::min(block_tokens, target - (from - slot));
      const int32_t met = pool_->meet(blocks.back(), s.blocks()[0], slot, end, kRestore);
      // A join copies the block's first `end` tokens (ours, then the snapshot's).
      if (met != s.blocks()[0]) pool_->stats.restored_bytes += end * pool_->layout.token_bytes();
      if (met != blocks.back()) {
        pool_->acquire(met);
        pool_->release(blocks.back());
        blocks.back() = met;
      }
      next = 1;
    }
    const auto needed = static_cast<size_t>(pool_->blocks_for(target));
    for (; blocks.size() < needed; ++next) {
      pool_->acquire(s.blocks()[next]);
      blocks.push_back(s.blocks()[next]);
    }
    offset = target;
  }

  // Restores [from, target) of a snapshot held elsewhere (a KVCache's, another pool's) by
  // writing its tokens. The caller holds the snapshot's lock with ours (SnapshotLocks).
  void copy_in(const Snapshot& s, int64_t target) {
    // Every block the parts need and a shared tail's copy, taken before the rewind (as splice
    // does): running out, or past the pool's limit, leaves the sequence as it was, and no write
    // runs out midway, leaving it part restored.
    const int64_t need = pool_->blocks_for(target), kept = pool_->blocks_for(s.from());
    // Blocks the rewind frees (past `from`, held by no one else) count; a shared tail, one more.
    const auto freed = std::count_if(blocks.begin() + kept, blocks.end(),
                                     [&](int32_t b) { return !pool_->shared(b); });
    const bool tail = s.from() % pool_->block_tokens != 0 && pool_->shared(blocks[kept - 1]);
    blocks.reserve(static_cast<size_t>(need));
    pool_->reserve(need - kept + (tail ? 1 : 0) - freed, kRestore);
    rewind(s.from());
    const auto write_part = [&](const Array& k, const Array& v) {
      write(k, v, kRestore);
      pool_->stats.restored_bytes += k.dim(2) * pool_->layout.token_bytes();
    };
    if (const auto* paged = dynamic_cast<const PagedSnapshot*>(&s)) {
      paged->for_each_part(target - s.from(),
                           [&](int64_t, const Array& k, const Array& v) { write_part(k, v); });
      return;
    }
    const auto& state = dynamic_cast<const KVStateSnapshot&>(s);
    state.for_each_part(target - s.from(), [&](int64_t, const Array& k, const Array& v, int64_t) {
      write_part(k, v);
    });
  }

  std::vector<int32_t> blocks;
  int64_t offset = 0;
  CaptureSchedule schedule;

 private:
  std::shared_ptr<BlockPool> pool_;
};

class PagedKVCacheImpl {
 public:
  explicit PagedKVCacheImpl(const PagedKVCache::Options& options)
      : pool(std::make_shared<BlockPool>(options.block_tokens, options.blocks_per_chunk)),
        sequences([this] { return std::make_unique<PagedSequence>(pool); }) {}

  std::shared_ptr<BlockPool> pool;  // before `sequences`: they release their blocks into it
  Sequences<PagedSequence> sequences;
  RowsScratch scratch;  // update_rows' and view_rows', under the pool's lock
};

// The layout a KV snapshot (of this kind or KVCache's) needs its cache to have.
KVLayout layout_of(const Snapshot& s) {
  if (const auto* paged = dynamic_cast<const PagedSnapshot*>(&s)) return paged->pool()->layout;
  return dynamic_cast<const KVStateSnapshot&>(s).layout;
}

// Throws Error naming `call` unless `s` is a KV range (this kind's or KVCache's).
void require_kv(const Snapshot* s, const char* call) {
  const auto* state = dynamic_cast<const StateSnapshot*>(s);
  if (state == nullptr || state->kind() != SnapshotRecord::Kind::kv) {
    throw Error(
        fmt::format("{}: the snapshot is not a PagedKVCache or KVCache snapshot "
                    "(snapshots restore only into a cache of their own kind)",
                    call));
  }
}

}  // namespace detail

using detail::Guard;
using detail::PagedSnapshot;

PagedKVCache::PagedKVCache() : PagedKVCache(Options{}) {}

PagedKVCache::PagedKVCache(Options options) {
  if (options.block_tokens < 1 || options.blocks_per_chunk < 1) {
    throw Error(fmt::format("PagedKVCache: block_tokens {} and blocks_per_chunk {} must be >= 1",
                            options.block_tokens, options.blocks_per_chunk));
  }
  // A chunk of the pool is one array of blocks_per_chunk * block_tokens tokens; blocks are
  // numbered by int32.
  int64_t chunk_tokens = 0;
  if (options.blocks_per_chunk > detail::BlockPool::kMaxBlocks ||
      __builtin_mul_overflow(options.block_tokens, options.blocks_per_chunk, &chunk_tokens) ||
      chunk_tokens > detail::kMaxTokens) {
    throw Error(fmt::format(
        "PagedKVCache: block_tokens {} times blocks_per_chunk {} must be at most 2^60 tokens (a "
        "chunk of the pool is one array, and no array holds more), with blocks_per_chunk at "
        "most 2^31 - 1 (block ids are int32)",
        options.block_tokens, options.blocks_per_chunk));
  }
  impl_ = std::make_unique<detail::PagedKVCacheImpl>(options);
}

PagedKVCache::~PagedKVCache() {
  const Guard guard(impl_->pool->lock);
  impl_->sequences.for_each([](SeqId, detail::PagedSequence& s) { s.rewind(0); });
}

int64_t PagedKVCache::block_tokens() const { return impl_->pool->block_tokens; }

PagedKVCache::PoolStats PagedKVCache::pool_stats() const {
  const Guard guard(impl_->pool->lock);
  const detail::BlockPool& pool = *impl_->pool;
  const int64_t block_bytes = pool.has_layout ? pool.block_bytes() : 0;
  return {pool.blocks(),      pool.blocks_in_use(), pool.blocks_in_use() * block_bytes,
          pool.blocks_copied, pool.live_blocks(),   pool.live_blocks() * block_bytes};
}

KVHistory PagedKVCache::update(const Batch& batch, const Array& keys, const Array& values) {
  const Guard guard(impl_->pool->lock);
  // Before any row is written, the pool holds every block the rows will take, and every
  // sequence room for their references (a sequence not yet created is staged; the cache's first
  // write takes the batch's layout, given back when nothing was allocated): running out of
  // memory leaves every row unwritten.
  struct Room {
    detail::Sequences<detail::PagedSequence>& sequences;
    detail::BlockPool& pool;
    int64_t blocks = 0;
    bool unset = false;  // the pool had none: the batch's layout goes again (kept blocks stay)

    void make(SeqId id, int64_t tokens, const Array& keys, const Array& values) {
      detail::PagedSequence* sequence = sequences.find(id);
      if (sequence == nullptr) sequence = &sequences.stage(id, detail::kUpdate);
      if (tokens > 0 && !pool.fixed()) {
        unset = unset || !pool.has_layout;
        sequence->adopt(detail::KVLayout::of_row(keys, values));
      }
      if (!pool.has_layout) return;
      sequence->make_room(tokens);
      blocks += sequence->blocks_to_write(tokens);
      pool.reserve(blocks, detail::kUpdate);
    }
    void undo() noexcept {
      if (unset) pool.drop_if_unused();
    }
  } room{impl_->sequences, *impl_->pool};
  return detail::update_rows(batch, keys, values, detail::kUpdate, impl_->sequences, room,
                             impl_->scratch);
}

KVHistory PagedKVCache::view(const Batch& batch) const {
  const Guard guard(impl_->pool->lock);
  return detail::view_rows(batch, "PagedKVCache::view", impl_->scratch, [&](SeqId id) {
    const detail::PagedSequence* sequence = impl_->sequences.find(id, "PagedKVCache::view");
    return sequence == nullptr ? KVHistory() : sequence->history();
  });
}

std::vector<Array> PagedKVCache::state() const { return state(0); }
std::vector<Array> PagedKVCache::state(SeqId seq) const {
  const Guard guard(impl_->pool->lock);
  const detail::PagedSequence* sequence = impl_->sequences.find(seq, "PagedKVCache::state");
  if (sequence == nullptr || sequence->blocks.empty()) return {};
  const KVHistory contiguous = sequence->history().contiguous();
  return {contiguous.keys(), contiguous.values()};
}

// The pool keeps its blocks for the next writes (another layout replaces them:
// PagedSequence::adopt).
void PagedKVCache::reset() {
  const Guard guard(impl_->pool->lock);
  impl_->sequences.for_each([](SeqId, detail::PagedSequence& s) {
    s.schedule.clear();
    s.rewind(0);
  });
}
void PagedKVCache::reset(SeqId seq) {
  const Guard guard(impl_->pool->lock);
  if (detail::PagedSequence* s = impl_->sequences.find(seq, "PagedKVCache::reset")) {
    s->schedule.clear();
    s->rewind(0);
  }
}

int64_t PagedKVCache::offset() const { return offset(0); }
int64_t PagedKVCache::offset(SeqId seq) const {
  const Guard guard(impl_->pool->lock);
  const detail::PagedSequence* sequence = impl_->sequences.find(seq, "PagedKVCache::offset");
  return sequence == nullptr ? 0 : sequence->offset;
}

int64_t PagedKVCache::exposed_bytes(SeqId seq) const {
  const Guard guard(impl_->pool->lock);
  const detail::PagedSequence* sequence = impl_->sequences.find(seq, "PagedKVCache::exposed_bytes");
  return sequence == nullptr ? 0 : sequence->exposed_bytes();
}

int64_t PagedKVCache::exposed_bytes_after_rewind(SeqId seq, int64_t offset) const {
  const Guard guard(impl_->pool->lock);
  const auto* sequence = impl_->sequences.find(seq, "PagedKVCache::exposed_bytes_after_rewind");
  return sequence == nullptr ? 0 : sequence->exposed_bytes_after_rewind(offset);
}

ScheduleState PagedKVCache::schedule_state(SeqId seq) const {
  const Guard guard(impl_->pool->lock);
  const detail::PagedSequence* sequence =
      impl_->sequences.find(seq, "PagedKVCache::schedule_state");
  return sequence == nullptr ? ScheduleState{} : sequence->schedule.state();
}

std::vector<SeqId> PagedKVCache::sequences() const {
  const Guard guard(impl_->pool->lock);
  std::vector<SeqId> ids;
  impl_->sequences.for_each([&](SeqId id, const detail::PagedSequence&) { ids.push_back(id); });
  return ids;
}

SnapshotPtr PagedKVCache::snapshot(int64_t from_offset) { return snapshot(0, from_offset); }
SnapshotPtr PagedKVCache::snapshot(SeqId seq, int64_t from_offset) {
  const Guard guard(impl_->pool->lock);
  const detail::PagedSequence& sequence = impl_->sequences.peek(seq, "PagedKVCache::snapshot");
  if (from_offset < 0 || from_offset > sequence.offset) {
    throw Error(fmt::format(
        "PagedKVCache::snapshot: from_offset {} out of range [0, {}] (the cache offset)",
        from_offset, sequence.offset));
  }
  if (from_offset == sequence.offset) return nullptr;  // all an absent sequence can give
  return sequence.capture(from_offset, sequence.offset);
}

void PagedKVCache::prepare_snapshots(std::span<const int64_t> offsets) {
  prepare_snapshots(0, offsets);
}
void PagedKVCache::prepare_snapshots(SeqId seq, std::span<const int64_t> offsets) {
  constexpr const char* call = "PagedKVCache::prepare_snapshots";
  const Guard guard(impl_->pool->lock);
  const detail::PagedSequence& current = impl_->sequences.peek(seq, call);
  current.schedule.check(offsets, current.offset, call);
  if (offsets.empty()) return;  // schedules nothing: no sequence is made for it
  impl_->sequences.change(seq, call, [&](detail::PagedSequence& sequence) {
    sequence.schedule.prepare(offsets, sequence.offset, call, [&] { sequence.capture_reached(); });
  });
}
std::vector<SnapshotPtr> PagedKVCache::take_snapshots() { return take_snapshots(0); }
std::vector<SnapshotPtr> PagedKVCache::take_snapshots(SeqId seq) {
  const Guard guard(impl_->pool->lock);
  detail::PagedSequence* sequence = impl_->sequences.find(seq, "PagedKVCache::take_snapshots");
  if (sequence == nullptr) return {};
  return sequence->schedule.take(sequence->offset, "PagedKVCache::take_snapshots");
}
void PagedKVCache::take_snapshots_into(SeqId seq, std::vector<SnapshotPtr>& into) {
  into.clear();  // first, outside the lock (detail::KVCacheCore::take_into)
  const Guard guard(impl_->pool->lock);
  detail::PagedSequence* sequence = impl_->sequences.find(seq, "PagedKVCache::take_snapshots");
  if (sequence == nullptr) {
    into.clear();
    return;
  }
  sequence->schedule.take_into(into, sequence->offset, "PagedKVCache::take_snapshots");
}
std::vector<SnapshotPtr> PagedKVCache::take_reached_snapshots() {
  return take_reached_snapshots(0);
}
std::vector<SnapshotPtr> PagedKVCache::take_reached_snapshots(SeqId seq) {
  const Guard guard(impl_->pool->lock);
  detail::PagedSequence* sequence =
      impl_->sequences.find(seq, "PagedKVCache::take_reached_snapshots");
  if (sequence == nullptr) return {};
  return sequence->schedule.take_reached();
}
void PagedKVCache::cancel_snapshots() { cancel_snapshots(0); }
void PagedKVCache::cancel_snapshots(SeqId seq) {
  const Guard guard(impl_->pool->lock);
  if (auto* sequence = impl_->sequences.find(seq, "PagedKVCache::cancel_snapshots")) {
    sequence->schedule.clear();
  }
}

bool PagedKVCache::restore(Snapshot* snapshot, int64_t target) {
  return restore(0, snapshot, target);
}

bool PagedKVCache::restore(SeqId seq, Snapshot* snapshot, int64_t target) {
  const detail::SnapshotLocks locks(impl_->pool->lock, snapshot);
  // Checked on what the sequence is now (an empty one when absent); a sequence is created
  // only when the restore gives it tokens.
  const detail::PagedSequence& current = impl_->sequences.peek(seq, detail::kRestore);
  current.schedule.require_idle(detail::kRestore);
  if (snapshot == nullptr) {
    if (target < 0 || target > current.offset) return false;
    if (target != current.offset) impl_->sequences.at(seq, detail::kRestore).rewind(target);
    return true;
  }
  detail::require_kv(snapshot, detail::kRestore);
  const detail::KVLayout layout = detail::layout_of(*snapshot);
  detail::check_one_row(layout, detail::kRestore);
  if (impl_->pool->fixed()) {
    detail::check_same_layout(impl_->pool->layout, layout, detail::kRestore);
  }
  if (target < 0 || target > snapshot->to() || current.offset < snapshot->from()) return false;
  if (target <= snapshot->from()) {
    if (target != current.offset) impl_->sequences.at(seq, detail::kRestore).rewind(target);
    return true;
  }
  impl_->sequences.change(seq, detail::kRestore, [&](detail::PagedSequence& c) {
    c.with_layout(layout, [&] {
      const auto* paged = dynamic_cast<const PagedSnapshot*>(snapshot);
      if (paged != nullptr && paged->pool() == impl_->pool) {
        c.splice(*paged, target);
      } else {
        c.copy_in(*snapshot, target);
      }
    });
  });
  return true;
}

SnapshotPtr PagedKVCache::merge(SnapshotPtr parent, SnapshotPtr child) {
  if (parent == nullptr || child == nullptr) return nullptr;
  const detail::SnapshotLocks locks(impl_->pool->lock, parent.get(), child.get());
  detail::require_kv(parent.get(), "PagedKVCache::merge");
  detail::require_kv(child.get(), "PagedKVCache::merge");
  if (parent->to() != child->from()) {
    throw Error(fmt::format(
        "PagedKVCache::merge: parent [{}, {}) and child [{}, {}) are not adjacent (parent must "
        "end where child begins)",
        parent->from(), parent->to(), child->from(), child->to()));
  }
  const auto* a = dynamic_cast<const PagedSnapshot*>(parent.get());
  const auto* b = dynamic_cast<const PagedSnapshot*>(child.get());
  if (a == nullptr || b == nullptr || a->pool() != impl_->pool || b->pool() != impl_->pool) {
    // Not both of this pool: joined as owned token arrays, counted as copied.
    return detail::join_kv_snapshots(*parent, *child, "PagedKVCache::merge",
                                     impl_->pool->stats.snapshot_bytes);
  }
  // Block lists joined; where they meet mid-block, the block BlockPool::meet gives (a fresh one
  // goes back to the pool if the joined snapshot cannot be made).
  std::vector<int32_t> blocks;
  blocks.reserve(a->blocks().size() + b->blocks().size());
  blocks.insert(blocks.end(), a->blocks().begin(), a->blocks().end());
  detail::BlockPool& pool = *impl_->pool;
  const int64_t block_tokens = pool.block_tokens, slot = b->from() % block_tokens;
  size_t skip = 0;
  std::optional<int32_t> fresh;
  if (slot != 0) {
    skip = 1;
    const int64_t end = std::min(block_tokens, b->to() - (b->from() - slot));
    const int32_t met = pool.meet(blocks.back(), b->blocks()[0], slot, end, "PagedKVCache::merge");
    if (met != b->blocks()[0]) pool.stats.snapshot_bytes += end * pool.layout.token_bytes();
    if (met != b->blocks()[0] && met != blocks.back()) fresh = met;
    blocks.back() = met;
  }
  blocks.insert(blocks.end(), b->blocks().begin() + static_cast<std::ptrdiff_t>(skip),
                b->blocks().end());
  try {
    return std::make_unique<PagedSnapshot>(impl_->pool, std::move(blocks), a->from(), b->to());
  } catch (...) {
    if (fresh) pool.give_back(*fresh);
    throw;
  }
}

std::pair<SnapshotPtr, SnapshotPtr> PagedKVCache::split(SnapshotPtr snapshot, int64_t at) {
  if (snapshot == nullptr) return {nullptr, nullptr};
  const detail::SnapshotLocks locks(impl_->pool->lock, snapshot.get());
  detail::require_kv(snapshot.get(), "PagedKVCache::split");
  detail::check_split_at(*snapshot, at, "PagedKVCache::split");
  if (at <= snapshot->from()) return {nullptr, std::move(snapshot)};
  if (at >= snapshot->to()) return {std::move(snapshot), nullptr};
  const auto* s = dynamic_cast<const PagedSnapshot*>(snapshot.get());
  if (s == nullptr) {  // a KVCache snapshot: split as KVCache does
    auto& state = dynamic_cast<detail::KVStateSnapshot&>(*snapshot);
    CopyStats copies;
    SnapshotPtr after = state.split_off(at, copies);
    impl_->pool->stats.snapshot_bytes += copies.snapshot_bytes;
    return {std::move(snapshot), std::move(after)};
  }
  const int64_t block_tokens = s->pool()->block_tokens;
  const auto& blocks = s->blocks();
  const auto cut_before =
      static_cast<size_t>((at + block_tokens - 1) / block_tokens - s->first_block());
  const auto cut_after = static_cast<size_t>(at / block_tokens - s->first_block());
  auto before = std::make_unique<PagedSnapshot>(
      s->pool(), std::vector<int32_t>(blocks.begin(), blocks.begin() + cut_before), s->from(), at);
  auto after = std::make_unique<PagedSnapshot>(
      s->pool(), std::vector<int32_t>(blocks.begin() + cut_after, blocks.end()), at, s->to());
  snapshot.reset();
  return {std::move(before), std::move(after)};
}

CopyStats PagedKVCache::copy_stats() const {
  const Guard guard(impl_->pool->lock);
  return impl_->pool->stats;
}

RestoreRule PagedKVCache::restore_rule() const { return {RestoreRule::Kind::ranges, 0}; }

namespace detail {

std::recursive_mutex& PagedCacheAccess::lock(const PagedKVCache& cache) {
  return cache.impl_->pool->lock;
}

}  // namespace detail

}  // namespace kvsnap
