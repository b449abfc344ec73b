// RecurrentCache — the state of a recurrent layer (short causal conv + gated delta rule).
//
// State: conv tail [B, conv_tail, conv_dim] in the activation dtype and delta state
// [B, v_heads, v_dim, k_dim] in f32. A recurrent state cannot be rewound, so snapshots are
// whole states at an exact offset, captured where a later request may resume — including
// points inside one batched forward, which the layer reports through `put`:
//
//   auto splits = cache.snapshot_splits(L);              // scheduled interior points
//   auto history = cache.get(batch, kvsnap::DType::f32);
//   auto conv = kvsnap::causal_conv1d(x, w, history.conv_state(), splits);
//   auto delta = kvsnap::gated_delta(q, k, v, g, beta, history.delta_state(), splits);
//   cache.put(batch, conv.tails, delta.states);          // one state per split, then the end
//
// States are immutable values: the cache adopts the arrays `put` is given (no copy) and
// snapshots share them, so capture and restore copy nothing. Do not write to them.
#pragma once

#include <memory>

#include "kvsnap/cache.h"
#include "kvsnap/export.h"

namespace kvsnap {

namespace detail {
class RecurrentCacheImpl;
}

class KVSNAP_EXPORT RecurrentCache final : public Cache {
 public:
  // Throws Error unless every extent is >= 1 (conv_tail >= 0).
  RecurrentCache(int conv_tail, int conv_dim, int num_v_heads, int head_v_dim, int head_k_dim);
  ~RecurrentCache() override;

  // The live state for `batch` (rows at offset()), zero-initialized on first use. Throws when
  // the batch size or activation dtype differs from the state's.
  RecurrentHistory get(const Batch&, DType activation_dtype);
  // Ends a forward of the batch's L real tokens: one conv and one delta state per scheduled
  // interior split point (snapshot_splits(L)), then the state at the end, which becomes live.
  // offset() advances by L.
  void put(const Batch&, std::span<const Array> conv_states, std::span<const Array> delta_states);
  // Scheduled offsets strictly inside the next forward of `forward_len` tokens, relative to
  // offset() (ascending, in (0, forward_len)).
  std::vector<int64_t> snapshot_splits(int64_t forward_len) const;

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
  CopyStats copy_stats() const override;
  RestoreRule restore_rule() const override;

 private:
  std::unique_ptr<detail::RecurrentCacheImpl> impl_;
};

}  // namespace kvsnap
