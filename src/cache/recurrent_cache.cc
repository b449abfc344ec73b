#include "kvsnap/recurrent_cache.h"

#include <fmt/format.h>

#include <exception>
#include <utility>

#include "attention/recycler.h"
#include "cache/capture_schedule.h"
#include "cache/sequences.h"
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

// One sequence's live state.
struct RecurrentSequence {
  SnapshotPtr capture() const {
    if (conv.empty() || offset == 0) return nullptr;
    return std::make_unique<RecurrentSnapshot>(conv, delta, offset);
  }
  void capture_reached() {
    while (schedule.active() && schedule.next() >= 0 && schedule.next() <= offset) {
      schedule.record_or_lose([&] { return capture(); });
    }
  }
  void reset() {
    schedule.clear();
    conv = Array();
    delta = Array();
    offset = 0;
  }

  Array conv, delta;  // live state; empty until first get/put/restore
  int64_t offset = 0;
  CopyStats stats;
  CaptureSchedule schedule;
};

class RecurrentCacheImpl {
 public:
  explicit RecurrentCacheImpl(const RecurrentCache::Dims& dims)
      : conv_tail(dims.conv_tail),
        conv_dim(dims.conv_dim),
        v_heads(dims.num_v_heads),
        v_dim(dims.head_v_dim),
        k_dim(dims.head_k_dim),
        sequences([] { return std::make_unique<RecurrentSequence>(); }) {}

  Shape conv_shape() const { return {1, conv_tail, conv_dim}; }
  Shape delta_shape() const { return {1, v_heads, v_dim, k_dim}; }
  RecurrentSequence& at(SeqId id) { return sequences.at(id, "RecurrentCache"); }
  // Sequence `id` for checks: an empty one when absent (none is created).
  const RecurrentSequence& peek(SeqId id, const char* call) const {
    return sequences.peek(id, call);
  }

  // Row `row` of `batch` at its sequence's offset; returns its length.
  int64_t check_row(const Batch& batch, int64_t row, const char* call) {
    const int64_t offset = peek(batch.seq_id(row), call).offset;
    if (batch.seq_offsets[static_cast<size_t>(row)] != offset) {
      throw Error(fmt::format("{}: row {} starts at {}; its sequence {} is at offset {}", call, row,
                              batch.seq_offsets[static_cast<size_t>(row)], batch.seq_id(row),
                              offset));
    }
    return batch.seq_query_lens[static_cast<size_t>(row)];
  }

  // Throws Error naming `call` unless sequence `id`'s state (if any) has `activation`'s dtype.
  void check_activation(SeqId id, DType activation, const char* call) const {
    const RecurrentSequence& sequence = peek(id, call);
    if (!sequence.conv.empty() && sequence.conv.dtype() != activation) {
      throw Error(
          fmt::format("{}: activation dtype {} differs from sequence {}'s state {} (fixed "
                      "until reset)",
                      call, dtype_name(activation), id, dtype_name(sequence.conv.dtype())));
    }
  }

  // Sequence `id`'s state (checked by check_activation), zeros at its first use.
  RecurrentHistory get_row(SeqId id, DType activation, const char* call) {
    RecurrentSequence& sequence = sequences.at(id, call);
    if (sequence.conv.empty()) {
      sequence.conv = Array::zeros(activation, conv_shape());
      sequence.delta = Array::zeros(DType::f32, delta_shape());
    }
    return RecurrentHistory(sequence.conv, sequence.delta);
  }

  // Throws Error naming `call` unless `states` fit row `row`: the scheduled splits plus the end,
  // of this cache's shapes and the sequence's activation dtype.
  void check_states(const Batch& batch, int64_t row, std::span<const Array> conv,
                    std::span<const Array> delta, const char* call) {
    const int64_t length = check_row(batch, row, call);
    const SeqId id = batch.seq_id(row);
    const size_t expected = split_count(id, length) + 1;
    if (conv.size() != expected || delta.size() != expected) {
      throw Error(fmt::format(
          "{}: got {} conv and {} delta states for row {}; expected {} ({} scheduled split "
          "points inside this forward, then the end)",
          call, conv.size(), delta.size(), row, expected, expected - 1));
    }
    const RecurrentSequence* sequence = sequences.find(id);
    const DType activation = sequence == nullptr || sequence->conv.empty() ? conv.back().dtype()
                                                                           : sequence->conv.dtype();
    if (activation == DType::i32) {
      throw Error(fmt::format("{}: conv states must have a float dtype, not i32", call));
    }
    for (size_t i = 0; i < expected; ++i) {
      if (conv[i].shape() != conv_shape() || conv[i].dtype() != activation) {
        throw Error(fmt::format("{}: conv state {} must be {}{}", call, conv[i].describe(),
                                dtype_name(activation), shape_string(conv_shape())));
      }
      if (delta[i].shape() != delta_shape() || delta[i].dtype() != DType::f32) {
        throw Error(fmt::format("{}: delta state {} must be f32{}", call, delta[i].describe(),
                                shape_string(delta_shape())));
      }
    }
  }

  // Adopts every row's checked states (row(b): row b's conv and delta states): the interior ones
  // are the captures for the scheduled split points, in order; the last becomes live. All that
  // allocates comes first — the sequences not made yet (staged) and the captures — so running out
  // of memory leaves every row, and its schedule, as it was. Then every row is written, and then
  // each captures what its schedule reached at its new end (one that runs out there is lost:
  // capture_reached; the other rows still capture theirs, and the first failure is rethrown).
  template <class Row>
  void put_rows(const Batch& batch, Row&& row) {
    struct Cleanup {
      Sequences<RecurrentSequence>& sequences;
      std::vector<SnapshotPtr>& made;
      ~Cleanup() {
        sequences.unstage();
        made.clear();
      }
    } const cleanup{sequences, made};
    const int64_t rows = batch.batch_size();
    const auto length = [&](int64_t b) { return batch.seq_query_lens[static_cast<size_t>(b)]; };
    for (int64_t b = 0; b < rows; ++b) {
      const RecurrentSequence* sequence = sequences.find(batch.seq_id(b));
      if (sequence == nullptr) {  // no schedule: nothing to capture
        // A row of no tokens makes no sequence (as a KV cache's makes none).
        if (length(b) > 0) (void)sequences.stage(batch.seq_id(b), "RecurrentCache::put");
        continue;
      }
      const auto [conv, delta] = row(b);
      for (size_t k = 0;; ++k) {
        const int64_t at = sequence->schedule.upcoming(k);
        if (at <= sequence->offset || at >= sequence->offset + length(b)) break;
        made.push_back(std::make_unique<RecurrentSnapshot>(conv[k], delta[k], at));
      }
    }
    size_t next = 0;
    for (int64_t b = 0; b < rows; ++b) {
      if (length(b) == 0) continue;  // no tokens: the state at this offset stays what it is
      RecurrentSequence& sequence = at(batch.seq_id(b));  // a staged one is taken: no allocation
      const int64_t end = sequence.offset + length(b);
      while (sequence.schedule.active() && sequence.schedule.next() > sequence.offset &&
             sequence.schedule.next() < end) {
        sequence.schedule.record(std::move(made[next++]));
      }
      const auto [conv, delta] = row(b);
      sequence.conv = conv.back();
      sequence.delta = delta.back();
      sequence.offset = end;
      sequence.stats.appended_bytes += sequence.conv.nbytes() + sequence.delta.nbytes();
    }
    std::exception_ptr lost;
    for (int64_t b = 0; b < rows; ++b) {
      try {
        if (RecurrentSequence* sequence = sequences.find(batch.seq_id(b))) {
          sequence->capture_reached();
        }
      } catch (...) {
        if (lost == nullptr) lost = std::current_exception();
      }
    }
    if (lost != nullptr) std::rethrow_exception(lost);
  }

  size_t split_count(SeqId id, int64_t forward_len) const {
    const RecurrentSequence* sequence = sequences.find(id);
    if (sequence == nullptr || !sequence->schedule.active()) return 0;
    return sequence->schedule.interior_count(sequence->offset, sequence->offset + forward_len);
  }
  std::vector<int64_t> splits(SeqId id, int64_t forward_len) const {
    const RecurrentSequence* sequence = sequences.find(id);
    if (sequence == nullptr || !sequence->schedule.active()) return {};
    return sequence->schedule.interior(sequence->offset, sequence->offset + forward_len);
  }

  // Throws Error naming `call` unless `s` has this cache's shapes, and the live state's
  // activation dtype when there is a live state.
  void check_fits(const RecurrentSequence& sequence, const RecurrentSnapshot& s,
                  const char* call) const {
    const DType activation = sequence.conv.empty() ? s.conv.dtype() : sequence.conv.dtype();
    const bool fits = s.conv.shape() == conv_shape() && s.conv.dtype() == activation &&
                      s.delta.shape() == delta_shape() && s.delta.dtype() == DType::f32;
    if (fits) return;
    throw Error(fmt::format(
        "{}: the snapshot (conv {}, delta {}) does not fit this cache (conv {}{}, delta "
        "f32{}): a state restores only into a cache of the same shapes, batch size and dtype",
        call, s.conv.describe(), s.delta.describe(), dtype_name(activation),
        shape_string(conv_shape()), shape_string(delta_shape())));
  }

  const int64_t conv_tail, conv_dim, v_heads, v_dim, k_dim;
  mutable CacheLock lock;
  Sequences<RecurrentSequence> sequences;
  std::vector<SnapshotPtr> made;  // put's captures, made before any row is written (reused)
  // The rows of get()'s histories of several rows, kept for reuse (under the lock).
  Recycler<std::vector<RecurrentHistory>> rows{[](std::vector<RecurrentHistory>& v) { v.clear(); }};
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

using detail::Guard;
using detail::RecurrentSnapshot;

RecurrentCache::RecurrentCache(const Dims& dims) {
  if (dims.conv_tail < 0 || dims.conv_dim < 1 || dims.num_v_heads < 1 || dims.head_v_dim < 1 ||
      dims.head_k_dim < 1) {
    throw Error(fmt::format(
        "RecurrentCache: conv_tail {}, conv_dim {}, num_v_heads {}, head_v_dim "
        "{}, head_k_dim {}: need conv_tail >= 0 and the rest >= 1",
        dims.conv_tail, dims.conv_dim, dims.num_v_heads, dims.head_v_dim, dims.head_k_dim));
  }
  impl_ = std::make_unique<detail::RecurrentCacheImpl>(dims);
}

RecurrentCache::RecurrentCache(int conv_tail, int conv_dim, int num_v_heads, int head_v_dim,
                               int head_k_dim)
    : RecurrentCache(Dims{conv_tail, conv_dim, num_v_heads, head_v_dim, head_k_dim}) {}

RecurrentCache::~RecurrentCache() = default;

RecurrentHistory RecurrentCache::get(const Batch& batch, DType activation_dtype) {
  constexpr const char* kCall = "RecurrentCache::get";
  const Guard guard(impl_->lock);
  batch.validate(kCall);
  if (activation_dtype == DType::i32) {
    throw Error("RecurrentCache::get: activation dtype i32 is not a float dtype");
  }
  for (int64_t b = 0; b < batch.batch_size(); ++b) {
    (void)impl_->check_row(batch, b, kCall);
    impl_->check_activation(batch.seq_id(b), activation_dtype, kCall);
  }
  if (batch.batch_size() == 1) return impl_->get_row(batch.seq_id(0), activation_dtype, kCall);
  return detail::HistoryParts::rows(impl_->rows.make([&](std::vector<RecurrentHistory>& rows) {
    for (int64_t b = 0; b < batch.batch_size(); ++b) {
      rows.push_back(impl_->get_row(batch.seq_id(b), activation_dtype, kCall));
    }
  }));
}

void RecurrentCache::put(const Batch& batch, std::span<const Array> conv_states,
                         std::span<const Array> delta_states) {
  constexpr const char* kCall = "RecurrentCache::put";
  const Guard guard(impl_->lock);
  batch.validate(kCall);
  if (batch.batch_size() != 1) {
    throw Error(
        fmt::format("{}: a batch of {} rows needs one RecurrentStates per row (the put "
                    "overload taking rows)",
                    kCall, batch.batch_size()));
  }
  impl_->check_states(batch, 0, conv_states, delta_states, kCall);
  impl_->put_rows(batch, [&](int64_t) { return std::pair(conv_states, delta_states); });
}

void RecurrentCache::put(const Batch& batch, std::span<const RecurrentStates> rows) {
  constexpr const char* kCall = "RecurrentCache::put";
  const Guard guard(impl_->lock);
  batch.validate(kCall);
  if (static_cast<int64_t>(rows.size()) != batch.batch_size()) {
    throw Error(fmt::format("{}: {} rows of states for a batch of {} rows", kCall, rows.size(),
                            batch.batch_size()));
  }
  for (int64_t b = 0; b < batch.batch_size(); ++b) {
    const RecurrentStates& row = rows[static_cast<size_t>(b)];
    impl_->check_states(batch, b, row.conv, row.delta, kCall);
  }
  impl_->put_rows(batch, [&](int64_t b) {
    const RecurrentStates& row = rows[static_cast<size_t>(b)];
    return std::pair(std::span<const Array>(row.conv), std::span<const Array>(row.delta));
  });
}

std::vector<int64_t> RecurrentCache::snapshot_splits(int64_t forward_len) const {
  return snapshot_splits(0, forward_len);
}
std::vector<int64_t> RecurrentCache::snapshot_splits(SeqId seq, int64_t forward_len) const {
  const Guard guard(impl_->lock);
  (void)impl_->sequences.find(seq, "RecurrentCache::snapshot_splits");  // the id checked
  return impl_->splits(seq, forward_len);
}

std::vector<Array> RecurrentCache::state() const { return state(0); }
std::vector<Array> RecurrentCache::state(SeqId seq) const {
  const Guard guard(impl_->lock);
  const detail::RecurrentSequence* sequence = impl_->sequences.find(seq, "RecurrentCache::state");
  if (sequence == nullptr || sequence->conv.empty()) return {};
  return {sequence->conv, sequence->delta};
}

void RecurrentCache::reset() {
  const Guard guard(impl_->lock);
  impl_->sequences.for_each([](SeqId, detail::RecurrentSequence& s) { s.reset(); });
}
void RecurrentCache::reset(SeqId seq) {
  const Guard guard(impl_->lock);
  if (auto* sequence = impl_->sequences.find(seq, "RecurrentCache::reset")) sequence->reset();
}

int64_t RecurrentCache::offset() const { return offset(0); }
int64_t RecurrentCache::offset(SeqId seq) const {
  const Guard guard(impl_->lock);
  const detail::RecurrentSequence* sequence = impl_->sequences.find(seq, "RecurrentCache::offset");
  return sequence == nullptr ? 0 : sequence->offset;
}

std::optional<DType> RecurrentCache::state_dtype(SeqId seq) const {
  const Guard guard(impl_->lock);
  const detail::RecurrentSequence* sequence =
      impl_->sequences.find(seq, "RecurrentCache::state_dtype");
  if (sequence == nullptr || sequence->conv.empty()) return std::nullopt;
  return sequence->conv.dtype();
}

int64_t RecurrentCache::exposed_bytes(SeqId seq) const {
  detail::Sequences<detail::RecurrentSequence>::check_id(seq, "RecurrentCache::exposed_bytes");
  return 0;
}

std::vector<SeqId> RecurrentCache::sequences() const {
  const Guard guard(impl_->lock);
  std::vector<SeqId> ids;
  impl_->sequences.for_each([&](SeqId id, const detail::RecurrentSequence&) { ids.push_back(id); });
  return ids;
}

ScheduleState RecurrentCache::schedule_state(SeqId seq) const {
  const Guard guard(impl_->lock);
  const detail::RecurrentSequence* sequence =
      impl_->sequences.find(seq, "RecurrentCache::schedule_state");
  return sequence == nullptr ? ScheduleState{} : sequence->schedule.state();
}

SnapshotPtr RecurrentCache::snapshot(int64_t from_offset) { return snapshot(0, from_offset); }
SnapshotPtr RecurrentCache::snapshot(SeqId seq, int64_t from_offset) {
  const Guard guard(impl_->lock);
  const detail::RecurrentSequence& sequence = impl_->peek(seq, "RecurrentCache::snapshot");
  if (from_offset < 0 || from_offset > sequence.offset) {
    throw Error(
        fmt::format("RecurrentCache::snapshot: from_offset {} out of range [0, {}] (the "
                    "cache offset)",
                    from_offset, sequence.offset));
  }
  return sequence.capture();
}

void RecurrentCache::prepare_snapshots(std::span<const int64_t> offsets) {
  prepare_snapshots(0, offsets);
}
void RecurrentCache::prepare_snapshots(SeqId seq, std::span<const int64_t> offsets) {
  constexpr const char* call = "RecurrentCache::prepare_snapshots";
  const Guard guard(impl_->lock);
  const detail::RecurrentSequence& current = impl_->peek(seq, call);
  current.schedule.check(offsets, current.offset, call);
  if (offsets.empty()) return;  // schedules nothing: no sequence is made for it
  impl_->sequences.change(seq, call, [&](detail::RecurrentSequence& sequence) {
    sequence.schedule.prepare(offsets, sequence.offset, call, [&] { sequence.capture_reached(); });
  });
}

std::vector<SnapshotPtr> RecurrentCache::take_snapshots() { return take_snapshots(0); }
std::vector<SnapshotPtr> RecurrentCache::take_snapshots(SeqId seq) {
  const Guard guard(impl_->lock);
  detail::RecurrentSequence* sequence =
      impl_->sequences.find(seq, "RecurrentCache::take_snapshots");
  if (sequence == nullptr) return {};
  return sequence->schedule.take(sequence->offset, "RecurrentCache::take_snapshots");
}

void RecurrentCache::take_snapshots_into(SeqId seq, std::vector<SnapshotPtr>& into) {
  into.clear();  // first, outside the lock (detail::KVCacheCore::take_into)
  const Guard guard(impl_->lock);
  detail::RecurrentSequence* sequence =
      impl_->sequences.find(seq, "RecurrentCache::take_snapshots");
  if (sequence == nullptr) {
    into.clear();
    return;
  }
  sequence->schedule.take_into(into, sequence->offset, "RecurrentCache::take_snapshots");
}

std::vector<SnapshotPtr> RecurrentCache::take_reached_snapshots() {
  return take_reached_snapshots(0);
}
std::vector<SnapshotPtr> RecurrentCache::take_reached_snapshots(SeqId seq) {
  const Guard guard(impl_->lock);
  detail::RecurrentSequence* sequence =
      impl_->sequences.find(seq, "RecurrentCache::take_reached_snapshots");
  if (sequence == nullptr) return {};
  return sequence->schedule.take_reached();
}

void RecurrentCache::cancel_snapshots() { cancel_snapshots(0); }
void RecurrentCache::cancel_snapshots(SeqId seq) {
  const Guard guard(impl_->lock);
  if (auto* sequence = impl_->sequences.find(seq, "RecurrentCache::cancel_snapshots")) {
    sequence->schedule.clear();
  }
}

bool RecurrentCache::restore(Snapshot* snapshot, int64_t target) {
  return restore(0, snapshot, target);
}
bool RecurrentCache::restore(SeqId seq, Snapshot* snapshot, int64_t target) {
  constexpr const char* call = "RecurrentCache::restore";
  const Guard guard(impl_->lock);
  // Checked on what the sequence is now (an empty one when absent); a sequence is created
  // only when the restore gives it a state.
  const detail::RecurrentSequence& current = impl_->peek(seq, call);
  current.schedule.require_idle(call);
  if (snapshot == nullptr) return target == current.offset;
  RecurrentSnapshot& s = *detail::as_recurrent_snapshot(snapshot, call);
  impl_->check_fits(current, s, call);
  if (target != s.at) return false;
  impl_->sequences.change(seq, call, [&](detail::RecurrentSequence& sequence) {
    sequence.conv = s.conv;  // immutable values: sharing is a restore without a copy
    sequence.delta = s.delta;
    sequence.offset = target;
  });
  return true;
}

SnapshotPtr RecurrentCache::merge(SnapshotPtr parent, SnapshotPtr child) {
  constexpr const char* call = "RecurrentCache::merge";
  const detail::RecurrentSnapshot* first = detail::as_recurrent_snapshot(parent.get(), call);
  const detail::RecurrentSnapshot* second = detail::as_recurrent_snapshot(child.get(), call);
  for (const detail::RecurrentSnapshot* s : {first, second}) {
    if (s != nullptr) impl_->check_fits(detail::RecurrentSequence{}, *s, call);
  }
  if (first != nullptr && second != nullptr && first->conv.dtype() != second->conv.dtype()) {
    throw Error(fmt::format("{}: the snapshots' activations differ ({} and {})", call,
                            dtype_name(first->conv.dtype()), dtype_name(second->conv.dtype())));
  }
  return child;
}

std::pair<SnapshotPtr, SnapshotPtr> RecurrentCache::split(SnapshotPtr snapshot, int64_t) {
  (void)detail::as_recurrent_snapshot(snapshot.get(), "RecurrentCache::split");
  return {nullptr, std::move(snapshot)};
}

CopyStats RecurrentCache::copy_stats() const {
  const Guard guard(impl_->lock);
  CopyStats total;
  impl_->sequences.for_each(
      [&](SeqId, const detail::RecurrentSequence& s) { detail::add(total, s.stats); });
  return total;
}

int RecurrentCache::conv_tail() const { return static_cast<int>(impl_->conv_tail); }
int RecurrentCache::conv_dim() const { return static_cast<int>(impl_->conv_dim); }
int RecurrentCache::num_v_heads() const { return static_cast<int>(impl_->v_heads); }
int RecurrentCache::head_v_dim() const { return static_cast<int>(impl_->v_dim); }
int RecurrentCache::head_k_dim() const { return static_cast<int>(impl_->k_dim); }

RestoreRule RecurrentCache::restore_rule() const { return {RestoreRule::Kind::whole_state, 0}; }

}  // namespace kvsnap
