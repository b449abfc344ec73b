// Speculation rounds among other calls on the same sequences: a schedule someone else left on a
// layer, the round's captures taken or replaced between begin and accept, a cache listed twice.
// Every refusal is an Error that changes nothing — no layer moves, nobody else's captures are
// dropped — and leaves a round that cancel() (or, once the obstacle is gone, accept()) ends.
#include <gtest/gtest.h>
#include <kvsnap/speculation.h>

#include <span>
#include <string>
#include <tuple>

#include "support/delegating_cache.h"
#include "support/hybrid_stack.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::StackOptions;
using Tokens = std::vector<int32_t>;

using testing::concat;
using testing::range;

// Runs `call`, which must throw Error with `text` in its message.
template <class Call>
void expect_error(Call&& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "no Error; expected one saying: " << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

void expect_offsets(const std::vector<Cache*>& layers, int64_t offset, SeqId seq = 0) {
  for (Cache* layer : layers) {
    if (layer != nullptr) {
      EXPECT_EQ(layer->offset(seq), offset);
    }
  }
}

void expect_schedule(const Cache& layer, int64_t count, int64_t first, int64_t last,
                     SeqId seq = 0) {
  const ScheduleState s = layer.schedule_state(seq);
  EXPECT_TRUE(s.known);
  EXPECT_TRUE(s.pending);
  EXPECT_EQ(s.count, count);
  EXPECT_EQ(s.first, first);
  EXPECT_EQ(s.last, last);
}

// The stack's layers: 0 attention (KV or paged), 1 window, 2 stateless, 3 recurrent.
Cache* layer_of(HybridStack& stack, size_t index) { return stack.layers()[index]; }

// (paged attention, window size): a window of 4 has evicted tokens and captures, 64 rewinds.
class EveryKind : public ::testing::TestWithParam<std::tuple<bool, int64_t>> {};

// A schedule someone else left on any layer — one the round would rewind (attention, a window
// that has evicted nothing) or capture on (a window past its size, a recurrent state) — is
// refused at begin, and stays theirs.
TEST_P(EveryKind, BeginRefusesALayerWithCapturesScheduled) {
  const auto [paged, window] = GetParam();
  for (size_t scheduled : {0u, 1u, 3u}) {
    SCOPED_TRACE(::testing::Message() << "layer " << scheduled);
    HybridStack stack(StackOptions{.window = window, .paged = paged});
    const Tokens prompt = range(1, 10);
    ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
    Cache& layer = *layer_of(stack, scheduled);
    layer.prepare_snapshots(0, std::vector<int64_t>{10, 20});
    layer.prepare_snapshots(1, std::vector<int64_t>{3});  // another sequence's: no obstacle
    Speculation round(stack.layers());
    expect_error([&] { round.begin(3); },
                 "layer " + std::to_string(scheduled) +
                     " has captures scheduled for sequence 0 (2 offsets from 10 to 20, 1 "
                     "captured)");
    EXPECT_FALSE(round.open());
    for (Cache* other : stack.layers()) {  // nothing scheduled elsewhere, theirs kept
      if (other != nullptr && other != &layer) {
        EXPECT_FALSE(other->schedule_state(0).pending);
      }
    }
    expect_schedule(layer, 2, 10, 20);
    layer.cancel_snapshots(0);
    // Free again: the round opens, and the other sequence's schedule is still untouched.
    round.begin(3);
    const Tokens verify = range(20, 4);
    ASSERT_TRUE(stack.forward_and_check(verify, concat(prompt, verify)));
    round.accept(1);
    expect_offsets(stack.layers(), 12);
    expect_schedule(layer, 1, 3, 3, /*seq=*/1);
    const Tokens next = {7};
    ASSERT_TRUE(stack.forward_and_check(next, concat(concat(prompt, range(20, 2)), next)));
  }
}

// A layer that does not stand where the verify forward leaves it (here the attention layer, as
// after a forward cut short) is named; accept refuses before any layer moves.
TEST_P(EveryKind, AcceptNamesALayerTheVerifyForwardDidNotReach) {
  const auto [paged, window] = GetParam();
  HybridStack stack(StackOptions{.window = window, .paged = paged});
  const Tokens prompt = range(1, 10);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  Speculation round(stack.layers());
  round.begin(3);
  const Tokens verify = range(20, 4);
  ASSERT_TRUE(stack.forward_and_check(verify, concat(prompt, verify)));
  ASSERT_TRUE(stack.attention().restore(0, nullptr, 13));  // one token short
  expect_error([&] { round.accept(1); },
               "Speculation::accept: layer 0 of sequence 0 stands at offset 13; the verify "
               "forward of 4 tokens from 10 leaves every layer at 14");
  EXPECT_TRUE(round.open());
  EXPECT_EQ(stack.window.offset(0), 14);
  EXPECT_EQ(stack.recurrent.offset(0), 14);
  round.cancel();
}

// A schedule that appears mid-round on a layer that must rewind blocks the rewind: accept
// refuses before any layer moves, and succeeds once its owner has taken it.
TEST_P(EveryKind, AcceptWaitsForAForeignScheduleOnARewindingLayer) {
  const auto [paged, window] = GetParam();
  HybridStack stack(StackOptions{.window = window, .paged = paged});
  const Tokens prompt = range(1, 10);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  Speculation round(stack.layers());
  round.begin(3);
  Cache& attention = stack.attention();
  attention.prepare_snapshots(0, std::vector<int64_t>{12, 20});
  const Tokens verify = range(20, 4);
  ASSERT_TRUE(stack.forward_and_check(verify, concat(prompt, verify)));
  expect_error([&] { round.accept(1); },
               "layer 0 has captures scheduled for sequence 0 (2 offsets from 12 to 20, 1 "
               "captured), not the round's, and must rewind to offset 12");
  EXPECT_TRUE(round.open());
  expect_offsets(stack.layers(), 14);  // nothing moved
  expect_schedule(attention, 2, 12, 20);
  expect_schedule(stack.recurrent, 3, 11, 13);  // the round's captures are still there
  const std::vector<SnapshotPtr> theirs = attention.take_reached_snapshots(0);
  EXPECT_EQ(theirs.size(), 1u);
  round.accept(1);
  expect_offsets(stack.layers(), 12);
  const Tokens next = {7, 8};
  ASSERT_TRUE(stack.forward_and_check(next, concat(concat(prompt, range(20, 2)), next)));
}

// Accepting every draft moves no layer: a foreign schedule is no obstacle, and stays.
TEST_P(EveryKind, AcceptingEveryDraftLeavesAForeignScheduleAlone) {
  const auto [paged, window] = GetParam();
  HybridStack stack(StackOptions{.window = window, .paged = paged});
  const Tokens prompt = range(1, 10);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  Speculation round(stack.layers());
  round.begin(2);
  stack.attention().prepare_snapshots(0, std::vector<int64_t>{30});
  const Tokens verify = range(20, 3);
  ASSERT_TRUE(stack.forward_and_check(verify, concat(prompt, verify)));
  round.accept(2);
  expect_offsets(stack.layers(), 13);
  expect_schedule(stack.attention(), 1, 30, 30);
  EXPECT_FALSE(stack.recurrent.schedule_state(0).pending);  // the round's released
}

// How another call on the sequence takes the round's captures from a capturing layer between
// begin and accept.
// (replace_alike: with a schedule of the round's own offsets — someone else's all the same.)
enum class Interference { take, take_reached, cancel, replace, replace_alike, prefix_style };

// The round's captures on the recurrent layer (or a window past its size) are gone: accept
// refuses before any layer moves — no out-of-range capture, no half-applied round — and keeps
// refusing; cancel ends the round, leaving a schedule that replaced the round's to its owner.
void round_losing_its_captures(bool paged, int64_t window, Interference how, bool on_window) {
  HybridStack stack(StackOptions{.window = window, .paged = paged});
  Cache& victim = on_window ? static_cast<Cache&>(stack.window) : stack.recurrent;
  const Tokens prompt = range(1, 10);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  Speculation round(stack.layers());
  round.begin(3);
  const Tokens verify = range(20, 4);
  Tokens written = prompt;
  if (how == Interference::take_reached) {  // mid-forward: the first two drafts written
    written = concat(written, range(20, 2));
    ASSERT_TRUE(stack.forward_and_check(range(20, 2), written));
    EXPECT_EQ(victim.take_reached_snapshots(0).size(), 2u);  // offsets 11 and 12
  }
  if (how == Interference::cancel) victim.cancel_snapshots(0);
  const bool replaced = how == Interference::replace || how == Interference::replace_alike;
  if (replaced || how == Interference::prefix_style) {
    victim.cancel_snapshots(0);  // as PrefixCache::begin on the slot does: cancel, prepare
    const std::vector<int64_t> theirs = how == Interference::replace ? std::vector<int64_t>{12, 20}
                                        : how == Interference::replace_alike
                                            ? std::vector<int64_t>{11, 12, 13}
                                            : std::vector<int64_t>{};
    victim.prepare_snapshots(0, theirs);
  }
  const Tokens rest(verify.begin() + static_cast<int64_t>(written.size() - prompt.size()),
                    verify.end());
  ASSERT_TRUE(stack.forward_and_check(rest, concat(prompt, verify)));
  if (how == Interference::take) {
    EXPECT_EQ(victim.take_snapshots(0).size(), 3u);
  }
  const CopyStats copies = stack.recurrent.copy_stats();
  for (int attempt = 0; attempt < 2; ++attempt) {
    expect_error([&] { round.accept(1); }, "were taken, replaced or lost");
  }
  EXPECT_TRUE(round.open());
  expect_offsets(stack.layers(), 14);
  EXPECT_EQ(stack.recurrent.copy_stats().restored_bytes, copies.restored_bytes);
  round.cancel();
  EXPECT_FALSE(round.open());
  expect_offsets(stack.layers(), 14);
  for (Cache* layer : stack.layers()) {
    if (layer == nullptr || layer == &victim) continue;
    EXPECT_FALSE(layer->schedule_state(0).pending);  // the round's own, released
  }
  if (how == Interference::replace) {
    expect_schedule(victim, 2, 12, 20);  // theirs, untouched
    EXPECT_EQ(victim.take_reached_snapshots(0).size(), 1u);
  } else if (how == Interference::replace_alike) {
    expect_schedule(victim, 3, 11, 13);
    EXPECT_EQ(victim.take_snapshots(0).size(), 3u);
  } else {  // taken, cancelled, or replaced by no offsets (which schedule nothing)
    EXPECT_FALSE(victim.schedule_state(0).pending);
  }
  // The layers hold the whole verify forward: the sequence goes on from there.
  const Tokens next = {7};
  ASSERT_TRUE(stack.forward_and_check(next, concat(concat(prompt, verify), next)));
}

TEST_P(EveryKind, AcceptFailsCleanlyWhenTheRoundsCapturesAreGone) {
  const auto [paged, window] = GetParam();
  for (Interference how :
       {Interference::take, Interference::take_reached, Interference::cancel, Interference::replace,
        Interference::replace_alike, Interference::prefix_style}) {
    SCOPED_TRACE(::testing::Message() << "interference " << static_cast<int>(how));
    // The recurrent layer always captures; a window of 4 does too once past its size.
    for (bool on_window : {false, true}) {
      if (on_window && window > 8) continue;
      SCOPED_TRACE(on_window ? "window" : "recurrent");
      round_losing_its_captures(paged, window, how, on_window);
    }
  }
}

// A cache listed twice (a KV cache several model layers share) is one state: one schedule,
// one rollback.
TEST(Speculation, ALayerListedTwiceIsRolledBackOnce) {
  for (int64_t accepted = 0; accepted <= 3; ++accepted) {
    HybridStack stack(StackOptions{.window = 4});
    const Tokens prompt = range(1, 10);
    ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
    std::vector<Cache*> layers = stack.layers();
    const std::vector<Cache*> once = layers;
    layers.insert(layers.end(), once.rbegin(), once.rend());
    Speculation round(layers);
    round.begin(3);
    EXPECT_EQ(round.capturing_layers(), 2);  // window and recurrent, once each
    const Tokens verify = range(20, 4);
    ASSERT_TRUE(stack.forward_and_check(verify, concat(prompt, verify)));
    round.accept(accepted);
    expect_offsets(once, 10 + accepted + 1);
    EXPECT_EQ(round.stats().restores, accepted < 3 ? 2 : 0);
    EXPECT_EQ(round.stats().rewinds, accepted < 3 ? 1 : 0);
    const Tokens next = {7};
    const Tokens accepted_part(verify.begin(), verify.begin() + accepted + 1);
    ASSERT_TRUE(stack.forward_and_check(next, concat(concat(prompt, accepted_part), next)));
    // Errors name a layer by its first position in the list.
    stack.window.prepare_snapshots(0, std::vector<int64_t>{40});
    expect_error([&] { round.begin(1); }, "layer 1 has captures scheduled");
  }
}

// A cache kind that does not report its schedule (Cache's default schedule_state): the round's
// captures are checked on what take_snapshots gives, still before any layer moves.
class Unreported final : public testing::DelegatingCache {
 public:
  using DelegatingCache::DelegatingCache;
};

TEST(Speculation, AKindThatDoesNotReportItsScheduleIsCheckedOnItsCaptures) {
  HybridStack stack(StackOptions{.window = 4});
  const Tokens prompt = range(1, 10);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  Unreported recurrent(stack.recurrent);
  EXPECT_FALSE(recurrent.schedule_state(0).known);
  Speculation round({&stack.attention(), &stack.window, &recurrent});
  round.begin(3);
  const Tokens verify = range(20, 4);
  ASSERT_TRUE(stack.forward_and_check(verify, concat(prompt, verify)));
  EXPECT_EQ(stack.recurrent.take_snapshots().size(), 3u);  // someone else takes them
  for (int attempt = 0; attempt < 2; ++attempt) {
    expect_error([&] { round.accept(1); },
                 "layer 2 gave 0 captures for sequence 0, not the round's 3 at offsets 11 to 13");
  }
  EXPECT_TRUE(round.open());
  expect_offsets(stack.layers(), 14);
  round.cancel();
  // Intact, it rolls back as a built-in kind does.
  round.begin(2);
  const Tokens more = range(40, 3);
  const Tokens so_far = concat(prompt, verify);
  ASSERT_TRUE(stack.forward_and_check(more, concat(so_far, more)));
  round.accept(0);
  expect_offsets(stack.layers(), 15);
  const Tokens next = {7};
  ASSERT_TRUE(stack.forward_and_check(next, concat(concat(so_far, {40}), next)));
}

TEST(Speculation, ASequenceIdOutsideTheCachesRangeIsRefused) {
  HybridStack stack;
  for (const SeqId seq : {-1, SeqId{1} << 20}) {
    expect_error([&] { Speculation round(stack.layers(), seq); },
                 "Speculation: sequence id " + std::to_string(seq) + " outside [0, 1048576)");
  }
  Speculation last(stack.layers(), (SeqId{1} << 20) - 1);  // the last id caches hold
  EXPECT_FALSE(last.open());
}

// A layer whose prepare fails after earlier layers scheduled their captures: the failed begin
// cancels them, and every layer stays where it was.
class FailingPrepare final : public testing::DelegatingCache {
 public:
  using DelegatingCache::DelegatingCache;
  void prepare_snapshots(std::span<const int64_t>) override {
    throw Error("FailingPrepare: refused");
  }
};

TEST(Speculation, AFailedBeginCancelsWhatItScheduled) {
  HybridStack stack(StackOptions{.window = 2});
  const Tokens prompt = range(1, 5);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  FailingPrepare failing(stack.recurrent);  // a whole-state layer: it captures, after the window
  Speculation round({&stack.attention(), &stack.window, &failing});
  expect_error([&] { round.begin(4); }, "FailingPrepare: refused");
  EXPECT_FALSE(round.open());
  EXPECT_FALSE(stack.window.schedule_state(0).pending);
  expect_offsets(stack.layers(), 5);
  const Tokens next = {7, 8};
  ASSERT_TRUE(stack.forward_and_check(next, concat(prompt, next)));
}

// A whole-state layer whose first restore runs out of memory (the built-in kinds' restores in an
// accept allocate nothing; a kind of the caller's may).
class FailingRestore final : public testing::DelegatingCache {
 public:
  using DelegatingCache::DelegatingCache;
  bool restore(Snapshot* s, int64_t target) override {
    if (failures_++ == 0) throw std::bad_alloc();
    return DelegatingCache::restore(s, target);
  }

 private:
  int failures_ = 0;
};

// An accept that runs out after moving the window (restored before the failing layer) leaves the
// round open: the same count again moves only the layers not moved, another count is refused,
// and the stack goes on equal to recomputation.
TEST(Speculation, AnAcceptThatMovedSomeLayersFinishesWhenAskedAgain) {
  HybridStack stack(StackOptions{.window = 2});
  const Tokens prompt = range(1, 5);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  FailingRestore failing(stack.recurrent);
  Speculation round({&stack.attention(), &stack.window, &failing});
  round.begin(3);
  const Tokens verify = {20, 21, 22, 23};
  ASSERT_TRUE(stack.forward_and_check(verify, concat(prompt, verify)));
  EXPECT_THROW(round.accept(1), std::bad_alloc);
  EXPECT_TRUE(round.open());
  EXPECT_EQ(stack.window.offset(), 7);  // moved
  EXPECT_EQ(stack.recurrent.offset(), 9);
  expect_error([&] { round.accept(2); }, "accept 1 again");
  round.accept(1);
  EXPECT_FALSE(round.open());
  expect_offsets(stack.layers(), 7);
  const Tokens kept = concat(prompt, {20, 21}), next = {30, 31};
  ASSERT_TRUE(stack.forward_and_check(next, concat(kept, next)));
}

INSTANTIATE_TEST_SUITE_P(Kinds, EveryKind,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(4, 64)));

}  // namespace
}  // namespace kvsnap
