// Schedules and running out of memory (cache.h), one allocation failing at a time (oom_test: see
// support/failing_allocation.h):
//   - a RotatingKVCache or RecurrentCache capture lost where its write reached it: the schedule
//     captures nothing more, take_snapshots throws saying so, take_reached_snapshots gives the
//     captures before it (only KVCache's version was checked: cache_oom_test.cc);
//   - a prepare_snapshots that runs out schedules nothing, on every kind.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/any_cache.h"
#include "support/cache_support.h"
#include "support/failing_allocation.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap::capture_oom_contract_test {
namespace {

using testing::armed_call;
using testing::id_range;
using testing::throws_error;
using testing::write_to;
using Ids = std::vector<int64_t>;

const testing::TokenKV kv;
const testing::RecurrentLayer layer;

std::unique_ptr<Cache> make(const std::string& kind) {
  if (kind == "KVCache") return std::make_unique<KVCache>();
  if (kind == "PagedKVCache") {
    return std::make_unique<PagedKVCache>(PagedKVCache::Options{.block_tokens = 4});
  }
  if (kind == "RotatingKVCache") return std::make_unique<RotatingKVCache>(4);
  return std::make_unique<RecurrentCache>(layer.conv_tail, layer.conv_dim, layer.value_heads,
                                          layer.value_depth, layer.key_depth);
}

// Where a schedule's capture was lost, by mark, over a sweep.
struct Losses {
  int64_t at[2] = {0, 0};
};

// One run on `kind`: sequence 0 at offset 2 schedules captures at `marks` (4 and 6), then writes
// [2, 4) in one chunk and 4, 5 one at a time, each write armed and tried again until it goes in
// (one allocation fails per run). A capture lost where its write reached it: nothing later is
// captured, take_snapshots (and take_snapshots_into) throws saying so and keeps the schedule,
// and take_reached_snapshots gives the captures before it.
void run_lost_capture(const std::string& kind, Losses& losses) {
  const std::unique_ptr<Cache> cache = make(kind);
  write_to(*cache, 0, id_range(0, 2));
  const Ids marks{4, 6};
  cache->prepare_snapshots(0, marks);
  for (const Ids& ids : {id_range(2, 2), id_range(4, 1), id_range(5, 1)}) {
    const int64_t target = ids.back() + 1;
    for (int tries = 0; cache->offset(0) < target; ++tries) {
      ASSERT_LT(tries, 2) << "a write that ran out once ran out again";
      (void)armed_call([&] { write_to(*cache, 0, ids); });
    }
  }
  testing::disarm();
  const ScheduleState state = cache->schedule_state(0);
  ASSERT_TRUE(state.pending);
  if (state.reached == 2) {  // nothing lost
    const std::vector<SnapshotPtr> taken = cache->take_snapshots(0);
    ASSERT_EQ(taken.size(), 2U);
    EXPECT_EQ(taken[0]->to(), 4);
    EXPECT_EQ(taken[1]->to(), 6);
    return;
  }
  ++losses.at[state.reached];
  const std::string call = kind + "::take_snapshots";
  const std::string lost_at = "offset " + std::to_string(marks[state.reached]) + " was lost";
  EXPECT_TRUE(throws_error([&] { (void)cache->take_snapshots(0); },
                           {call.c_str(), lost_at.c_str(), "out of memory"}));
  std::vector<SnapshotPtr> into;
  EXPECT_TRUE(throws_error([&] { cache->take_snapshots_into(0, into); },
                           {call.c_str(), lost_at.c_str(), "out of memory"}));
  EXPECT_TRUE(into.empty());
  EXPECT_TRUE(cache->schedule_state(0).pending);  // the refusal kept it
  const std::vector<SnapshotPtr> reached = cache->take_reached_snapshots(0);
  ASSERT_EQ(static_cast<int64_t>(reached.size()), state.reached);
  for (size_t i = 0; i < reached.size(); ++i) EXPECT_EQ(reached[i]->to(), marks[i]);
  EXPECT_FALSE(cache->schedule_state(0).pending);
}

class LostCapture : public ::testing::TestWithParam<std::string> {};

// Each run on a fresh thread: its pools of snapshot objects empty, every capture allocates.
TEST_P(LostCapture, TakeSnapshotsThrowsSayingSoAndNothingLaterIsCaptured) {
  Losses losses;
  const int64_t runs =
      testing::sweep([&] { std::thread([&] { run_lost_capture(GetParam(), losses); }).join(); });
  EXPECT_GT(runs, 2);
  EXPECT_GE(losses.at[0], 1) << "no run lost the first capture";
  EXPECT_GE(losses.at[1], 1) << "no run lost the second capture";
}

INSTANTIATE_TEST_SUITE_P(WholeStateKinds, LostCapture,
                         ::testing::Values("RotatingKVCache", "RecurrentCache"),
                         [](const auto& info) { return info.param; });

// A prepare_snapshots(seq, offsets) that ran out: no schedule pending or counted, nothing to take
// (take_snapshots gives nothing rather than "not reached"), the sequence free to move and to be
// given a schedule again, and no sequence made for it.
void expect_nothing_scheduled(Cache& cache, SeqId seq, const std::vector<SeqId>& sequences) {
  const ScheduleState state = cache.schedule_state(seq);
  EXPECT_FALSE(state.pending);
  EXPECT_EQ(state.count, 0);
  EXPECT_EQ(state.reached, 0);
  EXPECT_EQ(cache.sequences(), sequences);
  EXPECT_TRUE(cache.take_snapshots(seq).empty());
  const int64_t offset = cache.offset(seq);
  EXPECT_TRUE(cache.restore(seq, nullptr, offset));  // not refused as "captures are scheduled"
  const Ids again{offset + 1};
  cache.prepare_snapshots(seq, again);  // not refused as "the previous schedule was not taken"
  EXPECT_TRUE(cache.schedule_state(seq).pending);
  cache.cancel_snapshots(seq);
}

class PrepareOutOfMemory : public ::testing::TestWithParam<std::string> {};

// On a sequence with tokens (offsets at and past its offset: the first is captured at once) and
// on a sequence not made yet.
TEST_P(PrepareOutOfMemory, APrepareThatRunsOutSchedulesNothing) {
  int64_t failed = 0;
  const int64_t runs = testing::sweep([&] {
    std::thread([&] {
      const std::unique_ptr<Cache> cache = make(GetParam());
      write_to(*cache, 0, id_range(0, 4));
      const std::vector<SeqId> before = cache->sequences();
      for (const SeqId seq : {SeqId{0}, SeqId{2}}) {
        const int64_t offset = cache->offset(seq);
        const Ids offsets{offset, offset + 2, offset + 3};
        if (armed_call([&] { cache->prepare_snapshots(seq, offsets); })) {
          testing::disarm();
          EXPECT_TRUE(cache->schedule_state(seq).pending);
          cache->cancel_snapshots(seq);
          continue;
        }
        testing::disarm();
        ++failed;
        SCOPED_TRACE("sequence " + std::to_string(seq));
        expect_nothing_scheduled(*cache, seq, before);
      }
    }).join();
  });
  EXPECT_GT(runs, 1);
  EXPECT_GE(failed, 1);
}

INSTANTIATE_TEST_SUITE_P(Kinds, PrepareOutOfMemory,
                         ::testing::Values("KVCache", "PagedKVCache", "RotatingKVCache",
                                           "RecurrentCache"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kvsnap::capture_oom_contract_test
