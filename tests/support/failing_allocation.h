// Running out of memory one allocation at a time, for the oom_test binary, whose
// failing_allocation.cc replaces the global operator new: while armed, allocations are counted
// and the one numbered `n` (start_run) throws std::bad_alloc — once, so the rest of the run must
// cope with that one failure. A sweep (sweep()) runs the same operations for n = 1, 2, ...
// until a run makes fewer than n allocations. Snapshot objects are not reused from a thread's
// free list meanwhile (detail::reuse_pooled_objects), so that each of them can fail too.
//
// To see where a failure reported as "allocation N fails" happens, run the test under a
// debugger with KVSNAP_OOM_BREAK=N: that allocation raises SIGTRAP before it throws.
#pragma once

#include <gtest/gtest.h>
#include <kvsnap/cache.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kvsnap::testing {

// Starts a run whose n-th counted allocation fails.
void start_run(int64_t n);
// Runs `call` with allocations counted (the run's n-th failing); true when it returned, false
// when it threw std::bad_alloc or a kvsnap::Error saying "out of memory" (another Error fails
// the test).
bool armed_call(const std::function<void()>& call);
// Stops counting (and failing) until the next armed_call.
void disarm();
// Whether this run's allocation n has come (and failed).
bool failed_in_run();
// Allocations counted in this run so far.
int64_t counted_allocations();
// Runs `run` (which arms its own calls) for n = 1, 2, ..., each run's n-th counted allocation
// failing, until a run makes fewer than n allocations — every one has failed once — or the test
// has failed. Returns the runs made.
int64_t sweep(const std::function<void()>& run);

// A capture of sequence `seq` at offset `at`, scheduled inside the write `write` runs (which arms
// its own call), each call armed: the capture, or null when a call ran out — then the schedule
// is cancelled. A capture comes only where the write that reaches it went in (one that ran out
// while making the capture, after the rows, may have lost it: cache.h).
template <class Write>
SnapshotPtr capture_inside(Cache& cache, SeqId seq, int64_t at, Write write) {
  const std::vector<int64_t> offsets{at};
  if (!armed_call([&] { cache.prepare_snapshots(seq, offsets); })) return nullptr;
  write();
  std::vector<SnapshotPtr> taken;
  const bool took = armed_call([&] { taken = cache.take_reached_snapshots(seq); });
  cache.cancel_snapshots(seq);
  if (!took) return nullptr;
  EXPECT_LE(taken.size(), cache.offset(seq) >= at ? 1U : 0U);
  if (taken.empty()) return nullptr;
  EXPECT_EQ(taken.front()->to(), at);
  return std::move(taken.front());
}

// Takes the captures of `marks` that sequence `seq` reached (armed; each must end at its mark)
// into `snapshots` as "mark <i>", with `ids` up to its offset; then cancels the rest.
inline void keep_reached(
    Cache& cache, SeqId seq, const std::vector<int64_t>& marks, const std::vector<int64_t>& ids,
    std::map<std::string, std::pair<SnapshotPtr, std::vector<int64_t>>>& snapshots) {
  std::vector<SnapshotPtr> taken;
  if (armed_call([&] { taken = cache.take_reached_snapshots(seq); })) {
    for (size_t i = 0; i < taken.size(); ++i) {
      EXPECT_EQ(taken[i]->to(), marks[i]);
      std::vector<int64_t> before(ids.begin(), ids.begin() + marks[i]);
      snapshots["mark " + std::to_string(i)] = {std::move(taken[i]), std::move(before)};
    }
  }
  cache.cancel_snapshots(seq);
}

// Splits `snapshot` at `at` and merges the halves back, each call armed: true when both returned
// (`snapshot` is the merged one), false when one ran out (Cache::split and merge consume what
// they are given even then: `snapshot` is gone).
inline bool split_and_merge_armed(Cache& cache, SnapshotPtr& snapshot, int64_t at) {
  std::pair<SnapshotPtr, SnapshotPtr> halves;
  return armed_call([&] { halves = cache.split(std::move(snapshot), at); }) && armed_call([&] {
           snapshot = cache.merge(std::move(halves.first), std::move(halves.second));
         });
}

}  // namespace kvsnap::testing
