// RecurrentCache running out of memory one allocation at a time (oom_test: see
// support/failing_allocation.h): a script over two sequences of a small recurrent layer —
// forwards of one and several tokens (get, the kernels, put), puts of two rows at once (one
// capturing inside its forward: all or nothing), snapshots, restores, splits, merges and captures
// scheduled inside a forward — each call armed.
// After a call that runs out, every sequence's state is the recomputed state of its tokens, as
// they were or as the call leaves them; the cache serves the rest of the script; every snapshot
// restores the state it captured; and once everything is dropped no array byte is left behind.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "support/cache_support.h"
#include "support/failing_allocation.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap::recurrent_oom_test {
namespace {

using testing::all_close;
using testing::armed_call;
using testing::concat_ids;
using testing::id_range;
using testing::RecurrentLayer;
using Ids = std::vector<int64_t>;

const RecurrentLayer layer;

// Whether `seq` is at offset ids.size() with the state a forward of `ids` from zero reaches.
bool holds(const RecurrentCache& cache, int32_t seq, const Ids& ids) {
  if (cache.offset(seq) != static_cast<int64_t>(ids.size())) return false;
  const std::vector<Array> state = cache.state(seq);
  if (ids.empty()) {  // no state yet, or the zeros get() starts a sequence with
    for (const Array& a : state) {
      for (const float v : a.to_floats()) {
        if (v != 0.0f) return false;
      }
    }
    return true;
  }
  std::pair<Array, Array> expected;
  (void)layer.reference(ids, &expected);
  return state.size() == 2 && all_close(state[0], expected.first, 1e-5f) &&
         all_close(state[1], expected.second, 1e-5f);
}

struct Script {
  RecurrentCache& cache;
  std::map<int32_t, Ids> held;
  std::map<std::string, std::pair<SnapshotPtr, Ids>> snapshots;  // name -> (snapshot, its tokens)

  void check() const {
    for (const auto& [seq, ids] : held) EXPECT_TRUE(holds(cache, seq, ids)) << "sequence " << seq;
  }
  // After `call` on `seqs` (each given `chunks[i]`): done, or each sequence as it was or written.
  void settle(bool done, const std::vector<int32_t>& seqs, const std::vector<Ids>& chunks) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      Ids& ids = held[seqs[i]];
      const Ids written = concat_ids(ids, chunks[i]);
      if (done || holds(cache, seqs[i], written)) {
        ids = written;
      } else {
        EXPECT_TRUE(holds(cache, seqs[i], ids))
            << "sequence " << seqs[i] << ": neither as it was nor written";
      }
    }
    check();
  }

  // One forward of `ids` through sequence `seq` (layer.forward: get, kernels, put).
  void forward(int32_t seq, const Ids& ids) {
    const bool done = armed_call([&] { (void)layer.forward(cache, ids, seq); });
    settle(done, {seq}, {ids});
  }
  // Both sequences' next tokens in one batch of two rows: one get, one put.
  void forward_both(const Ids& first, const Ids& second) {
    const bool done = armed_call([&] {
      const Batch batch =
          Batch::rows({{0, cache.offset(0), std::vector<int32_t>(first.size(), 0)},
                       {1, cache.offset(1), std::vector<int32_t>(second.size(), 0)}});
      const RecurrentHistory history = cache.get(batch, layer.activation);
      std::vector<RecurrentStates> rows;
      for (int b = 0; b < 2; ++b) {
        const Ids& ids = b == 0 ? first : second;
        Conv1dResult conv;
        GatedDeltaResult delta;
        const RecurrentHistory& row = history.row(b);
        (void)layer.run(ids, row.conv_state(), row.delta_state(),
                        cache.snapshot_splits(b, static_cast<int64_t>(ids.size())), &conv, &delta);
        rows.push_back({std::move(conv.tails), std::move(delta.states)});
      }
      cache.put(batch, rows);
    });
    // A put that runs out making a capture inside the rows' forwards writes no row: those come
    // before the first. (No capture at the rows' ends is scheduled here: one that runs out there
    // is lost after the rows are written, as cache.h allows.)
    if (!done) {
      EXPECT_TRUE(holds(cache, 0, held[0]) && holds(cache, 1, held[1]));
    }
    settle(done, {0, 1}, {first, second});
  }
  void snapshot(const std::string& name, int32_t seq) {
    SnapshotPtr s;
    if (armed_call([&] { s = cache.snapshot(seq, 0); }) && s != nullptr) {
      snapshots[name] = {std::move(s), held[seq]};
    }
    check();
  }
  // Restores `name` into `seq` at its end: a failed restore leaves it as it was or restored.
  void restore(int32_t seq, const std::string& name) {
    if (!snapshots.contains(name)) return;
    auto& [s, ids] = snapshots[name];
    bool fits = false;
    if (armed_call([&] { fits = cache.restore(seq, s.get(), s->to()); })) {
      ASSERT_TRUE(fits) << name;
      held[seq] = ids;
    } else if (holds(cache, seq, ids)) {
      held[seq] = ids;
    } else {
      EXPECT_TRUE(holds(cache, seq, held[seq])) << "sequence " << seq << ": neither";
    }
    check();
  }
  // Splits `name` at `at` and merges the halves back: a failure consumes it.
  void split_and_merge(const std::string& name, int64_t at) {
    if (!snapshots.contains(name)) return;
    auto& [s, ids] = snapshots[name];
    if (!testing::split_and_merge_armed(cache, s, at)) snapshots.erase(name);
    check();
  }
  // Every snapshot restores its state into a sequence of its own.
  void check_snapshots(int32_t spare) {
    for (auto& [name, entry] : snapshots) {
      auto& [s, ids] = entry;
      cache.reset(spare);
      ASSERT_TRUE(cache.restore(spare, s.get(), s->to())) << name;
      EXPECT_TRUE(holds(cache, spare, ids)) << name;
    }
    cache.reset(spare);
  }
};

void run_script(RecurrentCache& cache) {
  Script script{cache, {{0, {}}, {1, {}}}, {}};
  script.forward(0, id_range(0, 5));
  script.snapshot("five", 0);
  script.forward(0, {5});
  script.forward(1, id_range(100, 3));
  script.forward_both({6}, id_range(103, 2));
  // Two rows, the second capturing inside its forward: a put that runs out making that capture
  // writes neither row.
  const std::vector<int64_t> inside{cache.offset(1) + 1};
  if (armed_call([&] { cache.prepare_snapshots(1, inside); })) {
    script.forward_both({7}, id_range(110, 2));
    testing::keep_reached(cache, 1, inside, script.held[1], script.snapshots);
  }
  script.snapshot("one", 1);
  script.split_and_merge("one", 2);
  script.restore(1, "five");
  script.forward(1, id_range(200, 4));
  script.restore(0, "one");
  script.forward(0, {300});
  // A capture scheduled inside a forward.
  const int64_t at = cache.offset(0) + 2;
  if (SnapshotPtr s =
          testing::capture_inside(cache, 0, at, [&] { script.forward(0, id_range(400, 3)); })) {
    const Ids& ids = script.held[0];
    script.snapshots["captured"] = {std::move(s), Ids(ids.begin(), ids.begin() + at)};
  }
  script.check();
  // Two captures, inside a forward and at its end, then another forward: a put that runs out
  // recording the inside one leaves the schedule as it was; one that runs out capturing at the
  // end (the state moved) loses the rest of the schedule (a state captured later would be a
  // later one); the reached ones come.
  const std::vector<int64_t> marks{cache.offset(1) + 2, cache.offset(1) + 4};
  if (armed_call([&] { cache.prepare_snapshots(1, marks); })) {
    script.forward(1, id_range(500, 4));
    script.forward(1, id_range(600, 3));
    testing::keep_reached(cache, 1, marks, script.held[1], script.snapshots);
  }
  script.check();
  testing::disarm();
  script.check_snapshots(7);
}

TEST(RecurrentOutOfMemory, EveryFailedAllocationLeavesTheStatesAsTheContractSays) {
  const int64_t bytes = live_bytes();
  const int64_t runs = testing::sweep([&] {
    auto cache = std::make_unique<RecurrentCache>(
        layer.conv_tail, layer.conv_dim, layer.value_heads, layer.value_depth, layer.key_depth);
    run_script(*cache);
    cache.reset();
    EXPECT_EQ(live_bytes(), bytes);  // no array outlives the cache and its snapshots
  });
  EXPECT_GE(runs, 600);  // 806 as written
}

}  // namespace
}  // namespace kvsnap::recurrent_oom_test
