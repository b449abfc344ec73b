#include "kvsnap/recurrent_cache.h"

#include <fmt/format.h>

#include "cache/capture_schedule.h"
#include "cache/state_snapshot.h"

namespace kvsnap {
namespace detail {

// A whole recurrent state at one offset; shares the immutable arrays of the state it copies.
class RecurrentSnapshot final : public StateSnapshot, public Pooled<RecurrentSnapshot> {
 public:
  using Pooled<RecurrentSnapshot>::operator new;
  using Pooled<RecurrentSnapshot>::operator delete;

  RecurrentSnapshot(Array conv, Array delta, int64_t offset)
      : StateSnapshot(SnapshotRecord::Kind::recurrent),
        conv(std::move(conv)),
        delta(std::move(delta)),
        at(offset) {}
  int64_t size() const override { return conv.nbytes() + delta.nbytes(); }
  void set_materialize_hook(std::function<void(int64_t)>) override {}  // never lazy
  int64_t from() const override { return at; }
  int64_t to() const override { return at; }
  bool is_lazy() const override { return false; }
  SnapshotRecord record() const override {
    return {SnapshotRecord::Kind::recurrent, conv, delta, at, at};
  }

  Array conv, delta;
  int64_t at;
};

class RecurrentCacheImpl {
 public:
  Shape conv_shape(int64_t rows) const { return {rows, conv_tail, conv_dim}; }
  Shape delta_shape(int64_t rows) const { return {rows, v_heads, v_dim, k_dim}; }

  SnapshotPtr capture() const {
    if (conv.empty() || offset == 0) return nullptr;
    return std::make_unique<RecurrentSnapshot>(conv, delta, offset);
  }
  void capture_reached() {
    while (schedule.active() && schedule.next() >= 0 && schedule.next() <= offset) {
      schedule.record(capture());
    }
  }

  // Rows at offset() sharing one query length; returns that length.
  int64_t check_batch(const Batch& batch, const char* call) const {
    batch.validate(call);
    const int32_t length = batch.seq_query_lens[0];
    for (int64_t row = 0; row < batch.batch_size(); ++row) {
      if (batch.seq_offsets[row] != offset || batch.seq_query_lens[row] != length) {
        throw Error(fmt::format(
            "{}: row {} starts at {} with {} tokens; every row must start at "
            "the cache offset {} with {} tokens",
            call, row, batch.seq_offsets[row], batch.seq_query_lens[row], offset, length));
      }
    }
    if (!conv.empty() && batch.batch_size() != conv.dim(0)) {
      throw Error(
          fmt::format("{}: batch of {} rows, but the state holds {} (batch size is fixed "
                      "until reset)",
                      call, batch.batch_size(), conv.dim(0)));
    }
    return length;
  }

  void check_state(const Array& conv_state, const Array& delta_state, int64_t rows,
                   DType activation, const char* call) const {
    if (conv_state.shape() != conv_shape(rows) || conv_state.dtype() != activation) {
      throw Error(fmt::format("{}: conv state {} must be {}{}", call, conv_state.describe(),
                              dtype_name(activation), shape_string(conv_shape(rows))));
    }
    if (delta_state.shape() != delta_shape(rows) || delta_state.dtype() != DType::f32) {
      throw Error(fmt::format("{}: delta state {} must be f32{}", call, delta_state.describe(),
                              shape_string(delta_shape(rows))));
    }
  }

  // Throws Error naming `call` unless `s` has this cache's shapes, and the live state's batch
  // size and activation dtype when there is a live state.
  void check_fits(const RecurrentSnapshot& s, const char* call) const {
    const int64_t rows = conv.empty() ? s.conv.dim(0) : conv.dim(0);
    const DType activation = conv.empty() ? s.conv.dtype() : conv.dtype();
    const bool fits = s.conv.shape() == conv_shape(rows) && s.conv.dtype() == activation &&
                      s.delta.shape() == delta_shape(rows) && s.delta.dtype() == DType::f32;
    if (fits) return;
    throw Error(fmt::format(
        "{}: the snapshot (conv {}, delta {}) does not fit this cache (conv {}{}, delta "
        "f32{}): a state restores only into a cache of the same shapes, batch size and dtype",
        call, s.conv.describe(), s.delta.describe(), dtype_name(activation),
        shape_string(conv_shape(rows)), shape_string(delta_shape(rows))));
  }

  int64_t conv_tail, conv_dim, v_heads, v_dim, k_dim;
  Array conv, delta;  // live state; empty until first get/put/restore
  int64_t offset = 0;
  CopyStats stats;
  CaptureSchedule schedule;
};

namespace {

RecurrentSnapshot* as_recurrent_snapshot(Snapshot* snapshot, const char* call) {
  if (snapshot == nullptr) return nullptr;
  auto* recurrent = dynamic_cast<RecurrentSnapshot*>(snapshot);
  if (recurrent == nullptr) {
    throw Error(
        fmt::format("{}: the snapshot is not a RecurrentCache snapshot (snapshots "
                    "restore only into a cache of their own kind)",
                    call));
  }
  return recurrent;
}

}  // namespace

SnapshotPtr make_recurrent_snapshot(Array conv, Array delta, int64_t offset) {
  return std::make_unique<RecurrentSnapshot>(std::move(conv), std::move(delta), offset);
}

}  // namespace detail

using detail::RecurrentSnapshot;

RecurrentCache::RecurrentCache(int conv_tail, int conv_dim, int num_v_heads, int head_v_dim,
                               int head_k_dim) {
  if (conv_tail < 0 || conv_dim < 1 || num_v_heads < 1 || head_v_dim < 1 || head_k_dim < 1) {
    throw Error(
        fmt::format("RecurrentCache: conv_tail {}, conv_dim {}, num_v_heads {}, head_v_dim "
                    "{}, head_k_dim {}: need conv_tail >= 0 and the rest >= 1",
                    conv_tail, conv_dim, num_v_heads, head_v_dim, head_k_dim));
  }
  impl_ = std::make_unique<detail::RecurrentCacheImpl>();
  impl_->conv_tail = conv_tail;
  impl_->conv_dim = conv_dim;
  impl_->v_heads = num_v_heads;
  impl_->v_dim = head_v_dim;
  impl_->k_dim = head_k_dim;
}

RecurrentCache::~RecurrentCache() = default;

RecurrentHistory RecurrentCache::get(const Batch& batch, DType activation_dtype) {
  detail::RecurrentCacheImpl& c = *impl_;
  c.check_batch(batch, "RecurrentCache::get");
  if (activation_dtype == DType::i32) {
    throw Error("RecurrentCache::get: activation dtype i32 is not a float dtype");
  }
  if (!c.conv.empty() && c.conv.dtype() != activation_dtype) {
    throw Error(
        fmt::format("RecurrentCache::get: activation dtype {} differs from the state's {} "
                    "(fixed until reset)",
                    dtype_name(activation_dtype), dtype_name(c.conv.dtype())));
  }
  if (c.conv.empty()) {
    c.conv = Array::zeros(activation_dtype, c.conv_shape(batch.batch_size()));
    c.delta = Array::zeros(DType::f32, c.delta_shape(batch.batch_size()));
  }
  return RecurrentHistory(c.conv, c.delta);
}

void RecurrentCache::put(const Batch& batch, std::span<const Array> conv_states,
                         std::span<const Array> delta_states) {
  detail::RecurrentCacheImpl& c = *impl_;
  const int64_t length = c.check_batch(batch, "RecurrentCache::put");
  const std::vector<int64_t> splits = snapshot_splits(length);
  const size_t expected = splits.size() + 1;
  if (conv_states.size() != expected || delta_states.size() != expected) {
    throw Error(
        fmt::format("RecurrentCache::put: got {} conv and {} delta states; expected {} ({} "
                    "scheduled split points inside this forward, then the end)",
                    conv_states.size(), delta_states.size(), expected, splits.size()));
  }
  const DType activation = c.conv.empty() ? conv_states.back().dtype() : c.conv.dtype();
  if (activation == DType::i32) {
    throw Error("RecurrentCache::put: conv states must have a float dtype, not i32");
  }
  for (size_t i = 0; i < expected; ++i) {
    c.check_state(conv_states[i], delta_states[i], batch.batch_size(), activation,
                  "RecurrentCache::put");
  }
  // Interior states are the captures for the scheduled split points, in order.
  for (size_t i = 0; i < splits.size(); ++i) {
    c.schedule.record(
        std::make_unique<RecurrentSnapshot>(conv_states[i], delta_states[i], c.offset + splits[i]));
  }
  c.conv = conv_states.back();
  c.delta = delta_states.back();
  c.offset += length;
  c.stats.appended_bytes += c.conv.nbytes() + c.delta.nbytes();
  c.capture_reached();
}

std::vector<int64_t> RecurrentCache::snapshot_splits(int64_t forward_len) const {
  if (!impl_->schedule.active()) return {};
  return impl_->schedule.interior(impl_->offset, impl_->offset + forward_len);
}

std::vector<Array> RecurrentCache::state() const {
  if (impl_->conv.empty()) return {};
  return {impl_->conv, impl_->delta};
}

void RecurrentCache::reset() {
  impl_->schedule.clear();
  impl_->conv = Array();
  impl_->delta = Array();
  impl_->offset = 0;
}

int64_t RecurrentCache::offset() const { return impl_->offset; }

SnapshotPtr RecurrentCache::snapshot(int64_t from_offset) {
  if (from_offset < 0 || from_offset > impl_->offset) {
    throw Error(
        fmt::format("RecurrentCache::snapshot: from_offset {} out of range [0, {}] (the "
                    "cache offset)",
                    from_offset, impl_->offset));
  }
  return impl_->capture();
}

void RecurrentCache::prepare_snapshots(std::span<const int64_t> offsets) {
  impl_->schedule.prepare(offsets, impl_->offset, "RecurrentCache::prepare_snapshots");
  impl_->capture_reached();
}

std::vector<SnapshotPtr> RecurrentCache::take_snapshots() {
  return impl_->schedule.take(impl_->offset, "RecurrentCache::take_snapshots");
}

bool RecurrentCache::restore(Snapshot* snapshot, int64_t target) {
  detail::RecurrentCacheImpl& c = *impl_;
  c.schedule.require_idle("RecurrentCache::restore");
  if (snapshot == nullptr) return target == c.offset;
  RecurrentSnapshot& s = *detail::as_recurrent_snapshot(snapshot, "RecurrentCache::restore");
  c.check_fits(s, "RecurrentCache::restore");
  if (target != s.at) return false;
  c.conv = s.conv;  // immutable values: sharing is a restore without a copy
  c.delta = s.delta;
  c.offset = target;
  return true;
}

SnapshotPtr RecurrentCache::merge(SnapshotPtr parent, SnapshotPtr child) {
  (void)detail::as_recurrent_snapshot(parent.get(), "RecurrentCache::merge");
  (void)detail::as_recurrent_snapshot(child.get(), "RecurrentCache::merge");
  return child;
}

std::pair<SnapshotPtr, SnapshotPtr> RecurrentCache::split(SnapshotPtr snapshot, int64_t) {
  (void)detail::as_recurrent_snapshot(snapshot.get(), "RecurrentCache::split");
  return {nullptr, std::move(snapshot)};
}

CopyStats RecurrentCache::copy_stats() const { return impl_->stats; }

int RecurrentCache::conv_tail() const { return static_cast<int>(impl_->conv_tail); }
int RecurrentCache::conv_dim() const { return static_cast<int>(impl_->conv_dim); }
int RecurrentCache::num_v_heads() const { return static_cast<int>(impl_->v_heads); }
int RecurrentCache::head_v_dim() const { return static_cast<int>(impl_->v_dim); }
int RecurrentCache::head_k_dim() const { return static_cast<int>(impl_->k_dim); }

RestoreRule RecurrentCache::restore_rule() const { return {RestoreRule::Kind::whole_state, 0}; }

void RecurrentCache::cancel_snapshots() { impl_->schedule.clear(); }

std::vector<SnapshotPtr> RecurrentCache::take_reached_snapshots() {
  return impl_->schedule.take_reached();
}

}  // namespace kvsnap
