// The byte budget of a PrefixCache serving several slots holds between calls too: each call
// reserves what the open sessions' forwards may copy into the trie's lazy snapshots, and
// nothing else — not idle slots, whose caches nobody writes, nor captures that never enter the
// trie (a Speculation round's).
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include "support/conversation.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::StackOptions;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// Slot 1 stands on nodes whose KV snapshots are lazy in slot 0's caches (it restored them
// from there), right after its prefill or while decoding (its caches then stand past the tokens
// it recorded). Slot 0 then starts an unrelated request, whose forward overwrites those columns.
// The nodes cannot be evicted (slot 1's active path), but slot 1's caches hold the same data:
// they are re-pointed there before the forward, and nothing is copied out.
void another_slot_stands_on_our_nodes(bool decoding) {
  HybridStack stack(/*with_recurrent=*/false);
  constexpr int64_t kBudget = 2000;
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = kBudget, .slots = 2});
  const Tokens p = tokens(100, 60);
  {
    PrefixCache::Session first = cache.begin(0, p);
    ASSERT_TRUE(stack.forward_and_check(first.remaining(), p, 0));
    first.prefill_done();
  }
  Tokens longer = p + tokens(300, 5);
  PrefixCache::Session standing = cache.begin(1, longer);
  EXPECT_EQ(standing.cached(), 60);
  ASSERT_TRUE(stack.forward_and_check(standing.remaining(), longer, 1));
  standing.prefill_done();
  if (decoding) {
    standing.append_output(7);
    longer.push_back(7);
    ASSERT_TRUE(stack.forward_and_check(Tokens{7}, longer, 1));
  }
  const Tokens other = tokens(500, 60);
  PrefixCache::Session next = cache.begin(0, other);
  EXPECT_EQ(stack.attention().exposed_bytes(0), 0);  // nothing lazy left where slot 0 writes
  const int64_t copied = stack.attention().copy_stats().materialized_bytes;
  ASSERT_TRUE(stack.forward_and_check(next.remaining(), other, 0));
  EXPECT_EQ(stack.attention().copy_stats().materialized_bytes, copied);
  EXPECT_LE(cache.paged_out_bytes(), kBudget);
  next.prefill_done();
  EXPECT_LE(cache.paged_out_bytes(), kBudget);
  EXPECT_EQ(cache.stats().dropped_snapshots, 0);  // re-pointing was enough
  // Slot 1 still restores its prefix from the trie.
  standing.close();
  next.close();
  EXPECT_EQ(cache.match(1, p + tokens(900, 1)), 60);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(PrefixCacheBudget, NodesLazyInAnotherSlotsCachesMoveToTheSlotStandingOnThem) {
  another_slot_stands_on_our_nodes(/*decoding=*/false);
}
TEST(PrefixCacheBudget, NodesMoveToASlotThatIsDecoding) {
  another_slot_stands_on_our_nodes(/*decoding=*/true);
}

// Slot 0's prefill_done splits a node whose KV data is lazy in slot 1's caches and was partly
// copied out: the half it gives back is exposed in slot 1's caches again, which slot 1's next
// forward overwrites. prefill_done reserves it for every slot, so at any budget the trie stays
// within it through that forward.
TEST(PrefixCacheBudget, ANodeSplitByAnotherSlotIsReservedAgain) {
  const auto run = [](int64_t budget) {
    HybridStack stack(StackOptions{.check_copies = false});
    PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget, .slots = 2});
    const Tokens p = tokens(100, 20);
    {
      PrefixCache::Session s = cache.begin(1, p);
      s.schedule_snapshots(std::vector<int64_t>{5});
      EXPECT_TRUE(stack.forward_and_check(s.remaining(), p, 1));
      s.prefill_done();
    }
    const Tokens q = Tokens(p.begin(), p.begin() + 5) + tokens(700, 10);
    PrefixCache::Session b = cache.begin(1, q);
    const int64_t cached = b.cached();  // 5, unless the budget evicted the node ending there
    EXPECT_TRUE(stack.forward_and_check(Tokens(q.begin() + cached, q.begin() + 8),
                                        Tokens(q.begin(), q.begin() + 8), 1));  // a first chunk
    const Tokens r = Tokens(p.begin(), p.begin() + 12) + tokens(900, 3);
    PrefixCache::Session a = cache.begin(0, r);
    EXPECT_TRUE(stack.forward_and_check(a.remaining(), r, 0));
    a.prefill_done();
    a.append_output(42);
    EXPECT_TRUE(stack.forward_rows_and_check(
        {{1, Tokens(q.begin() + 8, q.end()), q}, {0, Tokens{42}, r + Tokens{42}}}));
    return cache.paged_out_bytes();
  };
  for (int64_t budget = 2400; budget <= 4000; budget += 8) {
    ASSERT_LE(run(budget), budget) << "budget " << budget;
  }
}

// Slot 1's prompt ends inside a node whose KV range is lazy in slot 0's caches: its path's tip
// is only partly live, so the range can be neither pointed at slot 1's caches (they hold only
// its head) nor evicted (slot 1 stands on it). Slot 0 then starts an unrelated request, whose
// forward overwrites those columns. The tip is split where slot 1's tokens end: the head moves
// to slot 1's caches, the tail is evicted, and slot 0's forward copies nothing into the trie.
// (Without the split the whole tail, most of a 40-token range, was copied out past the budget.)
void a_prompt_ends_inside_a_node(int64_t budget, bool decoding) {
  SCOPED_TRACE(::testing::Message() << "budget " << budget << (decoding ? ", decoding" : ""));
  HybridStack stack;
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget, .slots = 2});
  // What one call may leave above the budget: one snapshot, here at most a few tokens' worth
  // (the window's restore point holds 7), far less than the tail of the 40-token range.
  const int64_t slack = 8 * stack.token_bytes();
  const auto within = [&](const char* after) {
    EXPECT_LE(cache.paged_out_bytes(), budget + slack) << "after " << after;
    EXPECT_EQ(cache.check_invariants(), "") << "after " << after;
  };
  const Tokens p = tokens(100, 40);
  {
    PrefixCache::Session first = cache.begin(0, p);
    ASSERT_TRUE(stack.forward_and_check(first.remaining(), p, 0));
    first.prefill_done();
    within("slot 0's first prefill_done");
  }
  within("slot 0's first close");
  Tokens q(p.begin(), p.begin() + 6);
  PrefixCache::Session standing = cache.begin(1, q);
  within("slot 1's begin");
  ASSERT_TRUE(stack.forward_and_check(standing.remaining(), q, 1));
  within("slot 1's prefill");
  standing.prefill_done();
  within("slot 1's prefill_done");
  if (decoding) {
    standing.append_output(7);
    q.push_back(7);
    within("slot 1's append_output");
    ASSERT_TRUE(stack.forward_and_check(Tokens{7}, q, 1));
    within("slot 1's decode step");
  }
  const Tokens other = tokens(500, 40);
  PrefixCache::Session next = cache.begin(0, other);
  within("slot 0's second begin");
  EXPECT_EQ(stack.attention().exposed_bytes(0), 0);  // nothing lazy left where slot 0 writes
  ASSERT_TRUE(stack.forward_and_check(next.remaining(), other, 0));
  within("slot 0's second prefill");
  next.prefill_done();
  within("slot 0's second prefill_done");
  next.append_output(9);
  within("slot 0's append_output");
  ASSERT_TRUE(stack.forward_and_check(Tokens{9}, other + Tokens{9}, 0));
  within("slot 0's decode step");
  if (decoding) {
    standing.append_output(8);
    within("slot 1's second append_output");
    ASSERT_TRUE(stack.forward_and_check(Tokens{8}, q + Tokens{8}, 1));
    within("slot 1's second decode step");
  }
  standing.close();
  within("slot 1's close");
  next.close();
  within("slot 0's second close");
  // Slot 1's prompt still restores (as far as the budget kept its restore points): from the
  // live caches at least, as recomputation would give.
  PrefixCache::Session again = cache.begin(1, q + Tokens{11});
  EXPECT_TRUE(stack.forward_and_check(again.remaining(), q + Tokens{11}, 1));
  within("slot 1's last begin");
}

TEST(PrefixCacheBudget, APartlyLiveTipIsSplitAndItsTailEvicted) {
  for (const int64_t budget : {0, 300, 1000, 2000}) {
    a_prompt_ends_inside_a_node(budget, /*decoding=*/false);
    a_prompt_ends_inside_a_node(budget, /*decoding=*/true);
  }
}

// Slot 0 holds a long prompt whose nodes are lazy in its caches; its next request follows
// another prompt, which slot 1's caches hold, from an early token on. Restoring it writes over
// slot 0's columns of the first prompt, which the trie's nodes name: begin makes room for
// what that copies out before it copies (the first prompt's nodes are evicted first, and
// nothing is copied), instead of copying the whole path into the trie and evicting it after.
TEST(PrefixCacheBudget, ARestoreOverTheSlotsOwnLazyPathReservesBeforeCopying) {
  for (const bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "contiguous");
    HybridStack stack(StackOptions{.with_recurrent = false, .paged = paged});
    const int64_t budget = 10 * stack.token_bytes();
    PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget, .slots = 2});
    const Tokens p = tokens(100, 5) + tokens(200, 60);
    const Tokens q = tokens(100, 5) + tokens(300, 60);
    const auto prefill = [&](SeqId slot, const Tokens& prompt) {
      PrefixCache::Session s = cache.begin(slot, prompt);
      EXPECT_TRUE(stack.forward_and_check(s.remaining(), prompt, slot));
      s.prefill_done();
      return s;
    };
    prefill(0, p).close();
    PrefixCache::Session standing = prefill(1, q);  // q's nodes: lazy in slot 1's caches
    cache.reset_peak_paged_out_bytes();
    const int64_t copied = stack.attention().copy_stats().materialized_bytes;
    {
      PrefixCache::Session next = cache.begin(0, q + tokens(400, 3));
      EXPECT_GE(next.cached(), 60);
      EXPECT_TRUE(stack.forward_and_check(next.remaining(), q + tokens(400, 3), 0));
      next.prefill_done();
    }
    // One snapshot over at most (the window's restore point holds 7 tokens).
    EXPECT_LE(cache.peak_paged_out_bytes(), budget + 8 * stack.token_bytes());
    EXPECT_LT(stack.attention().copy_stats().materialized_bytes - copied, 10 * stack.token_bytes());
    EXPECT_EQ(cache.check_invariants(), "");
  }
}

// How slot 1's Speculation round stands while slot 0 begins again over p (after serving r,
// then p): opened or not, its verification forward run or not, accepted before or after.
struct RoundAt {
  bool open = false, verified = false, accepted_before = false;
};

// What the trie holds and evicted once slot 0 has begun again under `budget`, with slot 1
// decoding q (and speculating as `round_at` says).
std::vector<int64_t> second_begin(int64_t budget, RoundAt round_at) {
  HybridStack stack;
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget, .slots = 2});
  const Tokens p = tokens(100, 30), r = tokens(2000, 30), q = tokens(700, 20);
  for (const Tokens* prompt : {&r, &p}) {
    PrefixCache::Session s = cache.begin(0, *prompt);
    EXPECT_TRUE(stack.forward_and_check(s.remaining(), *prompt, 0));
    s.prefill_done();
  }
  PrefixCache::Session decoding = cache.begin(1, q);
  EXPECT_TRUE(stack.forward_and_check(decoding.remaining(), q, 1));
  decoding.prefill_done();
  decoding.append_output(5);
  Speculation round(stack.layers(), 1);
  if (round_at.open) round.begin(4);
  const Tokens verify = Tokens{5} + tokens(3000, 4);
  if (round_at.verified) {
    EXPECT_TRUE(stack.forward_and_check(verify, q + verify, 1));
  }
  if (round_at.accepted_before) round.accept(4);  // the same layers, the captures released
  PrefixCache::Session again = cache.begin(0, p + tokens(300, 4));
  const std::vector<int64_t> out{cache.match(r + tokens(1, 1)), cache.stats().evicted_nodes,
                                 cache.stats().dropped_snapshots, cache.paged_out_bytes()};
  if (round_at.open && !round_at.accepted_before) {
    round_at.verified ? round.accept(4) : round.cancel();
  }
  return out;
}

// A round another slot has open (its verification forward about to run) reserves nothing:
// the trie evicts as it would without one.
TEST(PrefixCacheBudget, AnotherSlotsSpeculationRoundReservesNothing) {
  int64_t evicting = 0;
  for (int64_t budget = 500; budget < 6000; budget += 250) {
    EXPECT_EQ(second_begin(budget, {.open = true}), second_begin(budget, {}))
        << "budget " << budget;
    if (second_begin(budget, {})[1] > 0) ++evicting;
  }
  EXPECT_GT(evicting, 3);  // budgets small enough to evict
}

// The same once the round's verification forward has run: its captures (lazy windows of the
// window layer's ring, whole states) are the round's, released when it ends, and reserve
// nothing — the trie evicts as it would with the round already accepted.
TEST(PrefixCacheBudget, AnotherSlotsVerifiedRoundsCapturesReserveNothing) {
  int64_t evicting = 0;
  for (int64_t budget = 500; budget < 6000; budget += 250) {
    const RoundAt accepted{.open = true, .verified = true, .accepted_before = true};
    EXPECT_EQ(second_begin(budget, {.open = true, .verified = true}),
              second_begin(budget, accepted))
        << "budget " << budget;
    if (second_begin(budget, accepted)[1] > 0) ++evicting;
  }
  EXPECT_GT(evicting, 3);
}

// A slot without a session is not written until its next begin (which evicts for it then), so
// the lazy windows its ring holds are not reserved on other slots' calls.
TEST(PrefixCacheBudget, IdleSlotsReserveNothing) {
  HybridStack stack(/*with_recurrent=*/false);
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = 1400, .slots = 2});
  const Tokens p = tokens(100, 30), q = tokens(700, 30);
  for (const auto& [slot, prompt] : {std::pair{SeqId(0), p}, std::pair{SeqId(1), q}}) {
    PrefixCache::Session s = cache.begin(slot, prompt);
    ASSERT_TRUE(stack.forward_and_check(s.remaining(), prompt, slot));
    s.prefill_done();
  }
  EXPECT_GT(stack.window.exposed_bytes(1), 0);  // slot 1's ring names its trie windows
  PrefixCache::Session s = cache.begin(0, p + tokens(300, 3));
  // Each session's own reservation fits: nothing was evicted or dropped on any call.
  EXPECT_EQ(cache.stats().evicted_nodes, 0);
  EXPECT_EQ(cache.stats().dropped_snapshots, 0);
  EXPECT_EQ(cache.match(1, q + tokens(1, 1)), 30);
}

// A begin on a slot whose caches were moved outside the prefix cache resets them, and the reset
// copies out what the trie's lazy snapshots named there: reserved (evicted for) before the copy,
// not after it.
TEST(PrefixCacheBudget, AResetOfCachesMovedByHandReservesBeforeCopying) {
  HybridStack stack(/*with_recurrent=*/false);
  const int64_t budget = 10 * stack.token_bytes();
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget});
  const Tokens p = tokens(100, 60);
  {
    PrefixCache::Session s = cache.begin(p);
    ASSERT_TRUE(stack.forward_and_check(s.remaining(), p));
    s.prefill_done();
  }
  // p's KV, lazy in the live cache: a reset copies it out.
  EXPECT_GT(stack.attention().exposed_bytes_after_rewind(0, 0), budget);
  stack.window.reset(0);  // moved outside the prefix cache
  cache.reset_peak_paged_out_bytes();
  const Tokens q = tokens(500, 20);
  PrefixCache::Session s = cache.begin(q);
  EXPECT_EQ(s.cached(), 0);
  // One snapshot over at most (the window's restore point holds 8 tokens).
  EXPECT_LE(cache.peak_paged_out_bytes(), budget + 9 * stack.token_bytes());
  ASSERT_TRUE(stack.forward_and_check(s.remaining(), q));
  s.prefill_done();
  EXPECT_EQ(cache.check_invariants(), "");
}

// A close whose caches stand past what the session knows (a token forwarded but never
// appended: decoding's usual order broken) resets them, as nothing consistent can be paged out,
// and that reset copies out what the trie's lazy snapshots named there: reserved (evicted for)
// before the copy, not after it, so the trie never holds more than its budget and a snapshot.
TEST(PrefixCacheBudget, AClosePastWhatTheSessionKnowsReservesBeforeResetting) {
  HybridStack stack(/*with_recurrent=*/false);
  const int64_t budget = 10 * stack.token_bytes();
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget});
  const Tokens p = tokens(100, 60);
  PrefixCache::Session s = cache.begin(p);
  ASSERT_TRUE(stack.forward_and_check(s.remaining(), p));
  s.prefill_done();
  // p's KV, lazy in the live cache: a reset copies it out.
  EXPECT_GT(stack.attention().exposed_bytes_after_rewind(0, 0), budget);
  ASSERT_TRUE(stack.forward_and_check(Tokens{7}, p + Tokens{7}));  // never append_output
  cache.reset_peak_paged_out_bytes();
  s.close();
  EXPECT_EQ(stack.attention().offset(0), 0);  // reset: nothing consistent to page out
  // One snapshot over at most (the window's restore point holds 8 tokens).
  EXPECT_LE(cache.peak_paged_out_bytes(), budget + 9 * stack.token_bytes());
  EXPECT_LE(cache.paged_out_bytes(), budget);
  EXPECT_EQ(cache.check_invariants(), "");
  // The cache serves on: a new request is evaluated and checked against recomputation.
  const Tokens q = tokens(500, 20);
  PrefixCache::Session next = cache.begin(q);
  ASSERT_TRUE(stack.forward_and_check(next.remaining(), q));
  next.prefill_done();
  EXPECT_EQ(cache.check_invariants(), "");
}

}  // namespace
}  // namespace kvsnap
