// PrefixCache eviction order: under the byte budget, leaves go least recently used first, where a
// request that passes over a node (begin) or pages out along it (close) uses it.
#include <gtest/gtest.h>
#include <kvsnap/kv_cache.h>
#include <kvsnap/prefix_cache.h>

#include <limits>
#include <vector>

#include "support/conversation.h"

namespace kvsnap::prefix_cache_lru_test {
namespace {

using testing::HybridStack;
using testing::run_turn;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// Conversation c: an 18-token prompt of its own (no shared prefix) and a 4-token reply, which
// leave two nodes: [0, 17) and the leaf [17, 21).
Tokens prompt(int32_t c) { return tokens(1000 + 100 * c, 18); }
Tokens reply(int32_t c) { return tokens(5000 + 100 * c, 4); }
// What a request continuing conversation c would restore: 21 with its leaf, 17 without.
int64_t kept(const PrefixCache& cache, int32_t c) {
  return cache.match(prompt(c) + reply(c) + tokens(9000, 1));
}

struct Outcome {
  int64_t bytes = 0;            // paged out at the end
  int64_t evicted_before = 0;   // nodes evicted before conversation 3
  int64_t evicted = 0;          // in all
  std::vector<int64_t> kept{};  // kept() of conversations 0, 1, 2
};

// Conversations 0, 1 and 2, then again those in `used` (each restored and continued with its
// reply: begin and close over its nodes), then conversation 3 — under `budget`.
Outcome run(int64_t budget, const std::vector<int32_t>& used) {
  HybridStack stack;
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget});
  for (int32_t c = 0; c < 3; ++c) run_turn(cache, stack, prompt(c), reply(c));
  for (const int32_t c : used) EXPECT_EQ(run_turn(cache, stack, prompt(c), reply(c)).cached, 17);
  Outcome out;
  out.evicted_before = cache.stats().evicted_nodes;
  run_turn(cache, stack, prompt(3), reply(3));
  out.bytes = cache.paged_out_bytes();
  out.evicted = cache.stats().evicted_nodes;
  for (int32_t c = 0; c < 3; ++c) out.kept.push_back(kept(cache, c));
  return out;
}

// "Kept under a budget by LRU eviction of leaves" (DESIGN.md, Prefix cache): three finished
// conversations and a fourth that needs room for one leaf. With a budget one byte short of what
// all four hold, the leaf evicted is the least recently used one: conversation 0's when nothing
// was used again, conversation 1's once 0 was used again, conversation 2's once 0 and 1 were —
// never the order they were inserted in, nor the one just used.
TEST(PrefixCacheLru, TheLeastRecentlyUsedLeafIsEvictedFirst) {
  const std::vector<std::vector<int32_t>> uses{{}, {0}, {0, 1}};
  for (size_t victim = 0; victim < uses.size(); ++victim) {
    SCOPED_TRACE(::testing::Message() << "used again: " << ::testing::PrintToString(uses[victim]));
    const Outcome all = run(std::numeric_limits<int64_t>::max(), uses[victim]);
    ASSERT_EQ(all.evicted, 0);
    EXPECT_EQ(all.kept, (std::vector<int64_t>{21, 21, 21}));
    const Outcome tight = run(all.bytes - 1, uses[victim]);
    ASSERT_EQ(tight.evicted_before, 0);  // the budget held all three before the fourth
    EXPECT_EQ(tight.evicted, 1);
    std::vector<int64_t> expected{21, 21, 21};
    expected[victim] = 17;  // its leaf evicted; its first node remains
    EXPECT_EQ(tight.kept, expected);
    EXPECT_LE(tight.bytes, all.bytes - 1);
  }
}

// A restore point the caller marks (schedule_snapshots) is a user node, evicted after every other
// leaf; one it only guesses (schedule_branch_points: where a waiting request's prompt may leave
// this one) is an ordinary node, evicted least recently used like the rest. Conversation 0 marks
// or guesses offset 10, then conversations 1, 2 and 3 fill the trie: at every budget the guess
// is kept no longer than the mark, and at some the mark outlives more recent conversations'
// nodes while the guess goes first (as the scheduler's look-ahead points did, being user nodes).
TEST(PrefixCacheLru, AGuessedBranchPointIsEvictedAsAnOrdinaryNode) {
  const auto kept_at_10 = [](int64_t budget, bool user) {
    HybridStack stack;
    PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget});
    {
      PrefixCache::Session session = cache.begin(prompt(0));
      const std::vector<int64_t> ten{10};
      if (user) {
        session.schedule_snapshots(ten);
      } else {
        session.schedule_branch_points(ten);
      }
      EXPECT_TRUE(stack.forward_and_check(session.remaining(), prompt(0)));
      session.prefill_done();
    }
    for (int32_t c = 1; c < 4; ++c) run_turn(cache, stack, prompt(c), reply(c));
    const Tokens first = prompt(0);
    return cache.match(Tokens(first.begin(), first.begin() + 10) + tokens(9000, 2));
  };
  int64_t differ = 0;
  for (int64_t budget = 0; budget <= 40000; budget += 500) {
    const int64_t marked = kept_at_10(budget, true), guessed = kept_at_10(budget, false);
    EXPECT_LE(guessed, marked) << "budget " << budget;
    differ += guessed < marked ? 1 : 0;
  }
  EXPECT_GT(differ, 0);
}

// A marked restore point resists merging (DESIGN.md, Prefix cache), which only a stack without
// whole-state layers shows (their restore point alone already keeps a node from merging). KV
// only, 64 bytes a token: a shared 10-token head, marked or guessed, then X's 10 tokens, then
// Y's (X's copied out of the live cache: 640 bytes owned; the head and Y lazy there). A third
// request over other tokens will overwrite the head and Y (1280 bytes reserved): under a
// budget of 1500, X's two nodes (least recently used) go. Guessed, the head then merges with
// Y's first node; marked, it stays a node of its own.
TEST(PrefixCacheLru, AMarkedPointResistsMergingWhereNothingElseKeepsANode) {
  const testing::TokenKV kv;
  const auto nodes_left = [&](bool user) {
    KVCache cache;
    PrefixCache prefix({&cache}, {.max_paged_out_bytes = 1500});
    const Tokens head = tokens(100, 10);
    const auto serve = [&](const Tokens& prompt, bool mark) {
      PrefixCache::Session session = prefix.begin(prompt);
      if (mark) {
        const std::vector<int64_t> ten{10};
        user ? session.schedule_snapshots(ten) : session.schedule_branch_points(ten);
      }
      const std::span<const int32_t> rest = session.remaining();
      testing::write(cache, kv, std::vector<int64_t>(rest.begin(), rest.end()));
      session.prefill_done();
      return session;
    };
    serve(head + tokens(200, 10), true).close();
    serve(head + tokens(300, 10), false).close();
    // The head; X and Y each in two nodes (a restore point at the last prompt token, 19).
    EXPECT_EQ(prefix.node_count(), 5);
    PrefixCache::Session other = serve(tokens(500, 30), false);
    EXPECT_EQ(prefix.match(head + tokens(200, 10) + tokens(9, 1)), 10);  // X went
    EXPECT_EQ(prefix.match(head + tokens(300, 10) + tokens(9, 1)), 20);  // Y stays
    EXPECT_EQ(prefix.check_invariants(), "");
    return prefix.node_count();
  };
  // Beside the third request's own node [0, 29): Y's [0, 19) and [19, 20), the head merged into
  // Y's first node; or the marked head [0, 10) kept apart from [10, 19) and [19, 20).
  EXPECT_EQ(nodes_left(false), 3);
  EXPECT_EQ(nodes_left(true), 4);
}

}  // namespace
}  // namespace kvsnap::prefix_cache_lru_test
