// Speculative rounds running out of memory one allocation at a time (oom_test: see
// support/failing_allocation.h): begin and accept armed over a hybrid stack (attention, window,
// recurrent). A round that runs out is cancelled; every layer must still agree on one offset
// and hold the tokens at or before it, and the rounds after it must equal recomputation.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <string>
#include <vector>

#include "support/cache_support.h"
#include "support/conversation.h"
#include "support/failing_allocation.h"

namespace kvsnap::speculation_oom_test {
namespace {

using testing::armed_call;
using testing::HybridStack;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// Each layer's offset (stateless layers left out).
std::vector<int64_t> offsets(HybridStack& stack) {
  std::vector<int64_t> out;
  for (Cache* cache : stack.layers()) {
    if (cache != nullptr) out.push_back(cache->offset(0));
  }
  return out;
}

TEST(SpeculationOutOfMemory, ARoundThatRunsOutLeavesTheLayersTogether) {
  int64_t cut_short = 0;
  const int64_t runs = testing::sweep([&] {
    HybridStack stack;
    Speculation round(stack.layers());
    Tokens sequence = tokens(1, 12);  // past the window (8): the window layer must capture
    ASSERT_TRUE(stack.forward_and_check(sequence, sequence));
    for (int64_t r = 0; r < 4; ++r) {
      const Tokens verify = tokens(static_cast<int32_t>(100 + 10 * r), 4);  // next + 3 drafts
      const int64_t accepted = r % 4;
      if (!armed_call([&] { round.begin(3); })) {
        round.cancel();
        ++cut_short;
        EXPECT_EQ(offsets(stack), std::vector<int64_t>(offsets(stack).size(), stack.offset()));
        continue;
      }
      ASSERT_TRUE(stack.forward_and_check(verify, sequence + verify));
      const Tokens kept(verify.begin(), verify.begin() + accepted + 1);
      if (armed_call([&] { round.accept(accepted); })) {
        sequence = sequence + kept;
        continue;
      }
      // Out of memory in accept: the round is cancelled, and the layers must agree on where
      // they stand — the verified tokens, or what was accepted of them.
      ++cut_short;
      round.cancel();
      const std::vector<int64_t> now = offsets(stack);
      ASSERT_EQ(now, std::vector<int64_t>(now.size(), now.front())) << "layers apart";
      const auto at = static_cast<int64_t>(sequence.size());
      if (now.front() == at + static_cast<int64_t>(kept.size())) {
        sequence = sequence + kept;
      } else {
        ASSERT_EQ(now.front(), at + static_cast<int64_t>(verify.size()));
        sequence = sequence + verify;
      }
    }
    testing::disarm();
    // The stack goes on from wherever the rounds left it, equal to recomputation.
    const Tokens more = tokens(900, 3);
    ASSERT_TRUE(stack.forward_and_check(more, sequence + more));
  });
  // A round allocates only while its buffers grow (speculation.h): a handful in all.
  EXPECT_GE(runs, 5);
  EXPECT_GE(cut_short, 5);
}

// A verify forward of single steps over a wrapped window, each step armed: a step that runs
// out while making its capture, after its rows, loses the capture. Accepting every draft needs
// no capture and only releases the round; accepting fewer is refused, nothing changed.
TEST(SpeculationOutOfMemory, ALostCaptureDoesNotStopAcceptingEveryDraft) {
  const testing::TokenKV kv;
  const auto step = [&](RotatingKVCache& window, int64_t id) {
    (void)testing::write(window, kv, std::vector<int64_t>{id});
  };
  int64_t lost = 0;
  testing::sweep([&] {
    RotatingKVCache window(3);
    for (int64_t id = 0; id < 8; ++id) step(window, id);
    Speculation round({&window});
    round.begin(3);
    for (int64_t id = 100; id < 104; ++id) {
      const int64_t at = window.offset();
      if (!armed_call([&] { step(window, id); }) && window.offset() == at) {
        testing::disarm();
        step(window, id);  // the rows did not go in: again (the run's one failure is spent)
      }
    }
    testing::disarm();
    ASSERT_EQ(window.offset(), 12);
    const ScheduleState schedule = window.schedule_state(0);
    if (schedule.reached < schedule.count) {
      ++lost;
      EXPECT_THROW(round.accept(1), Error);
      EXPECT_TRUE(round.open());
      EXPECT_EQ(window.offset(), 12);
    }
    round.accept(3);
    EXPECT_FALSE(round.open());
    EXPECT_FALSE(window.schedule_state(0).pending);
    step(window, 7);
    const auto held = testing::position_ids(window.view(Batch::uniform(1, 0, window.offset())));
    const std::vector<std::pair<int64_t, int64_t>> expected{{10, 102}, {11, 103}, {12, 7}};
    EXPECT_EQ(held, expected);
  });
  EXPECT_GT(lost, 0);
}

}  // namespace
}  // namespace kvsnap::speculation_oom_test
