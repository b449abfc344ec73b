#include <gtest/gtest.h>
#include <kvsnap/prefix_cache.h>
#include <kvsnap/rotating_kv_cache.h>
#include <kvsnap/speculation.h>
#include <pthread.h>

#include <functional>

#include "prefix/trie.h"
#include "support/conversation.h"
#include "support/delegating_cache.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::run_turn;
using testing::throws_error;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// A system prompt, two user messages and replies; distinct token ranges.
const Tokens kSystem = tokens(100, 12);
const Tokens kUser1 = tokens(200, 6);
const Tokens kReply1 = tokens(300, 4);
const Tokens kUser2 = tokens(400, 5);
const Tokens kReply2 = tokens(500, 3);

class PrefixCacheTest : public ::testing::Test {
 protected:
  HybridStack stack;
  PrefixCache cache{stack.layers()};
};

TEST_F(PrefixCacheTest, FirstRequestEvaluatesEverything) {
  const auto turn = run_turn(cache, stack, kSystem + kUser1, kReply1);
  EXPECT_EQ(turn.cached, 0);
  EXPECT_EQ(turn.evaluated, 18);
  EXPECT_EQ(cache.stats().lookups, 1);
}

TEST_F(PrefixCacheTest, RepeatedPromptRestoresAllButTheLastToken) {
  const Tokens prompt = kSystem + kUser1;
  run_turn(cache, stack, prompt, kReply1);
  const auto again = run_turn(cache, stack, prompt, kReply1);
  EXPECT_EQ(again.cached, 17);  // a capture at the last prompt token made this possible
  EXPECT_EQ(again.evaluated, 1);
  const auto third = run_turn(cache, stack, prompt, tokens(900, 3));  // another reply
  EXPECT_EQ(third.cached, 17);
}

TEST_F(PrefixCacheTest, MultiTurnContinuationEvaluatesOnlyTheNewTokens) {
  const Tokens turn1 = kSystem + kUser1;
  run_turn(cache, stack, turn1, kReply1);
  // The last reply token was sampled but never evaluated: it is new to the caches.
  const auto turn2 = run_turn(cache, stack, turn1 + kReply1 + kUser2, kReply2);
  EXPECT_EQ(turn2.cached, 21);
  EXPECT_EQ(turn2.evaluated, 1 + 5);
  const auto turn3 =
      run_turn(cache, stack, turn1 + kReply1 + kUser2 + kReply2 + tokens(600, 4), tokens(700, 2));
  EXPECT_EQ(turn3.cached, 18 + 4 + 5 + 2);
  EXPECT_EQ(turn3.evaluated, 1 + 4);
}

TEST_F(PrefixCacheTest, SharedSystemPromptWithAUserRestorePoint) {
  const std::vector<int64_t> end_of_system{12};
  run_turn(cache, stack, kSystem + kUser1, kReply1, end_of_system);
  const auto other = run_turn(cache, stack, kSystem + tokens(800, 7), kReply2);
  EXPECT_EQ(other.cached, 12);
  EXPECT_EQ(other.evaluated, 7);
}

TEST_F(PrefixCacheTest, KVHitIsCutBackToTheDeepestRecurrentSnapshot) {
  // Without a restore point at the end of the system prompt, the KV layers could reuse 12
  // tokens but the recurrent layer has no state there: mixing offsets would garble the
  // output, so the whole request is recomputed...
  run_turn(cache, stack, kSystem + kUser1, kReply1);
  const auto second = run_turn(cache, stack, kSystem + tokens(800, 7), kReply2);
  EXPECT_EQ(second.cached, 0);
  EXPECT_EQ(cache.stats().matched_tokens, 12);
  EXPECT_EQ(cache.stats().reused_tokens, 0);
  // ... and the branch point was captured, so the next conversation restores it.
  const auto third = run_turn(cache, stack, kSystem + tokens(850, 5), kReply2);
  EXPECT_EQ(third.cached, 12);
}

TEST_F(PrefixCacheTest, KVOnlyModelsReuseAnyMatchedPrefix) {
  KVCache attention;
  PrefixCache kv_only({&attention, nullptr});
  const testing::TokenKV kv;
  auto write = [&](std::span<const int32_t> t) {
    std::vector<int64_t> ids(t.begin(), t.end());
    testing::write(attention, kv, ids);
  };
  {
    auto s = kv_only.begin(kSystem + kUser1);
    write(s.remaining());
    s.prefill_done();
  }
  auto s = kv_only.begin(kSystem + tokens(800, 7));
  EXPECT_EQ(s.cached(), 12);
}

TEST_F(PrefixCacheTest, RegenerateBranchesAtTheLastUserTurn) {
  const Tokens prompt2 = kSystem + kUser1 + kReply1 + kUser2;
  run_turn(cache, stack, kSystem + kUser1, kReply1);
  run_turn(cache, stack, prompt2, kReply2);
  const auto regenerated = run_turn(cache, stack, prompt2, tokens(950, 3));
  EXPECT_EQ(regenerated.cached, 26);
  EXPECT_EQ(regenerated.evaluated, 1);
  // Continuing the regenerated branch.
  const auto next = run_turn(cache, stack, prompt2 + tokens(950, 3) + tokens(960, 2), kReply2);
  EXPECT_EQ(next.cached, 27 + 2);
}

TEST_F(PrefixCacheTest, EditingAnEarlierTurnBranchesDeepInTheHistory) {
  const std::vector<int64_t> end_of_system{12};
  run_turn(cache, stack, kSystem + kUser1, kReply1, end_of_system);
  run_turn(cache, stack, kSystem + kUser1 + kReply1 + kUser2, kReply2);
  // Edit the first user message at its third token (offset 14).
  Tokens edited_user = kUser1;
  edited_user[2] = 999;
  const auto edited = run_turn(cache, stack, kSystem + edited_user, kReply1);
  EXPECT_EQ(edited.cached, 12);  // the deepest point every layer can restore
  EXPECT_EQ(cache.stats().matched_tokens, 0 + 21 + 14);
  // The branch point (14) was captured: a second edit there restores up to it.
  Tokens edited_again = kUser1;
  edited_again[2] = 998;
  EXPECT_EQ(run_turn(cache, stack, kSystem + edited_again, kReply1).cached, 14);
}

TEST_F(PrefixCacheTest, SwitchingBackAndForthBetweenBranches) {
  const Tokens a = kSystem + kUser1;
  const Tokens b = kSystem + tokens(800, 9);
  const std::vector<int64_t> end_of_system{12};
  run_turn(cache, stack, a, kReply1, end_of_system);
  run_turn(cache, stack, b, kReply2);
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(run_turn(cache, stack, a + kReply1 + kUser2, kReply2).cached,
              21 + (round > 0 ? 5 : 0))
        << round;
    // b's reply had 2 evaluated tokens; from the second round on the whole prompt but its last
    // token is restored.
    EXPECT_EQ(run_turn(cache, stack, b + kReply2 + kUser2, kReply1).cached, round > 0 ? 28 : 23)
        << round;
  }
}

TEST(PrefixCacheWindow, PromptsShorterThanTheWindowRestoreAnywhere) {
  // Without a recurrent layer, a window that has evicted nothing (end <= 8) can be restored to
  // any earlier offset.
  HybridStack stack(/*with_recurrent=*/false);
  PrefixCache cache(stack.layers());
  run_turn(cache, stack, tokens(10, 6), tokens(50, 2));  // nodes end at 5 and 7
  EXPECT_EQ(run_turn(cache, stack, tokens(10, 3) + tokens(60, 2), tokens(70, 2)).cached, 3);
}

TEST(PrefixCacheWindow, PromptsLongerThanTheWindowRestoreOnlyAtCaptures) {
  HybridStack stack(/*with_recurrent=*/false);
  PrefixCache cache(stack.layers());
  run_turn(cache, stack, tokens(10, 20), tokens(50, 2));
  // Diverging at 10: the window at 19 has evicted positions < 11, so nothing can be reused.
  EXPECT_EQ(run_turn(cache, stack, tokens(10, 10) + tokens(60, 4), tokens(70, 2)).cached, 0);
  // The branch point 10 was captured.
  EXPECT_EQ(run_turn(cache, stack, tokens(10, 10) + tokens(80, 4), tokens(70, 2)).cached, 10);
}

TEST_F(PrefixCacheTest, SnapshotsOfTheActivePathAreMostlyLazy) {
  run_turn(cache, stack, kSystem + kUser1, kReply1);
  // Nodes: [0, 17) and [17, 21). KV ranges and the windows (also the one at 21, in a ring
  // wrapped by decoding: two runs of its columns) still view the live caches; recurrent states
  // are owned values.
  const int64_t recurrent_state = (3 * 6 + 2 * 3 * 4) * 4;
  EXPECT_EQ(cache.paged_out_bytes(), 2 * recurrent_state);
}

TEST_F(PrefixCacheTest, EvictionKeepsPagedOutBytesUnderTheBudget) {
  HybridStack small;
  PrefixCache budgeted(small.layers(), {.max_paged_out_bytes = 4000});
  for (int32_t conversation = 0; conversation < 12; ++conversation) {
    run_turn(budgeted, small, kSystem + tokens(1000 + 100 * conversation, 10), kReply1);
    EXPECT_LE(budgeted.paged_out_bytes(), 4000);
  }
  EXPECT_GT(budgeted.stats().evicted_nodes, 0);
  // The most recent conversation is still there.
  EXPECT_EQ(run_turn(budgeted, small, kSystem + tokens(1000 + 100 * 11, 10), kReply1).cached, 21);
}

// A request that leaves the trie early rewinds the live caches below the old path, whose
// lazy snapshots name the columns its forward then overwrites. begin reserves what those
// writes copy out (and what the window ring copies), evicting first: the trie stays within its
// budget during the forward too, not only once the next call evicts.
TEST_F(PrefixCacheTest, BeginReservesWhatTheForwardCopiesOut) {
  HybridStack small(/*with_recurrent=*/false);
  constexpr int64_t kBudget = 1300;
  PrefixCache budgeted(small.layers(), {.max_paged_out_bytes = kBudget});
  const auto within_budget = [&] { ASSERT_LE(budgeted.paged_out_bytes(), kBudget); };
  const std::vector<int64_t> thirds{20, 40};
  run_turn(budgeted, small, tokens(100, 60), tokens(900, 3), thirds, within_budget);
  const int64_t evicted = budgeted.stats().evicted_nodes;
  // The live caches stand at the old path's end: no write can reach its KV ranges.
  EXPECT_EQ(small.attention().exposed_bytes(0), 0);
  // Restored to the user node at 20; the old path's ranges beyond are lazy in the columns the
  // prefill overwrites.
  const Tokens branch = tokens(100, 20) + tokens(500, 30);
  PrefixCache::Session session = budgeted.begin(branch);
  EXPECT_EQ(session.cached(), 20);
  // Evicted at begin, before the forward: what remains plus what the forward may copy out fits.
  EXPECT_GT(budgeted.stats().evicted_nodes, evicted);
  const int64_t reserved = small.attention().exposed_bytes(0) + small.window.exposed_bytes(0);
  EXPECT_LE(budgeted.paged_out_bytes() + reserved, kBudget);
  ASSERT_TRUE(small.forward_and_check(session.remaining(), branch));
  within_budget();
  session.prefill_done();
  within_budget();
  session.close();
  within_budget();
  EXPECT_EQ(budgeted.check_invariants(), "");
}

TEST_F(PrefixCacheTest, UserNodesAreEvictedLast) {
  HybridStack small;
  PrefixCache budgeted(small.layers(), {.max_paged_out_bytes = 6000});
  const std::vector<int64_t> end_of_system{12};
  run_turn(budgeted, small, kSystem + kUser1, kReply1, end_of_system);
  for (int32_t i = 0; i < 10; ++i) run_turn(budgeted, small, tokens(3000 + 100 * i, 20), kReply1);
  EXPECT_GT(budgeted.stats().evicted_nodes, 0);
  EXPECT_EQ(run_turn(budgeted, small, kSystem + tokens(800, 4), kReply1).cached, 12);
}

TEST_F(PrefixCacheTest, PromptOfOneTokenEvaluatesIt) {
  const auto turn = run_turn(cache, stack, tokens(5, 1), tokens(6, 2));
  EXPECT_EQ(turn.cached, 0);
  EXPECT_EQ(run_turn(cache, stack, tokens(5, 1), tokens(6, 2)).cached, 0);
}

TEST_F(PrefixCacheTest, EmptyPromptIsAnError) {
  EXPECT_TRUE(throws_error([&] { (void)cache.begin(Tokens{}); }, {"PrefixCache::begin", "empty"}));
}

TEST(PrefixCacheStateless, AllNullLayersTrackTokensOnly) {
  PrefixCache cache({nullptr, nullptr});
  for (int i = 0; i < 2; ++i) {
    auto session = cache.begin(tokens(1, 10));
    EXPECT_EQ(session.cached(), i == 0 ? 0 : 9);
    session.prefill_done();
    session.append_output(42);
    session.close();
  }
  EXPECT_EQ(cache.paged_out_bytes(), 0);
}

TEST_F(PrefixCacheTest, SessionMisuseIsReported) {
  auto session = cache.begin(kSystem);
  EXPECT_TRUE(throws_error([&] { (void)cache.begin(kSystem); }, {"already open"}));
  const std::vector<int64_t> outside{20};
  EXPECT_TRUE(throws_error([&] { session.schedule_snapshots(outside); },
                           {"Session::schedule_snapshots", "offset 20", "[0, 12]"}));
  EXPECT_TRUE(throws_error([&] { session.schedule_branch_points(outside); },
                           {"Session::schedule_branch_points", "offset 20", "[0, 12]"}));
  EXPECT_TRUE(throws_error([&] { session.prefill_done(); },
                           {"Session::prefill_done: the caches are at offset 0; evaluate "
                            "remaining() (12 tokens from offset 0) first"}));
  EXPECT_TRUE(throws_error([&] { session.append_output(1); }, {"prefill_done() after"}));
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), kSystem));
  const std::vector<int64_t> late{4};
  EXPECT_TRUE(throws_error([&] { session.schedule_snapshots(late); }, {"before the prefill"}));
  EXPECT_TRUE(throws_error([&] { session.schedule_branch_points(late); },
                           {"Session::schedule_branch_points", "before the prefill"}));
  session.prefill_done();
  EXPECT_TRUE(throws_error([&] { session.prefill_done(); }, {"already called"}));
  session.close();
  session.close();  // idempotent
  EXPECT_TRUE(throws_error([&] { (void)session.remaining(); }, {"Session::remaining", "closed"}));
  EXPECT_TRUE(throws_error([&] { session.append_output(1); }, {"closed"}));
  auto next = cache.begin(kSystem);  // the closed session no longer blocks
  EXPECT_EQ(next.cached(), 11);
}

// Layers a forward left at different offsets are named one by one (not as an offset of -1).
TEST_F(PrefixCacheTest, CallsBeforeTheForwardNameEachLayersOffsetWhenTheyDisagree) {
  auto session = cache.begin(kSystem);
  testing::write(stack.window, testing::TokenKV{.heads = 2, .depth = 4}, testing::id_range(0, 3));
  const char* both =
      "the caches are at different offsets (layer 0 at 0, layer 1 at 3, layer 3 at 0)";
  EXPECT_TRUE(throws_error([&] { session.prefill_done(); }, {"Session::prefill_done: ", both}));
  const std::vector<int64_t> at{4};
  EXPECT_TRUE(throws_error([&] { session.schedule_snapshots(at); },
                           {"Session::schedule_snapshots: call before the prefill forward (", both,
                            ", the session restored 0)"}));
}

TEST_F(PrefixCacheTest, DestroyingASessionClosesIt) {
  {
    auto session = cache.begin(kSystem);
    ASSERT_TRUE(stack.forward_and_check(session.remaining(), kSystem));
    session.prefill_done();
  }
  EXPECT_EQ(cache.begin(kSystem).cached(), 11);
}

TEST_F(PrefixCacheTest, CachesMovedBehindItsBackAreResynchronized) {
  run_turn(cache, stack, kSystem + kUser1, kReply1);
  stack.attention().reset();  // someone else touched a layer
  const auto turn = run_turn(cache, stack, kSystem + kUser1 + kReply1, kReply2);
  EXPECT_EQ(turn.cached, 21);  // restored from the trie, not the live caches
}

TEST(PrefixCacheLifetime, CachesMayBeDestroyedBeforeThePrefixCache) {
  auto stack = std::make_unique<HybridStack>();
  PrefixCache cache(stack->layers());
  run_turn(cache, *stack, kSystem + kUser1, kReply1);
  const int64_t before = cache.paged_out_bytes();
  stack.reset();  // the caches copy their lazy snapshots out; the trie keeps them
  EXPECT_GT(cache.paged_out_bytes(), before);
  EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(PrefixCacheWindow, AWindowOfOneDoesNotDisableReuse) {
  // The window-1 layer's state at any offset > 0 is empty: an empty snapshot, still a restore
  // point for the whole stack.
  HybridStack stack(/*with_recurrent=*/true, /*window_size=*/1);
  PrefixCache cache(stack.layers());
  const Tokens prompt = tokens(10, 10);
  EXPECT_EQ(run_turn(cache, stack, prompt, tokens(50, 3)).cached, 0);
  EXPECT_EQ(run_turn(cache, stack, prompt, tokens(60, 3)).cached, 9);
  // The first turn's reply (50, 51 evaluated) was paged out with a restore point at its end.
  EXPECT_EQ(run_turn(cache, stack, prompt + tokens(50, 2) + tokens(70, 4), tokens(80, 2)).cached,
            12);
}

TEST(PrefixCacheLifetime, ASessionMayOutliveItsPrefixCache) {
  HybridStack stack;
  auto cache = std::make_unique<PrefixCache>(stack.layers());
  PrefixCache::Session session = cache->begin(kSystem);
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), kSystem));
  cache.reset();  // the session is detached, not dangling
  EXPECT_TRUE(throws_error([&] { session.prefill_done(); },
                           {"Session::prefill_done", "PrefixCache", "destroyed"}));
  EXPECT_TRUE(throws_error([&] { (void)session.remaining(); }, {"destroyed"}));
  EXPECT_TRUE(throws_error([&] { session.append_output(1); }, {"destroyed"}));
  session.close();  // a no-op, as is the destructor
  PrefixCache::Session moved = std::move(session);
  EXPECT_TRUE(throws_error([&] { (void)moved.cached(); }, {"destroyed"}));
}

// A PrefixCache destroyed while its session is in prefill (captures scheduled on every layer)
// leaves no schedule behind: the layers rewind and take schedules of their own again, the
// session's content stays.
TEST(PrefixCacheLifetime, ADetachedSessionLeavesNoCapturesScheduledOnTheLayers) {
  HybridStack stack;
  auto cache = std::make_unique<PrefixCache>(stack.layers());
  PrefixCache::Session session = cache->begin(kSystem + kUser1);  // captures at the message end
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), kSystem + kUser1));
  const auto end = static_cast<int64_t>((kSystem + kUser1).size());
  ASSERT_TRUE(stack.attention().schedule_state(0).pending);
  cache.reset();
  for (Cache* layer : stack.layers()) {
    if (layer == nullptr) continue;
    EXPECT_EQ(layer->offset(), end);
    EXPECT_FALSE(layer->schedule_state(0).pending);
    const std::vector<int64_t> at{end + 1};
    EXPECT_NO_THROW(layer->prepare_snapshots(at));
    layer->cancel_snapshots();
  }
  EXPECT_TRUE(stack.attention().restore(nullptr, 3));  // a rewind: refused while scheduled
  session.close();
}

// A prefilling session detached from its PrefixCache cancels its own schedules only: one that
// someone else put in its place, of the same offsets, stays.
TEST(PrefixCacheLifetime, ADetachedSessionLeavesAScheduleOfTheSameOffsetsAlone) {
  HybridStack stack;
  auto cache = std::make_unique<PrefixCache>(stack.layers());
  PrefixCache::Session session = cache->begin(kSystem + kUser1);
  const ScheduleState own = stack.recurrent.schedule_state(0);
  ASSERT_TRUE(own.pending);
  ASSERT_LE(own.count, 2);
  std::vector<int64_t> offsets{own.first};
  if (own.count == 2) offsets.push_back(own.last);
  stack.recurrent.cancel_snapshots(0);
  stack.recurrent.prepare_snapshots(0, offsets);  // someone else's
  cache.reset();
  EXPECT_TRUE(stack.recurrent.schedule_state(0).pending);     // theirs, left
  EXPECT_FALSE(stack.attention().schedule_state(0).pending);  // the session's own, cancelled
  stack.recurrent.cancel_snapshots(0);
  session.close();
}

// After prefill_done the layers' schedules are their callers': a Speculation round open when
// the PrefixCache goes keeps its captures and still rolls back.
TEST(PrefixCacheLifetime, ADetachedSessionLeavesASpeculationRoundAlone) {
  HybridStack stack;  // the window and recurrent layers capture in a round
  auto cache = std::make_unique<PrefixCache>(stack.layers());
  const Tokens prompt = tokens(100, 20);
  PrefixCache::Session session = cache->begin(prompt);
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), prompt));
  session.prefill_done();
  session.append_output(7);
  Speculation round(stack.layers());
  round.begin(3);
  const Tokens verify = Tokens{7} + tokens(900, 3);
  ASSERT_TRUE(stack.forward_and_check(verify, prompt + verify));
  cache.reset();
  EXPECT_TRUE(stack.recurrent.schedule_state(0).pending);  // the round's, not the session's
  EXPECT_NO_THROW(round.accept(1));
  EXPECT_EQ(stack.offset(), 22);
  ASSERT_TRUE(stack.forward_and_check(Tokens{901}, prompt + Tokens{7, 900, 901}));
}

// A session closed, then its PrefixCache destroyed, then used or destroyed: closed, not a
// dangling pointer to the destroyed cache's lock (which a closed session kept before).
TEST(PrefixCacheLifetime, AClosedSessionMayOutliveItsPrefixCache) {
  HybridStack stack;
  auto cache = std::make_unique<PrefixCache>(stack.layers());
  PrefixCache::Session session = cache->begin(kSystem);
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), kSystem));
  session.prefill_done();
  session.close();
  cache.reset();
  EXPECT_TRUE(throws_error([&] { (void)session.cached(); }, {"Session::cached", "closed"}));
  EXPECT_TRUE(throws_error([&] { session.append_output(1); }, {"closed"}));
  session.close();  // a no-op, as is the destructor
}

// Evaluates prompt[from, to) in one forward, checked against recomputation.
void evaluate(HybridStack& stack, const Tokens& prompt, size_t from, size_t to) {
  const Tokens prefix(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(to));
  ASSERT_TRUE(stack.forward_and_check(std::span(prefix).subspan(from), prefix));
}

TEST_F(PrefixCacheTest, ClosingInTheMiddleOfThePrefillKeepsThePassedCaptures) {
  const Tokens prompt = tokens(1, 6);
  {
    auto session = cache.begin(prompt);
    session.schedule_snapshots(std::vector<int64_t>{3});
    evaluate(stack, prompt, 0, 4);
    session.close();  // without prefill_done: the capture at 3 was passed
  }
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_EQ(run_turn(cache, stack, tokens(1, 3) + Tokens{7, 8}, tokens(50, 2)).cached, 3);
}

TEST_F(PrefixCacheTest, ACancelledLongPrefillRestoresTheLastCaptureBeforeADivergence) {
  const Tokens prompt = tokens(1, 47);
  {
    auto session = cache.begin(prompt);
    session.schedule_snapshots(std::vector<int64_t>{8, 16});
    evaluate(stack, prompt, 0, 10);  // chunked prefill, cancelled after two chunks
    evaluate(stack, prompt, 10, 20);
  }  // the destructor closes it
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_EQ(run_turn(cache, stack, tokens(1, 12) + tokens(90, 3), tokens(50, 2)).cached, 8);
}

TEST(PrefixCacheCopies, ABranchCopiesOnlyWhatItsWriteOverwrites) {
  // The peer suite's case: one KVCache, 64 bytes per token. A = 1..8, then B = 1..4, 20..23.
  // Only [4, 8) is overwritten: [0, 4) stays lazy in the live buffer.
  KVCache cache;
  const testing::TokenKV kv{.heads = 2, .depth = 4};
  PrefixCache prefix({&cache});
  const auto run = [&](const Tokens& prompt) {
    auto session = prefix.begin(prompt);
    const auto remaining = session.remaining();
    const std::vector<int64_t> ids(remaining.begin(), remaining.end());
    testing::write(cache, kv, ids);
    session.prefill_done();
    session.close();
  };
  run(tokens(1, 8));
  const int64_t copied = cache.copy_stats().materialized_bytes;
  EXPECT_EQ(prefix.paged_out_bytes(), 0);  // everything is lazy in the live buffer
  run(tokens(1, 4) + tokens(20, 4));
  EXPECT_EQ(cache.copy_stats().materialized_bytes - copied, 256);
  EXPECT_EQ(prefix.paged_out_bytes(), 256);
  EXPECT_EQ(prefix.check_invariants(), "");
  // Both branches still restore exactly.
  auto again = prefix.begin(tokens(1, 8));
  EXPECT_EQ(again.cached(), 7);
  EXPECT_EQ(testing::column_ids(cache.view(Batch{})), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}));
}

TEST_F(PrefixCacheTest, DebugStringShowsTheTrie) {
  const std::vector<int64_t> end_of_system{12};
  run_turn(cache, stack, kSystem + kUser1, kReply1, end_of_system);
  const std::string dump = cache.debug_string();
  EXPECT_NE(dump.find("[0, 12) 100 101"), std::string::npos) << dump;
  EXPECT_NE(dump.find("user"), std::string::npos) << dump;
  EXPECT_EQ(cache.node_count(), 3);
}

// A recurrent cache that runs out of memory on demand: when scheduling captures, or taking them.
class RunsOut final : public testing::DelegatingCache {
 public:
  using DelegatingCache::DelegatingCache;
  bool fail_prepare = false, fail_take = false;
  void prepare_snapshots(std::span<const int64_t> o) override {
    if (fail_prepare) throw std::bad_alloc();
    inner_.prepare_snapshots(o);
  }
  std::vector<SnapshotPtr> take_snapshots() override {
    if (fail_take) throw std::bad_alloc();
    return inner_.take_snapshots();
  }
  std::vector<SnapshotPtr> take_reached_snapshots() override {
    if (fail_take) throw std::bad_alloc();
    return inner_.take_reached_snapshots();
  }
};

// A begin or close that fails midway (out of memory scheduling or taking captures) ends its
// session: the slot is not left open with no handle to close it — the next begin succeeds and
// restores what the trie holds.
TEST(PrefixCacheFailures, ABeginOrCloseThatFailsMidwayLeavesTheSlotUsable) {
  const testing::RecurrentLayer layer;
  RecurrentCache inner = layer.make_cache();
  RunsOut cache(inner);
  PrefixCache prefix({&cache});
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  cache.fail_prepare = true;
  EXPECT_THROW((void)prefix.begin(prompt), std::bad_alloc);
  cache.fail_prepare = false;
  {
    PrefixCache::Session session = prefix.begin(prompt);  // not "a session already open"
    layer.forward(inner, testing::id_range(0, 5));
    cache.fail_take = true;
    EXPECT_THROW(session.close(), std::bad_alloc);
    cache.fail_take = false;
  }
  PrefixCache::Session again = prefix.begin(prompt);
  EXPECT_EQ(again.cached(), 0);  // nothing was kept from the failed close
  EXPECT_EQ(inner.offset(), 0);
  layer.forward(inner, testing::id_range(0, 5));
  again.close();
  EXPECT_EQ(prefix.begin(prompt).cached(), 4);  // the trie holds the prompt (less one token)
}

// A cache kind whose split refuses null (cache.h promises null in, null out for merge only).
class SplitsOnlySnapshots final : public testing::DelegatingCache {
 public:
  using DelegatingCache::DelegatingCache;
  int64_t splits = 0;
  std::pair<SnapshotPtr, SnapshotPtr> split(SnapshotPtr s, int64_t at) override {
    if (s == nullptr) throw Error("SplitsOnlySnapshots::split: null");
    ++splits;
    return inner_.split(std::move(s), at);
  }
};

// A node split where a layer holds no snapshot (a whole-state layer's that was dropped, or never
// captured there) asks that layer's cache nothing: a custom kind need not take null.
TEST(PrefixCacheFailures, ASplitWhereALayerHoldsNothingAsksItsCacheNothing) {
  KVCache kv;
  RotatingKVCache window(8);
  SplitsOnlySnapshots wrapped(window);
  detail::Trie trie({detail::LayerInfo{&kv, kv.restore_rule()},
                     detail::LayerInfo{&wrapped, wrapped.restore_rule()}});
  const std::vector<int64_t> ids = testing::id_range(100, 10);
  testing::write(kv, testing::TokenKV{}, ids);
  std::vector<SnapshotPtr> ranged(2), whole(2);
  ranged[0] = kv.snapshot(0);
  const std::vector<int32_t> prompt(ids.begin(), ids.end());
  detail::Node& node = trie.insert(prompt, 0, 10, std::move(ranged), std::move(whole), false);
  detail::Node& upper = trie.split(node, 4);  // the window layer holds nothing here
  EXPECT_EQ(wrapped.splits, 0);
  EXPECT_EQ(upper.end, 4);
  ASSERT_NE(upper.snapshots[0], nullptr);
  ASSERT_NE(node.snapshots[0], nullptr);
  EXPECT_EQ(upper.snapshots[1], nullptr);
  EXPECT_EQ(node.snapshots[1], nullptr);
  EXPECT_EQ(upper.snapshots[0]->to(), 4);
  EXPECT_EQ(node.snapshots[0]->from(), 4);
  EXPECT_EQ(trie.check_invariants(), "");
}

// A trie as deep as it has nodes (a restore point at every token of a long prompt) is checked,
// printed and freed without recursing: here on a thread with a small stack, where a recursion
// per level would overflow it.
TEST(PrefixCacheDepth, ADeepTrieIsWalkedAndFreedWithoutRecursing) {
  constexpr int64_t kDepth = 4000;
  auto cache = std::make_unique<KVCache>();
  auto prefix = std::make_unique<PrefixCache>(std::vector<Cache*>{cache.get()});
  std::vector<int32_t> prompt(kDepth + 1);
  for (int64_t i = 0; i <= kDepth; ++i) prompt[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  {
    PrefixCache::Session session = prefix->begin(prompt);
    std::vector<int64_t> every(kDepth - 1);
    for (int64_t i = 0; i < kDepth - 1; ++i) every[static_cast<size_t>(i)] = i + 1;
    session.schedule_snapshots(every);
    testing::write(*cache, testing::TokenKV{}, testing::id_range(0, kDepth + 1));
    session.prefill_done();
  }
  ASSERT_GE(prefix->node_count(), kDepth - 1);
  std::string problem = "not run";
  size_t printed = 0;
  std::function<void()> walk = [&] {
    problem = prefix->check_invariants();
    printed = prefix->debug_string().size();
    prefix.reset();
  };
  pthread_attr_t attributes;
  pthread_attr_init(&attributes);
  pthread_attr_setstacksize(&attributes, size_t{256} << 10);
  pthread_t small;
  ASSERT_EQ(pthread_create(
                &small, &attributes,
                [](void* f) -> void* {
                  (*static_cast<std::function<void()>*>(f))();
                  return nullptr;
                },
                &walk),
            0);
  pthread_join(small, nullptr);
  pthread_attr_destroy(&attributes);
  EXPECT_EQ(problem, "");
  EXPECT_GT(printed, 0u);
  EXPECT_EQ(prefix, nullptr);
}

}  // namespace
}  // namespace kvsnap
