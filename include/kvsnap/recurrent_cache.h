// RecurrentCache — the state of a recurrent layer (short causal conv + gated delta rule).
//
// State per sequence: conv tail [1, conv_tail, conv_dim] in the activation dtype and delta
// state [1, v_heads, v_dim, k_dim] in f32. A recurrent state cannot be rewound, so snapshots are
// whole states at an exact offset, captured where a later request may resume — including
// points inside one batched forward, which the layer reports through `put`:
//
//   auto splits = cache.snapshot_splits(L);              // scheduled interior points
//   auto history = cache.get(batch, kvsnap::DType::f32);
//   auto conv = kvsnap::causal_conv1d(x, w, history.conv_state(), splits);
//   auto delta = kvsnap::gated_delta(q, k, v, g, beta, history.delta_state(), splits);
//   cache.put(batch, conv.tails, delta.states);          // one state per split, then the end
//
// A batch whose rows are different sequences gets one history per row (history.row(b)); the
// layer runs each row with its state and its splits (snapshot_splits(seq, length)) and puts the
// rows' states back in one call (put with one RecurrentStates per row).
//
// States are immutable values: the cache adopts the arrays `put` is given (no copy) and
// snapshots share them, so capture and restore copy nothing. Do not write to them.
#pragma once

#include <memory>
#include <optional>

#include "kvsnap/cache.h"
#include "kvsnap/export.h"

namespace kvsnap {

namespace detail {
class RecurrentCacheImpl;
}

// One row's states for RecurrentCache::put: a conv and a delta state per scheduled split point
// of the row's forward, then the state at its end.
struct RecurrentStates {
  std::vector<Array> conv;
  std::vector<Array> delta;
};

class KVSNAP_EXPORT RecurrentCache final : public Cache {
 public:
  struct Dims {
    int conv_tail = 0;    // conv inputs carried over (the conv width - 1), >= 0
    int conv_dim = 1;     // conv channels
    int num_v_heads = 1;  // value heads of the delta state
    int head_v_dim = 1;
    int head_k_dim = 1;
  };
  // Throws Error unless every extent is >= 1 (conv_tail >= 0).
  explicit RecurrentCache(const Dims& dims);
  RecurrentCache(int conv_tail, int conv_dim, int num_v_heads, int head_v_dim, int head_k_dim);
  ~RecurrentCache() override;

  // The live state of each row's sequence (its offset must be the row's), zero-initialized on
  // first use: one row's history, or one per row (history.row(b)). Throws when the activation
  // dtype differs from a sequence's state.
  RecurrentHistory get(const Batch&, DType activation_dtype);
  // Ends a one-row forward of the row's L real tokens: one conv and one delta state per
  // scheduled interior split point (snapshot_splits(seq, L)), then the state at the end, which
  // becomes live. The sequence's offset advances by L. A row of no tokens (L = 0) leaves its
  // sequence as it is: its states are checked, not taken (the state at an offset is the one
  // its tokens made).
  void put(const Batch&, std::span<const Array> conv_states, std::span<const Array> delta_states);
  // The same for a batch of any rows: `rows[b]` for row b. Every row is checked before any
  // state changes.
  void put(const Batch&, std::span<const RecurrentStates> rows);
  // Scheduled offsets strictly inside the next forward of `forward_len` tokens of sequence 0 /
  // `seq`, relative to its offset (ascending, in (0, forward_len)).
  std::vector<int64_t> snapshot_splits(int64_t forward_len) const;
  std::vector<int64_t> snapshot_splits(SeqId seq, int64_t forward_len) const;

  // The dimensions given at construction.
  int conv_tail() const;
  int conv_dim() const;
  int num_v_heads() const;
  int head_v_dim() const;
  int head_k_dim() const;

  std::vector<Array> state() const override;
  void reset() override;
  int64_t offset() const override;
  // The state at offset() (from_offset is only range-checked); null at offset 0.
  [[nodiscard]] SnapshotPtr snapshot(int64_t from_offset) override;
  void prepare_snapshots(std::span<const int64_t> offsets) override;
  [[nodiscard]] std::vector<SnapshotPtr> take_snapshots() override;
  [[nodiscard]] std::vector<SnapshotPtr> take_reached_snapshots() override;
  void cancel_snapshots() override;
  // Only to a snapshot's exact offset; nullptr only to offset() itself. Otherwise false.
  [[nodiscard]] bool restore(Snapshot* snapshot, int64_t target) override;
  // Keeps the child (the state at the later offset); the parent is released.
  [[nodiscard]] SnapshotPtr merge(SnapshotPtr parent, SnapshotPtr child) override;
  // (null, snapshot): the state stays with the later half.
  [[nodiscard]] std::pair<SnapshotPtr, SnapshotPtr> split(SnapshotPtr, int64_t at) override;
  // Sequence `seq` (the calls above address sequence 0; see cache.h).
  std::vector<Array> state(SeqId seq) const override;
  void reset(SeqId seq) override;
  int64_t offset(SeqId seq) const override;
  // The dtype sequence `seq`'s state holds, fixed until it is reset (get refuses another);
  // nullopt before it holds one.
  std::optional<DType> state_dtype(SeqId seq) const;
  [[nodiscard]] SnapshotPtr snapshot(SeqId seq, int64_t from_offset) override;
  void prepare_snapshots(SeqId seq, std::span<const int64_t> offsets) override;
  void cancel_snapshots(SeqId seq) override;
  [[nodiscard]] std::vector<SnapshotPtr> take_snapshots(SeqId seq) override;
  [[nodiscard]] std::vector<SnapshotPtr> take_reached_snapshots(SeqId seq) override;
  void take_snapshots_into(SeqId seq, std::vector<SnapshotPtr>& into) override;
  [[nodiscard]] bool restore(SeqId seq, Snapshot* snapshot, int64_t target) override;
  std::vector<SeqId> sequences() const override;
  ScheduleState schedule_state(SeqId seq) const override;
  // 0: its snapshots own their bytes when taken.
  int64_t exposed_bytes(SeqId seq) const override;

  CopyStats copy_stats() const override;
  RestoreRule restore_rule() const override;

 private:
  std::unique_ptr<detail::RecurrentCacheImpl> impl_;
};

}  // namespace kvsnap
