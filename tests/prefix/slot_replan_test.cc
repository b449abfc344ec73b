// PrefixCache::begin's replanning (src/prefix/slot.cc): when the eviction that makes room for a
// switch changes the trie, begin plans again from the trie's latest state, round after round.
//
// Nothing public counts the rounds. Each scenario below is built so that a plan made before a
// round's eviction is stale after it: it matched through a node that eviction removed, or misses
// the upper half of a node it split. What only the latest plan reports is the tokens matched
// (PrefixCache::Stats::matched_tokens: the trie's, as the session begins). Cutting the loop
// short fails that check: after one round, in the two- and three-round tests; after two, in the
// three-round ones (whose stale plans also touch a freed node). Whatever the rounds, the session
// must restore what it reports, equal recomputation, and keep the trie within its budget through
// the forwards that follow; the budget sweep checks that over one, two and three rounds.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include "support/conversation.h"

namespace kvsnap::slot_replan_test {
namespace {

using testing::HybridStack;
using testing::StackOptions;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// begin on `slot`, the prefill forward checked against recomputation, prefill_done: the session
// stays open (decoding).
PrefixCache::Session prefill(PrefixCache& cache, HybridStack& stack, SeqId slot,
                             const Tokens& prompt) {
  PrefixCache::Session session = cache.begin(slot, prompt);
  EXPECT_TRUE(stack.forward_and_check(session.remaining(), prompt, slot));
  session.prefill_done();
  return session;
}

// What one begin added to the counters.
struct Counted {
  int64_t matched = 0, reused = 0, evicted = 0;
};
Counted since(const PrefixCache::Stats& before, const PrefixCache::Stats& after) {
  return {after.matched_tokens - before.matched_tokens, after.reused_tokens - before.reused_tokens,
          after.evicted_nodes - before.evicted_nodes};
}

// Slot 0 (`other`, decoding 7) and slot 1 (`session`, decoding q) each decode a token in one
// batch, equal to recomputation, the trie within `budget`; then both close.
void decode_both_and_close(PrefixCache& cache, HybridStack& stack, PrefixCache::Session& other,
                           PrefixCache::Session& session, const Tokens& q, int64_t budget) {
  other.append_output(21);
  session.append_output(22);
  ASSERT_TRUE(stack.forward_rows_and_check(
      {{0, Tokens{21}, Tokens{7, 21}}, {1, Tokens{22}, q + Tokens{22}}}));
  EXPECT_LE(cache.peak_paged_out_bytes(), budget) << cache.debug_string();
  session.close();
  other.close();
  EXPECT_EQ(cache.check_invariants(), "") << cache.debug_string();
}

// Two rounds. One slot; its first request leaves p's node [0, 39) (a restore point at 39) and
// the reply's [39, 43), both lazy in the live caches. q follows p one token into the reply's node,
// then leaves it: the first plan matches 40 tokens through both nodes and restores to 39 (no
// layer but the KV one can stop at 40), so it pins [0, 39) only. Rewinding to 39 exposes the
// reply's range, which the budget cannot also hold: the first round evicts [39, 43), a node the
// plan matched through. The second round plans from the trie as it is now (39 tokens matched,
// the same restore) and evicts nothing.
TEST(SlotReplan, ANodeThePlanMatchedThroughIsEvictedAndTheSecondRoundPlansWithoutIt) {
  HybridStack stack;
  // Holds what p's turn leaves (two recurrent states, 336 bytes), not also what a rewind to 39
  // exposes. (Below ~600 bytes the first turn drops the restore point at 39; above ~1480 this
  // begin evicts nothing.)
  const int64_t budget = 16 * stack.token_bytes();
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget});
  const Tokens p = tokens(100, 40);
  testing::run_turn(cache, stack, p, tokens(300, 4));
  ASSERT_EQ(cache.node_count(), 2) << cache.debug_string();
  const Tokens q = p + tokens(900, 5);
  ASSERT_EQ(cache.match(q), 39);  // through [39, 43) (40 tokens), restoring at 39
  const PrefixCache::Stats before = cache.stats();

  PrefixCache::Session session = cache.begin(q);
  const Counted counted = since(before, cache.stats());
  EXPECT_EQ(session.cached(), 39);
  EXPECT_EQ(counted.reused, 39);
  EXPECT_EQ(counted.evicted, 1);
  // The trie holds 39 of q's tokens now: the first plan's 40 were matched through the node the
  // first round evicted.
  EXPECT_EQ(counted.matched, 39);
  EXPECT_EQ(cache.node_count(), 1) << cache.debug_string();
  EXPECT_LE(cache.paged_out_bytes(), budget);
  EXPECT_EQ(cache.check_invariants(), "");

  cache.reset_peak_paged_out_bytes();
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), q));
  EXPECT_LE(cache.peak_paged_out_bytes(), budget);
  session.prefill_done();
  session.append_output(7);
  ASSERT_TRUE(stack.forward_and_check(Tokens{7}, q + Tokens{7}));
  session.close();
  EXPECT_LE(cache.paged_out_bytes(), budget);
  EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
  EXPECT_EQ(cache.check_invariants(), "") << cache.debug_string();
  // A later request over p is served as the trie now stands, equal to recomputation.
  testing::run_turn(cache, stack, p + tokens(500, 3), tokens(600, 2));
  EXPECT_LE(cache.paged_out_bytes(), budget);
}

// The scenario of the three-round tests: slot 1 served p = 7 8 9 10 11 (its nodes [0, 4) and
// [4, 5), lazy in slot 1's caches); slot 0 then began the one-token prompt 7 and is decoding:
// its tokens end inside [0, 4), a partly live tip. Returns slot 0's session.
PrefixCache::Session partly_live_tip(PrefixCache& cache, HybridStack& stack) {
  const Tokens p{7, 8, 9, 10, 11};
  prefill(cache, stack, 1, p).close();
  PrefixCache::Session other = prefill(cache, stack, 0, Tokens{7});
  EXPECT_EQ(cache.node_count(), 2) << cache.debug_string();
  return other;
}

// Three rounds. Slot 1 begins q = 7 8: the prompt's last token is evaluated, so it restores to
// 1 (the window, which has evicted nothing, rewinds in place), and q's match runs through [0, 4).
// Round 1 pins [0, 4) and evicts [4, 5); rewinding to 1 still exposes [0, 4)'s tail in slot 1's
// caches, so it re-points slot 0's path, splitting [0, 4) where slot 0's tokens end: [0, 1) and
// [1, 4), which the pin of round 1 (taken on the node before the split) still covers. Round 2
// plans again — through [0, 1) and [1, 4), 2 tokens — and pins only [0, 1): it evicts [1, 4),
// a node it matched through. Round 3 plans through [0, 1) alone (1 token) and changes nothing.
// Two rounds would report round 2's 2 matched tokens (through the freed [1, 4)); one, round 1's
// 2 (through [1, 4) without [0, 1)), the eviction at begin's end then removing [1, 4) all the same.
// No budget but a paged layer's one block (a live tail it shares with the trie's [0, 1) may
// leave that to the trie): everything else is evicted.
void three_rounds(bool paged) {
  SCOPED_TRACE(paged ? "paged" : "contiguous");
  HybridStack stack(StackOptions{.with_recurrent = false, .paged = paged});
  const int64_t budget = paged ? 4 * stack.token_bytes() : 0;
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget, .slots = 2});
  PrefixCache::Session other = partly_live_tip(cache, stack);
  const Tokens q{7, 8};
  ASSERT_EQ(cache.match(1, q), 1);
  const PrefixCache::Stats before = cache.stats();

  PrefixCache::Session session = cache.begin(1, q);
  const Counted counted = since(before, cache.stats());
  EXPECT_EQ(session.cached(), 1);
  EXPECT_EQ(counted.reused, 1);
  EXPECT_EQ(counted.matched, 1);  // [1, 4), through which round 2 matched 8, is gone
  EXPECT_EQ(counted.evicted, 2);  // [4, 5) in round 1, [1, 4) in round 2
  EXPECT_EQ(cache.node_count(), 1) << cache.debug_string();
  EXPECT_LE(cache.paged_out_bytes(), budget);
  EXPECT_EQ(cache.check_invariants(), "");

  cache.reset_peak_paged_out_bytes();
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), q, 1));
  EXPECT_LE(cache.peak_paged_out_bytes(), budget) << cache.debug_string();
  session.prefill_done();
  decode_both_and_close(cache, stack, other, session, q, budget);
  EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
}

TEST(SlotReplan, ASplitOfAnotherSlotsTipUnderThePinTakesThreeRounds) { three_rounds(false); }
TEST(SlotReplan, ASplitOfAnotherSlotsTipUnderThePinTakesThreeRoundsPaged) { three_rounds(true); }

// The same switch under every budget from none to one that evicts nothing (one round, two or
// three, as the budget has it): the session restores what it says and equals recomputation, and
// the trie is within the budget after begin and through the forwards that follow.
TEST(SlotReplan, EveryBudgetKeepsTheSwitchWithinItAndEqualToRecomputation) {
  for (const bool paged : {false, true}) {
    HybridStack probe(StackOptions{.with_recurrent = false, .paged = paged});
    // Paged: below a block, the block a live tail shares may keep the trie over.
    const int64_t lowest = paged ? 4 * probe.token_bytes() : 0;
    for (int64_t budget = lowest; budget <= 20 * probe.token_bytes(); budget += 8) {
      SCOPED_TRACE(::testing::Message()
                   << (paged ? "paged" : "contiguous") << ", budget " << budget);
      HybridStack stack(StackOptions{.with_recurrent = false, .paged = paged});
      PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget, .slots = 2});
      PrefixCache::Session other = partly_live_tip(cache, stack);
      const Tokens q{7, 8};
      const PrefixCache::Stats before = cache.stats();
      PrefixCache::Session session = cache.begin(1, q);
      const Counted counted = since(before, cache.stats());
      EXPECT_EQ(session.cached(), 1);
      EXPECT_GE(counted.matched, 1);
      EXPECT_LE(counted.matched, 2);
      EXPECT_LE(cache.paged_out_bytes(), budget);
      cache.reset_peak_paged_out_bytes();
      ASSERT_TRUE(stack.forward_and_check(session.remaining(), q, 1));
      EXPECT_LE(cache.peak_paged_out_bytes(), budget) << cache.debug_string();
      session.prefill_done();
      decode_both_and_close(cache, stack, other, session, q, budget);
    }
  }
}

// The budget drops an active path's restore points only when nothing else is left. Slot 1
// served p = 7 .. 12 with a restore point at 2: nodes [0, 2), [2, 5), [5, 6). Slot 0 restored
// 7 8 9 and is decoding: its tokens end inside [2, 5). Slot 1 begins q = 7 8 9 99 (restoring 3,
// as the window rewinds in place). Round 1 pins [2, 5), evicts [5, 6), and re-pointing slot 0's
// path splits [2, 5) at 3: the pin, taken on the node before the split, now covers the tail
// [3, 5), which no plan needs. The round must not drop the restore point at 2 from slot 0's path
// for it (it did, before: budgets of 2-4 or 5-9 tokens' KV lost it); round 2 evicts the tail.
TEST(SlotReplan, AStalePinAfterASplitDropsNoRestorePointOfAnotherSlot) {
  HybridStack stack(StackOptions{.with_recurrent = false});
  const int64_t budget = 6 * stack.token_bytes();
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget, .slots = 2});
  const Tokens p = tokens(7, 6);
  {
    PrefixCache::Session first = cache.begin(1, p);
    first.schedule_branch_points(std::vector<int64_t>{2});
    ASSERT_TRUE(stack.forward_and_check(first.remaining(), p, 1));
    first.prefill_done();
  }
  PrefixCache::Session other = prefill(cache, stack, 0, tokens(7, 3));
  ASSERT_EQ(cache.node_count(), 3) << cache.debug_string();
  const Tokens diverging_at_2 = tokens(7, 2) + tokens(50, 2);
  ASSERT_EQ(cache.match(diverging_at_2), 2);
  const PrefixCache::Stats before = cache.stats();

  const Tokens q = tokens(7, 3) + Tokens{99};
  PrefixCache::Session session = cache.begin(1, q);
  EXPECT_EQ(session.cached(), 3);
  EXPECT_LE(cache.paged_out_bytes(), budget);
  EXPECT_EQ(cache.stats().dropped_snapshots - before.dropped_snapshots, 0);
  EXPECT_EQ(cache.match(diverging_at_2), 2) << cache.debug_string();
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), q, 1));
  EXPECT_LE(cache.paged_out_bytes(), budget);
}

}  // namespace
}  // namespace kvsnap::slot_replan_test
