// Edges of a PrefixCache::Session's life: move-assignment onto an open session, and a close
// while a Speculation round is open on the session's slot (before its accept or cancel). Every
// output is checked against recomputation.
#include <gtest/gtest.h>
#include <kvsnap/prefix_cache.h>
#include <kvsnap/speculation.h>

#include "support/conversation.h"
#include "support/test_support.h"

namespace kvsnap::session_edges_test {
namespace {

using testing::HybridStack;
using testing::StackOptions;
using testing::throws_error;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// Move-assigning a session onto an open one closes the target first: its evaluated tokens are
// paged out and its slot is free (a begin there succeeds and restores them). The assigned-to
// handle now drives the moved session; the moved-from handle is inert (its calls throw Error
// saying it is closed, closing it does nothing).
TEST(SessionEdges, MoveAssignmentOntoAnOpenSessionClosesItFirst) {
  HybridStack stack;
  PrefixCache cache(stack.layers(), {.slots = 2});
  const Tokens first = tokens(100, 6), second = tokens(200, 5);
  PrefixCache::Session target = cache.begin(0, first);
  ASSERT_TRUE(stack.forward_and_check(target.remaining(), first, 0));
  target.prefill_done();
  target.append_output(7);
  ASSERT_TRUE(stack.forward_and_check(Tokens{7}, first + Tokens{7}, 0));
  target.append_output(8);
  const Tokens next = first + Tokens{7, 8, 9};
  EXPECT_TRUE(throws_error([&] { (void)cache.begin(0, next); },
                           {"PrefixCache::begin", "slot 0 has a session already open"}));
  // Open, it has paged out nothing past its prefill's restore point (the last prompt token's).
  EXPECT_EQ(cache.match(next), 5);

  PrefixCache::Session source = cache.begin(1, second);
  target = std::move(source);
  EXPECT_EQ(target.slot(), 1);
  EXPECT_EQ(target.cached(), 0);
  EXPECT_EQ(cache.match(next), 7);  // the closed session's evaluated tokens (8 was not)
  EXPECT_TRUE(throws_error([&] { (void)source.cached(); }, {"Session::cached", "closed"}));
  EXPECT_TRUE(throws_error([&] { source.append_output(1); }, {"closed"}));
  source.close();  // a no-op

  PrefixCache::Session again = cache.begin(0, next);
  EXPECT_EQ(again.slot(), 0);
  EXPECT_EQ(again.cached(), 7);
  ASSERT_TRUE(stack.forward_and_check(again.remaining(), next, 0));
  again.prefill_done();
  ASSERT_TRUE(stack.forward_and_check(target.remaining(), second, 1));
  target.prefill_done();
  target.close();
  again.close();
  EXPECT_EQ(cache.check_invariants(), "") << cache.debug_string();
  EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
}

// A session past its prefill, on a stack whose window (5) and recurrent layers capture in a
// round: decodes token 7, then opens a round of three drafts (900, 901, 902) and runs its
// verify forward. `eager`: the session was told the drafts before it (append_output).
struct MidRound {
  explicit MidRound(bool paged, bool eager)
      : stack(StackOptions{.window = 5, .paged = paged}),
        cache(stack.layers()),
        round(stack.layers()),
        session(cache.begin(prompt)) {
    EXPECT_TRUE(stack.forward_and_check(session.remaining(), prompt));
    session.prefill_done();
    session.append_output(7);
    if (eager) {
      for (const int32_t d : drafts) session.append_output(d);
    }
    round.begin(3);
    EXPECT_EQ(round.capturing_layers(), 2);
    EXPECT_TRUE(stack.forward_and_check(Tokens{7} + drafts, verified));
  }

  // A request for `prompt` on the slot: its outputs equal recomputation; returns cached().
  int64_t request(const Tokens& next) {
    PrefixCache::Session s = cache.begin(next);
    const int64_t cached = s.cached();
    EXPECT_TRUE(stack.forward_and_check(s.remaining(), next));
    s.prefill_done();
    s.append_output(1);
    s.close();
    EXPECT_EQ(cache.check_invariants(), "") << cache.debug_string();
    EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
    return cached;
  }

  const Tokens prompt = tokens(100, 6);
  const Tokens drafts = tokens(900, 3);
  const Tokens verified = prompt + Tokens{7} + drafts;  // what the layers hold: 10 tokens
  HybridStack stack;
  PrefixCache cache;
  Speculation round;
  PrefixCache::Session session;
};

// A close during a round, after a verify forward whose drafts the session was told: they were
// evaluated, so it pages out every token the layers hold (exact) and leaves the layers and the
// round alone. The round then ends as usual (accept rolls the layers back: the window restores
// its capture over the ring the trie's lazy snapshot of offset 10 named), and the next requests
// on the slot — one continuing the accepted tokens, one all the evaluated ones, which restores
// them all — give outputs equal to recomputation.
TEST(SessionEdges, ACloseMidRoundPagesOutTheDraftsTheSessionKnows) {
  for (const bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "contiguous");
    MidRound r(paged, /*eager=*/true);
    r.session.close();
    EXPECT_EQ(r.cache.match(r.verified + Tokens{50}), 10);  // every evaluated token, the drafts'
    EXPECT_EQ(r.stack.offset(), 10);
    ASSERT_TRUE(r.round.open());
    r.round.accept(1);  // 900 confirmed: every layer back at 8
    EXPECT_EQ(r.stack.offset(), 8);
    EXPECT_EQ(r.stack.window.offset(0), 8);
    // The layers stand at 8 on the accepted tokens: the request restores at least the prefill's
    // restore point (5), at most the 8 tokens it shares with them.
    const int64_t cached = r.request(r.prompt + Tokens{7, 900, 60, 61});
    EXPECT_GE(cached, 5);
    EXPECT_LE(cached, 8);
    EXPECT_EQ(r.request(r.verified + Tokens{50, 51}), 10);
  }
}

// The same close when the session was told none of the drafts (it would have appended only the
// accepted ones): the verify forward took the layers past what the session knows, so the close
// resets the slot. The reset drops the round's captures with the rest of the slot's state: the
// layers stand at 0, accept refuses (they are not where the verify forward left them) and
// cancel ends the round. The trie keeps the prefill's restore points (the last prompt token's,
// offset 5): the next request on the slot restores it, and its outputs equal recomputation.
TEST(SessionEdges, ACloseMidRoundPastWhatTheSessionKnowsResetsTheSlot) {
  for (const bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "contiguous");
    MidRound r(paged, /*eager=*/false);
    r.session.close();
    EXPECT_EQ(r.stack.offset(), 0);
    EXPECT_EQ(r.stack.window.offset(0), 0);
    EXPECT_EQ(r.stack.recurrent.offset(0), 0);
    EXPECT_FALSE(r.stack.window.schedule_state(0).pending);
    EXPECT_FALSE(r.stack.recurrent.schedule_state(0).pending);
    EXPECT_LE(r.cache.match(r.verified + Tokens{50}), 6);  // no draft, nor 7, paged out
    EXPECT_THROW(r.round.accept(1), Error);
    ASSERT_TRUE(r.round.open());
    r.round.cancel();
    EXPECT_FALSE(r.round.open());
    EXPECT_EQ(r.request(r.prompt + Tokens{7, 900, 60}), 5);
  }
}

}  // namespace
}  // namespace kvsnap::session_edges_test
