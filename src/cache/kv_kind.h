// Internal: what KVCache and RotatingKVCache share above the KV core — the offset, the capture
// schedule and the skeleton of their calls (checks, padding, accounting) — so a kind supplies only
// its policy: how a write lands in the store, what a capture holds, what its history is.
#pragma once

#include <fmt/format.h>

#include <array>
#include <span>
#include <string>
#include <vector>

#include "attention/recycler.h"
#include "attention/row_batch.h"
#include "cache/capture_schedule.h"
#include "cache/kv_store.h"
#include "cache/sequences.h"

namespace kvsnap::detail {

class KVKind {
 public:
  // `name` ("KVCache") prefixes every error message.
  explicit KVKind(const char* name);
  virtual ~KVKind() = default;
  KVKind(const KVKind&) = delete;
  KVKind& operator=(const KVKind&) = delete;

  // Checks the one-row batch and arrays, writes the real tokens through the kind's policy,
  // advances the offset, captures what the schedule reached and returns the history. `row` and
  // `seq`: what errors call the row (its index in the caller's batch) and its sequence.
  KVHistory update(const Batch& batch, const Array& keys, const Array& values, int64_t row = 0,
                   SeqId seq = 0);
  // Throws Error unless update(batch, keys, values, row, seq) would be accepted; changes nothing.
  void check(const Batch& batch, const Array& keys, const Array& values, int64_t row = 0,
             SeqId seq = 0) const;
  // Before a multi-row update writes any row: allocates what writing `tokens` tokens at the
  // offset will need (room in the buffers, lazy snapshots' copies of the columns it overwrites),
  // so running out of memory there leaves every row unwritten. Changes no tokens or offsets.
  virtual void make_room(int64_t tokens) { (void)tokens; }
  // Throws Error unless 0 <= from_offset <= offset.
  void check_snapshot_from(int64_t from_offset) const;
  void prepare(std::span<const int64_t> offsets);
  std::vector<SnapshotPtr> take();
  void take_into(std::vector<SnapshotPtr>& into);
  std::vector<SnapshotPtr> take_reached() { return schedule.take_reached(); }
  void cancel() { schedule.clear(); }
  // Drops the state (handing lazy snapshots what they name: KVStore::let_go) and the schedule.
  // Never throws.
  virtual void reset() {
    schedule.clear();
    store.clear();
    offset = 0;
  }
  // Throws Error naming "<name>::restore" while captures are scheduled.
  void require_idle() const { schedule.require_idle(calls_.restore.c_str()); }
  // Runs `fill` with `layout` taken when the sequence has none yet; a fill that throws (out of
  // memory) leaves none taken: a reset sequence takes any layout.
  template <class Fill>
  void with_layout(const KVLayout& layout, Fill&& fill) {
    const bool adopted = !store.has_layout;
    if (adopted) store.adopt_layout(layout);
    try {
      fill();
    } catch (...) {
      if (adopted) store.clear();
      throw;
    }
  }

  virtual KVHistory history() const = 0;
  // Cache::exposed_bytes of this sequence, and Cache::exposed_bytes_after_rewind.
  virtual int64_t exposed_bytes() const = 0;
  virtual int64_t exposed_bytes_after_rewind(int64_t) const { return exposed_bytes(); }

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

// What update_rows and view_rows keep between the calls of one cache (under its lock), so that a
// step of several rows allocates nothing once warm: the rows' batches and the ragged histories'
// rows (which come back when the caller lets a history go).
struct RowsScratch {
  std::vector<Batch> rows;
  Array placeholder;  // the rows' placeholder ids (row_batch)
  Recycler<std::vector<KVHistory>> histories{[](std::vector<KVHistory>& v) { v.clear(); }};

  // The batches of `batch`'s rows (rows[b] for row b); let_go() drops their views of its ids.
  void split(const Batch& batch) {
    const auto n = static_cast<size_t>(batch.batch_size());
    if (rows.size() < n) rows.resize(n);
    const int64_t length = batch.length();
    for (size_t b = 0; b < n; ++b) {
      row_batch(batch, static_cast<int64_t>(b), length, rows[b], placeholder);
    }
  }
  // The rows keep no view of a caller's ids past the call (a wrapped array's memory, its release).
  void let_go() noexcept {
    for (Batch& row : rows) row.input_ids = Array();
  }
};

// update() of a batch over a cache's sequences (Seq has check and update as KVKind does): a
// one-row batch is its sequence's update; more rows are checked first (all of them, so a refusal
// changes nothing), then `room.make(id, tokens, keys, values)` (the whole batch's arrays) runs
// for each row — the allocations writing the row needs, so that failing there leaves every row
// unwritten; a row of a sequence not yet created finds it staged (Sequences::stage) — then the
// rows are written one by one into their sequences, and the history is ragged; when anything
// throws, `room.undo()` (noexcept) gives back what make() gave the rows not written. A sequence
// is created only when its row is written, and never by a row of no tokens.
template <class Seq, class Room>
KVHistory update_rows(const Batch& batch, const Array& keys, const Array& values, const char* call,
                      Sequences<Seq>& sequences, Room&& room, RowsScratch& scratch) {
  batch.validate(call);
  const int64_t rows = batch.batch_size();
  struct Unstage {
    Sequences<Seq>& sequences;
    ~Unstage() { sequences.unstage(); }
  } const unstage{sequences};
  // A row of no tokens on a sequence the cache has not made changes nothing: its history is an
  // empty sequence's (of the row's layout, as the kind gives one), made in a staged sequence
  // that is dropped — none is created.
  const auto nothing_to_write = [&](int64_t b) {
    return batch.seq_query_lens[static_cast<size_t>(b)] == 0 &&
           sequences.find(batch.seq_id(b)) == nullptr;
  };
  if (rows == 1) {
    const SeqId id = batch.seq_id(0);
    if (Seq* sequence = sequences.find(id)) return sequence->update(batch, keys, values, 0, id);
    sequences.peek(id, call).check(batch, keys, values, 0, id);
    if (nothing_to_write(0)) return sequences.stage(id, call).update(batch, keys, values, 0, id);
    return sequences.change(
        id, call, [&](Seq& created) { return created.update(batch, keys, values, 0, id); });
  }
  if (keys.ndim() != 4 || values.ndim() != 4 || keys.dim(0) != rows || values.dim(0) != rows) {
    throw Error(fmt::format("{}: keys {} and values {} must be [B, H, L, D] with B = {} rows", call,
                            keys.describe(), values.describe(), rows));
  }
  scratch.split(batch);
  struct LetGo {
    RowsScratch& scratch;
    ~LetGo() { scratch.let_go(); }
  } const let_go{scratch};
  const std::vector<Batch>& one = scratch.rows;
  for (int64_t b = 0; b < rows; ++b) {
    sequences.peek(batch.seq_id(b), call)
        .check(one[static_cast<size_t>(b)], keys.slice(0, b, b + 1), values.slice(0, b, b + 1), b,
               batch.seq_id(b));
  }
  return HistoryParts::rows(scratch.histories.make([&](std::vector<KVHistory>& histories) {
    try {
      histories.reserve(static_cast<size_t>(rows));
      for (int64_t b = 0; b < rows; ++b) {
        room.make(batch.seq_id(b),
                  static_cast<int64_t>(batch.seq_query_lens[static_cast<size_t>(b)]), keys, values);
      }
      for (int64_t b = 0; b < rows; ++b) {
        const SeqId id = batch.seq_id(b);
        if (nothing_to_write(b)) {
          histories.push_back(sequences.stage(id, call).update(one[static_cast<size_t>(b)],
                                                               keys.slice(0, b, b + 1),
                                                               values.slice(0, b, b + 1), b, id));
          continue;
        }
        histories.push_back(sequences.change(id, call, [&](Seq& sequence) {
          return sequence.update(one[static_cast<size_t>(b)], keys.slice(0, b, b + 1),
                                 values.slice(0, b, b + 1), b, id);
        }));
      }
    } catch (...) {
      room.undo();  // for the rows not written (every row, when a make ran out)
      throw;
    }
  }));
}

// view() of a batch: its one row's history, or a ragged one; a batch without rows views
// sequence 0. One with rows is checked as update checks it (offsets and lengths, one id per
// row, distinct ids).
template <class HistoryOf>
KVHistory view_rows(const Batch& batch, const char* call, RowsScratch& scratch,
                    HistoryOf&& history_of) {
  if (batch.batch_size() == 0) return history_of(0);
  batch.validate(call);
  if (batch.batch_size() == 1) return history_of(batch.seq_id(0));
  return HistoryParts::rows(scratch.histories.make([&](std::vector<KVHistory>& histories) {
    for (int64_t b = 0; b < batch.batch_size(); ++b) {
      histories.push_back(history_of(batch.seq_id(b)));
    }
  }));
}

// What both attention caches are around their sequences: the sequences, the lock they and their
// snapshots share, copies that belong to no sequence, and the calls that only route to a
// sequence. Every member function takes the lock.
template <class Seq>
class KVCacheCore {
 public:
  // `name` ("KVCache") prefixes error messages; `make` makes an empty sequence.
  KVCacheCore(const char* name, std::function<std::unique_ptr<Seq>()> make)
      : name_(name),
        update_call_(fmt::format("{}::update", name)),
        view_call_(fmt::format("{}::view", name)),
        sequences([this, make = std::move(make)] {
          std::unique_ptr<Seq> sequence = make();
          sequence->store.lock = shared_lock;
          return sequence;
        }) {}

  // A multi-row update's allocations before any row is written (update_rows): a sequence
  // without state is staged, one without a layout takes the batch's (given back by undo unless
  // written), then KVKind::make_room.
  struct Room {
    Sequences<Seq>& sequences;
    const char* call;
    std::vector<Seq*> adopted;  // existing sequences that took the batch's layout here

    void make(SeqId id, int64_t tokens, const Array& keys, const Array& values) {
      Seq* sequence = sequences.find(id);
      const bool staged = sequence == nullptr;  // dropped, not undone, unless its row is written
      if (staged) sequence = &sequences.stage(id, call);
      if (tokens > 0 && !sequence->store.has_layout) {
        if (!staged) adopted.push_back(sequence);  // first: it adopts only once undo() knows it
        sequence->store.adopt_layout(KVLayout::of_row(keys, values));
      }
      sequence->make_room(tokens);
    }
    // The sequences that took the layout here and were not written get none again.
    void undo() noexcept {
      for (Seq* sequence : adopted) {
        if (sequence->offset == 0) sequence->store.clear();
      }
    }
  };

  Seq& at(SeqId id) { return sequences.at(id, name_); }
  // Sequence `id` for checks: an empty one when absent (none is created).
  const Seq& peek(SeqId id) const { return sequences.peek(id, name_); }
  // Sequence `id`, or null when absent; throws Error for an id outside [0, kMaxSequences).
  const Seq* find(SeqId id) const { return sequences.find(id, name_); }

  KVHistory update(const Batch& batch, const Array& keys, const Array& values) {
    const Guard guard(lock);
    Room room{sequences, update_call_.c_str(), {}};
    return update_rows(batch, keys, values, update_call_.c_str(), sequences, room, scratch_);
  }
  KVHistory view(const Batch& batch) const {
    const Guard guard(lock);
    return view_rows(batch, view_call_.c_str(), scratch_, [&](SeqId id) {
      const Seq* sequence = find(id);
      return sequence == nullptr ? KVHistory() : sequence->history();
    });
  }
  // Never throws (KVStore::clear): the caches' destructors call it.
  void reset_all() noexcept {
    const Guard guard(lock);
    sequences.for_each([](SeqId, Seq& sequence) { sequence.reset(); });
  }
  void reset(SeqId seq) {
    const Guard guard(lock);
    if (Seq* sequence = sequences.find(seq, name_)) sequence->reset();
  }
  int64_t offset(SeqId seq) const {
    const Guard guard(lock);
    const Seq* sequence = find(seq);
    return sequence == nullptr ? 0 : sequence->offset;
  }
  int64_t exposed_bytes(SeqId seq) const {
    const Guard guard(lock);
    const Seq* sequence = find(seq);
    return sequence == nullptr ? 0 : sequence->exposed_bytes();
  }
  int64_t exposed_bytes_after_rewind(SeqId seq, int64_t to) const {
    const Guard guard(lock);
    const Seq* sequence = find(seq);
    return sequence == nullptr ? 0 : sequence->exposed_bytes_after_rewind(to);
  }
  ScheduleState schedule_state(SeqId seq) const {
    const Guard guard(lock);
    const Seq* sequence = find(seq);
    return sequence == nullptr ? ScheduleState{} : sequence->schedule.state();
  }
  std::vector<SeqId> ids() const {
    const Guard guard(lock);
    std::vector<SeqId> out;
    sequences.for_each([&](SeqId id, const Seq&) { out.push_back(id); });
    return out;
  }
  void prepare(SeqId seq, std::span<const int64_t> offsets) {
    const Guard guard(lock);
    const Seq& current = peek(seq);
    current.schedule.check(offsets, current.offset, current.calls().prepare.c_str());
    if (offsets.empty()) return;  // schedules nothing: no sequence is made for it
    sequences.change(seq, name_, [&](Seq& sequence) { sequence.prepare(offsets); });
  }
  // The take calls of an absent sequence give what an empty one does (nothing), creating none.
  std::vector<SnapshotPtr> take(SeqId seq) {
    const Guard guard(lock);
    Seq* sequence = sequences.find(seq, name_);
    return sequence != nullptr ? sequence->take() : std::vector<SnapshotPtr>{};
  }
  void take_into(SeqId seq, std::vector<SnapshotPtr>& into) {
    // Cleared first, outside the lock: a snapshot it held that is lazy in another cache takes
    // that cache's lock as it goes, and two threads each taking into what the other's cache
    // holds would wait on each other.
    into.clear();
    const Guard guard(lock);
    if (Seq* sequence = sequences.find(seq, name_)) return sequence->take_into(into);
    into.clear();
  }
  std::vector<SnapshotPtr> take_reached(SeqId seq) {
    const Guard guard(lock);
    Seq* sequence = sequences.find(seq, name_);
    return sequence != nullptr ? sequence->take_reached() : std::vector<SnapshotPtr>{};
  }
  void cancel(SeqId seq) {
    const Guard guard(lock);
    if (Seq* sequence = sequences.find(seq, name_)) sequence->cancel();
  }
  CopyStats stats() const {
    const Guard guard(lock);
    CopyStats total = unattributed;
    sequences.for_each([&](SeqId, const Seq& sequence) { add(total, sequence.store.stats); });
    return total;
  }

 private:
  const char* name_;
  std::string update_call_, view_call_;
  mutable RowsScratch scratch_;  // under the lock

 public:
  // Before `sequences`: their snapshots lock it as they go. Snapshots lazy in them share it,
  // so one that outlives the cache can still take it (and find itself owned).
  std::shared_ptr<CacheLock> shared_lock = std::make_shared<CacheLock>();
  CacheLock& lock = *shared_lock;
  CopyStats unattributed;  // merge and split copies
  Sequences<Seq> sequences;
};

// Throws Error naming `call` unless a KV range [from, to) splits at `at`: from <= at <= to.
inline void check_split_at(const Snapshot& s, int64_t at, const char* call) {
  if (at < s.from() || at > s.to()) {
    throw Error(
        fmt::format("{}: at {} is outside the snapshot's range [{}, {}) (a range splits "
                    "at an offset from its start to its end)",
                    call, at, s.from(), s.to()));
  }
}

// Holds `ours` and the lock of whatever each snapshot's data lives in — the store a KVCache
// snapshot is lazy in, the pool of a PagedKVCache snapshot — taken together with std::lock's
// deadlock avoidance: two caches restoring, merging or splitting each other's snapshots at once
// never wait on each other (taking ours first, then theirs, could). Null snapshots, owned ones
// and locks met twice add nothing.
class SnapshotLocks {
 public:
  SnapshotLocks(CacheLock& ours, const Snapshot* first, const Snapshot* second = nullptr);
  ~SnapshotLocks();
  SnapshotLocks(const SnapshotLocks&) = delete;
  SnapshotLocks& operator=(const SnapshotLocks&) = delete;

 private:
  std::array<CacheLock*, 3> held_{};
  size_t count_ = 0;
};

}  // namespace kvsnap::detail
