#include "kvsnap/cache.h"

#include <fmt/format.h>

namespace kvsnap {
namespace {

// Single-sequence caches (the default implementations) serve sequence 0 only.
void require_first(SeqId seq, const char* call) {
  if (seq != 0) {
    throw Error(fmt::format("Cache::{}: sequence {} of a single-sequence cache (only sequence 0)",
                            call, seq));
  }
}

}  // namespace

Snapshot::~Snapshot() = default;
Cache::~Cache() = default;

std::vector<Array> Cache::state(SeqId seq) const {
  require_first(seq, "state");
  return state();
}
void Cache::reset(SeqId seq) {
  require_first(seq, "reset");
  reset();
}
int64_t Cache::offset(SeqId seq) const {
  require_first(seq, "offset");
  return offset();
}
SnapshotPtr Cache::snapshot(SeqId seq, int64_t from_offset) {
  require_first(seq, "snapshot");
  return snapshot(from_offset);
}
void Cache::prepare_snapshots(SeqId seq, std::span<const int64_t> offsets) {
  require_first(seq, "prepare_snapshots");
  prepare_snapshots(offsets);
}
void Cache::cancel_snapshots(SeqId seq) {
  require_first(seq, "cancel_snapshots");
  cancel_snapshots();
}
std::vector<SnapshotPtr> Cache::take_snapshots(SeqId seq) {
  require_first(seq, "take_snapshots");
  return take_snapshots();
}
std::vector<SnapshotPtr> Cache::take_reached_snapshots(SeqId seq) {
  require_first(seq, "take_reached_snapshots");
  return take_reached_snapshots();
}
void Cache::take_snapshots_into(SeqId seq, std::vector<SnapshotPtr>& into) {
  into.clear();  // first, also when the take throws (cache.h)
  into = take_snapshots(seq);
}
bool Cache::restore(SeqId seq, Snapshot* snapshot, int64_t target) {
  require_first(seq, "restore");
  return restore(snapshot, target);
}
std::vector<SeqId> Cache::sequences() const { return {0}; }
int64_t Cache::exposed_bytes(SeqId) const { return 0; }
int64_t Cache::exposed_bytes_after_rewind(SeqId seq, int64_t) const { return exposed_bytes(seq); }
ScheduleState Cache::schedule_state(SeqId) const { return ScheduleState{.known = false}; }

}  // namespace kvsnap
