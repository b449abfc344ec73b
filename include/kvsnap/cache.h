// The Cache interface every kind of per-layer inference state implements, and Snapshot, the
// move-only handle that lets a cache return to an offset later.
//
// Offsets count tokens written so far. A KV snapshot holds the keys/values of a half-open range
// [from, to); whole-state snapshots (rotating window, recurrent state) hold the state at one
// offset. Snapshots may be lazy: they name slots of the live buffer and own no bytes. Before a
// write overwrites slots a lazy snapshot names, the cache copies exactly those slots out
// ("materializes" that part); the rest stays lazy. Freeing the buffer (reset, destruction)
// copies out whatever is still named — or, when that copy cannot be allocated, leaves the buffer
// alive for the snapshots that name it, so neither ever fails for lack of memory. (Such a snapshot
// then counts only its own columns in size(), though it keeps the whole buffer, up to its
// reserved capacity, until the last snapshot naming it goes.)
//
//   kvsnap::KVCache cache;
//   cache.update(batch, keys, values);             // 10 tokens
//   kvsnap::SnapshotPtr s = cache.snapshot(4);     // lazy [4, 10): no copy, size() == 0
//   cache.update(more_batch, more_keys, more_values);
//   bool ok = cache.restore(s.get(), 10);          // back to offset 10 (an offset move)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kvsnap/array.h"
#include "kvsnap/attention.h"
#include "kvsnap/batch.h"
#include "kvsnap/export.h"

namespace kvsnap {

// State that lets a cache return to an offset. Destroying it releases its memory (and detaches
// a lazy snapshot from its cache). A built-in snapshot may be used (restored from, saved,
// destroyed) on any thread while its cache is written on another: a lazy one's tokens are read
// under its cache's lock. Calls that consume a snapshot (merge, split) must not race other calls
// on the same snapshot.
class KVSNAP_EXPORT Snapshot {
 public:
  virtual ~Snapshot();
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;

  // Bytes this snapshot owns: 0 while wholly lazy. Once a write reaches one of its slots, the
  // storage for the run of slots it overwrites (up to the end of that run) is owned, though
  // only the overwritten slots were copied.
  virtual int64_t size() const = 0;
  // `hook(delta)` runs whenever size() changes without a call on the snapshot — a lazy snapshot
  // materializing, at once or in parts — with the change in bytes. Replaces any previous hook;
  // never runs for a snapshot that owns everything already, except a PagedKVCache one: a block
  // is paid for by one of its holders, so when a sequence takes up a block the snapshot shares
  // with others (restoring it, or another snapshot holding it) size() falls by it, and rises
  // again when the sequence lets it go, or when the holder that paid goes. It must not throw: it
  // also runs where the cache cannot fail (a reset, a destruction), and an exception there ends
  // the process.
  virtual void set_materialize_hook(std::function<void(int64_t delta)>) = 0;

  // KV kinds: the range [from(), to()) of tokens whose data it holds. Whole-state kinds:
  // from() == to() == the offset whose state it holds.
  virtual int64_t from() const = 0;
  virtual int64_t to() const = 0;
  // True while it names live cache slots for some of its data.
  virtual bool is_lazy() const = 0;

 protected:
  Snapshot() = default;
};
using SnapshotPtr = std::unique_ptr<Snapshot>;

// Bytes a cache has copied, by reason, since construction — so tests and benchmarks can prove
// what an operation cost.
struct CopyStats {
  int64_t appended_bytes = 0;      // new tokens written by update/put
  int64_t growth_bytes = 0;        // old tokens moved when storage grew or was relinearized
  int64_t materialized_bytes = 0;  // lazy snapshots copied out
  int64_t restored_bytes = 0;      // snapshot data written back by restore
  int64_t snapshot_bytes = 0;      // owned snapshots copied at capture time
};

// How a cache kind's snapshots restore, so planners (PrefixCache) know which offsets a layer
// can return to without trying.
struct RestoreRule {
  enum class Kind {
    ranges,       // KV: a snapshot of [from, to) restores any target in [from, to]
    whole_state,  // a snapshot restores only the offset it was taken at ...
  };
  Kind kind = Kind::whole_state;
  // ... or, for whole_state, any earlier target while its offset is <= rewind_limit (a
  // window that has evicted nothing); live rewinds likewise. 0 = exact offsets only.
  int64_t rewind_limit = 0;
};

// A sequence of a multi-sequence cache: batch rows name theirs in Batch::seq_ids.
using SeqId = int32_t;

// A sequence's capture schedule: what prepare_snapshots installed, until take_snapshots (any
// of them), cancel_snapshots or a reset clears it. Offsets are ascending and unique, so first,
// last and count name a run of consecutive offsets exactly.
struct ScheduleState {
  bool known = true;     // false: the cache kind does not report its schedule (Cache's default)
  bool pending = false;  // a schedule awaits take_snapshots (never one of no offsets)
  int64_t count = 0;     // its offsets: how many,
  int64_t first = 0;     // the first
  int64_t last = 0;      // and the last (0 and 0 when it has none),
  int64_t reached = 0;   // and how many the writes have captured so far (a prefix)
  // Which prepare_snapshots installed it: a number no other schedule of any built-in cache has
  // had, so a caller that noted it knows the schedule for its own even where another of the same
  // offsets replaced it (0 when none is pending, or the kind does not say).
  uint64_t serial = 0;
};

// One layer's inference state, for a set of sequences. Every mutating call gives the strong
// exception guarantee: on kvsnap::Error nothing changed — except merge and split, which consume
// their snapshots whatever happens (see there).
//
// std::bad_alloc promises less. A failed allocation leaves the cache consistent and usable, and
// a multi-row update of KVCache or PagedKVCache allocates every row's storage (buffer growth,
// pool blocks, copies of lazy data the rows overwrite, the sequences it creates — also on the
// cache's first write) before writing any row, so running out there leaves every row's tokens
// and offset as they were and creates no sequence (buffers may have grown, a paged cache's pool
// that grew on its first write keeps that write's layout, and lazy snapshots may own what they
// named). So does a RecurrentCache put of any rows: its captures inside the rows' forwards and
// the sequences it creates are made before any row is written. A bad_alloc after that — from
// small bookkeeping allocations (captures, the returned history) — or in a multi-row
// RotatingKVCache update or RecurrentCache get may leave the rows before the failing one
// written. A RotatingKVCache or RecurrentCache capture that runs out where its write reached it
// is lost (a window or state captured by a later write would be a later one): that sequence's
// schedule captures nothing more, take_snapshots throws saying so, take_reached_snapshots gives
// the captures before it. (A KV kind's capture is made by the next write instead: its range is
// still there.) A prepare_snapshots that runs out schedules nothing.
//
// Sequences: a cache holds one state per sequence id, created by the first call that gives it
// state (a write, a restore that gives it tokens, a schedule); a call that fails, returns false
// or changes nothing creates none. update / get / put with a batch route each row to its
// sequence; the calls below without a sequence address sequence 0 (a single-sequence cache is
// sequence 0), those with one address that sequence. The built-in kinds throw Error from every
// call naming a sequence outside [0, 2^20), naming the kind (or the kind and the call): "KVCache:
// sequence id -1 outside [0, 1048576)".
//
// Threads: kvsnap's caches lock themselves: any call (and a snapshot's destruction) may come
// from any thread; calls on one cache run one at a time. A child process made by fork() while
// another thread held a cache's lock finds it held for good: it must not call, or destroy, the
// caches and snapshots it inherited (new ones work).
class KVSNAP_EXPORT Cache {
 public:
  virtual ~Cache();
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  // ---- per sequence (the calls without one below address sequence 0) ----
  // The default implementations serve single-sequence caches: sequence 0 is the cache, any
  // other throws Error — except the queries exposed_bytes, exposed_bytes_after_rewind and
  // schedule_state, whose defaults answer for every sequence as each says below.
  virtual std::vector<Array> state(SeqId seq) const;
  // Drops the sequence's state and schedule (lazy snapshots of it are copied out first).
  virtual void reset(SeqId seq);
  virtual int64_t offset(SeqId seq) const;
  [[nodiscard]] virtual SnapshotPtr snapshot(SeqId seq, int64_t from_offset);
  virtual void prepare_snapshots(SeqId seq, std::span<const int64_t> offsets);
  virtual void cancel_snapshots(SeqId seq);
  [[nodiscard]] virtual std::vector<SnapshotPtr> take_snapshots(SeqId seq);
  [[nodiscard]] virtual std::vector<SnapshotPtr> take_reached_snapshots(SeqId seq);
  // take_snapshots(seq) into `into` (cleared first, also when the call throws; the built-in
  // kinds clear it before taking their lock). They swap buffers, so a caller that reuses `into`
  // round after round lets capture allocate nothing once warm.
  virtual void take_snapshots_into(SeqId seq, std::vector<SnapshotPtr>& into);
  [[nodiscard]] virtual bool restore(SeqId seq, Snapshot* snapshot, int64_t target);
  // The sequences the cache has made — written, restored or given a schedule — ascending; a
  // sequence reset stays listed, at offset 0 (sequence 0 alone for a single-sequence cache).
  virtual std::vector<SeqId> sequences() const;
  // How many bytes the snapshots taken so far of the sequence may come to own through its
  // writes alone (update, put): the lazy data a write may overwrite — a KV range beyond the
  // offset, a window ring, a tail block others share. An upper bound on what they come to own:
  // a write adds at most this much to their size() and lowers it by at least what it added.
  // (Not on the bytes copied, CopyStats::materialized_bytes: a snapshot's storage comes for a
  // whole run of columns when the first of them is copied, and the rest are copied into it
  // later, counted again there.) Captures of a schedule that
  // nobody has taken yet are not counted (they are their taker's: a Speculation round's, a
  // session's before prefill_done), except that a paged sequence's tail block counts whole while
  // any snapshot shares it. Calls that move the sequence (rewinds, restores) or the snapshots
  // (merge, split, taking captures) may raise it. PrefixCache reserves it under its byte budget
  // before a forward runs. 0 (the default) for a kind whose snapshots own all their bytes when
  // taken, as RecurrentCache's do.
  virtual int64_t exposed_bytes(SeqId seq) const;
  // What the snapshots taken so far may come to own once the sequence is rewound to `offset`
  // (at most its offset) and written from there: exposed_bytes as it would then be, plus what
  // the rewind itself hands them (a paged sequence's blocks they share). An upper bound, read
  // before the rewind: PrefixCache reserves it before a restore that rewinds a slot. The
  // default is exposed_bytes(seq), right for kinds whose rewinds give snapshots nothing.
  virtual int64_t exposed_bytes_after_rewind(SeqId seq, int64_t offset) const;
  // The sequence's pending schedule, changing nothing (an absent sequence has none), so a caller
  // can tell whose captures a layer holds before taking or cancelling them (Speculation does).
  // The default reports known = false; the built-in kinds report theirs.
  virtual ScheduleState schedule_state(SeqId seq) const;

  // ---- sequence 0, and the cache as a whole ----
  // The live state arrays (views; treat as read-only).
  virtual std::vector<Array> state() const = 0;
  // Drops all state of every sequence (materializing lazy snapshots first) and any schedule;
  // offsets become 0. Never fails for lack of memory (see above).
  virtual void reset() = 0;
  // Tokens written so far.
  virtual int64_t offset() const = 0;
  // Snapshot of [from_offset, offset()) (KV kinds) or of the whole state at offset() (others).
  // Null means "nothing to hold": an empty range (KV kinds), or offset 0 (whole-state kinds,
  // whose empty state is the reset cache). A whole state that needs no bytes (a window of 1) is
  // a real, empty snapshot: a restore point. Throws unless 0 <= from_offset <= offset().
  [[nodiscard]] virtual SnapshotPtr snapshot(int64_t from_offset) = 0;
  // Schedules captures as later writes reach each offset (ascending, unique, >= offset(); the
  // previous schedule taken). An offset equal to offset() is captured at once. No offsets
  // schedule nothing: the cache stays free to move, and no sequence is made.
  virtual void prepare_snapshots(std::span<const int64_t> offsets) = 0;
  // Drops the schedule and whatever it captured so far (no-op without one).
  virtual void cancel_snapshots() = 0;
  // One entry per scheduled offset, in order (KV kinds: [previous scheduled offset, offset);
  // null for a zero-width edge), and clears the schedule. Throws if an offset is unreached.
  [[nodiscard]] virtual std::vector<SnapshotPtr> take_snapshots() = 0;
  // For a forward cut short: the entries take_snapshots() would give for the scheduled offsets
  // already reached (a prefix of the schedule, in order); the rest are dropped with the
  // schedule. Empty without a schedule.
  [[nodiscard]] virtual std::vector<SnapshotPtr> take_reached_snapshots() = 0;
  // Returns the cache to offset `target` using `snapshot` (nullptr = live rewind). Returns
  // false and changes nothing when the target is unreachable. Throws Error naming both shapes,
  // changing nothing, for a snapshot that does not fit: another kind, window, batch size,
  // heads, depths, dtype or recurrent shape than the cache's (a reset cache takes any layout);
  // and on a pending schedule.
  [[nodiscard]] virtual bool restore(Snapshot* snapshot, int64_t target) = 0;
  // Joins adjacent snapshots of this kind: `parent` then `child`. Null in gives null out.
  // CONSUMES BOTH INPUTS EVEN WHEN IT THROWS: on Error (not adjacent — parent->to() !=
  // child->from() for KV kinds —, another kind, another layout) both snapshots are destroyed
  // (the cache itself is unchanged). Check from()/to() first to keep them on a refusal.
  [[nodiscard]] virtual SnapshotPtr merge(SnapshotPtr parent, SnapshotPtr child) = 0;
  // Splits at offset `at` into (before, after). Null halves mean "nothing to hold". KV ranges
  // [from, to) split at from <= at <= to (at == from or to gives the whole as one half) and
  // throw Error for any other `at`; whole-state kinds ignore `at` and give (null, whole).
  // CONSUMES ITS INPUT EVEN WHEN IT THROWS, as merge does.
  [[nodiscard]] virtual std::pair<SnapshotPtr, SnapshotPtr> split(SnapshotPtr, int64_t at) = 0;

  // Bytes copied so far, by reason, over all sequences.
  virtual CopyStats copy_stats() const = 0;
  // Which targets this kind's snapshots and live rewinds can reach.
  virtual RestoreRule restore_rule() const = 0;

 protected:
  Cache() = default;
};

// A cache of attention keys and values.
class KVSNAP_EXPORT Attention : public Cache {
 public:
  // Appends the batch's real tokens (keys [B, H, L, D], values [B, H, L, Dv]: row b's first
  // seq_query_lens[b] columns) to each row's sequence and returns the history every query of
  // the batch attends to: one row's history for a one-row batch, a ragged history (one per
  // row) otherwise. Each row's offset must equal its sequence's offset.
  virtual KVHistory update(const Batch&, const Array& keys, const Array& values) = 0;
  // The current history of the batch's rows' sequences, without writing (a batch without rows:
  // sequence 0's). Throws Error for a batch update would refuse (Batch::validate).
  virtual KVHistory view(const Batch&) const = 0;
};

}  // namespace kvsnap
