// Randomized interleavings of speculation rounds with prefix-cache sessions: conversations that
// continue, regenerate and edit earlier requests, each reply decoded by plain steps and by
// speculation rounds accepting a random number of drafts. Every output must equal recomputation,
// a session must page out exactly the evaluated (accepted) tokens — never a rejected draft — and
// the next request must reuse them.
#include <gtest/gtest.h>
#include <kvsnap/prefix_cache.h>
#include <kvsnap/speculation.h>

#include <random>

#include "support/conversation.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::StackOptions;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

class SpeculativeConversations {
 public:
  SpeculativeConversations(uint32_t seed, bool paged, int64_t budget)
      : rng_(seed),
        budget_(budget),
        stack_(StackOptions{.window = 5, .paged = paged}),
        cache_(stack_.layers(), {.max_paged_out_bytes = budget}),
        round_(stack_.layers()) {}

  void run(int requests) {
    for (int r = 0; r < requests && !::testing::Test::HasFailure(); ++r) request();
  }
  const Speculation::Stats& stats() const { return round_.stats(); }
  int64_t reused_all = 0;  // continuations that restored every evaluated token

 private:
  int64_t random(int64_t below) { return static_cast<int64_t>(rng_() % below); }
  Tokens fresh(int64_t count) {
    Tokens out;
    for (int64_t i = 0; i < count; ++i) out.push_back(next_++);
    return out;
  }

  // A new conversation, or one that continues / regenerates / edits an earlier request.
  Tokens next_prompt(int64_t* expect_cached) {
    *expect_cached = -1;
    if (done_.empty() || random(4) == 0) return Tokens{1, 2, 3} + fresh(2 + random(8));
    const Done& earlier = done_[static_cast<size_t>(random(static_cast<int64_t>(done_.size())))];
    switch (random(3)) {
      case 0:  // continue: its evaluated tokens, its last reply token, a new message
        *expect_cached = static_cast<int64_t>(earlier.evaluated.size());
        return earlier.evaluated + Tokens{earlier.last} + fresh(1 + random(4));
      case 1:
        return earlier.prompt;  // regenerate
      default: {                // edit: part of its prompt, then new tokens
        const auto keep = 1 + random(static_cast<int64_t>(earlier.prompt.size()));
        return Tokens(earlier.prompt.begin(), earlier.prompt.begin() + keep) + fresh(2);
      }
    }
  }

  void request() {
    int64_t expect_cached = 0;
    const Tokens prompt = next_prompt(&expect_cached);
    PrefixCache::Session session = cache_.begin(prompt);
    // With room for everything, a continuation restores every token the earlier session
    // evaluated, the accepted drafts included (more when another continuation of it evaluated
    // its last token since).
    if (budget_ > (int64_t(1) << 30) && expect_cached >= 0) {
      ASSERT_GE(session.cached(), expect_cached);
      ++reused_all;
    }
    ASSERT_TRUE(stack_.forward_and_check(session.remaining(), prompt));
    EXPECT_LE(cache_.paged_out_bytes(), budget_) << "after the prefill";
    session.prefill_done();
    Tokens evaluated = prompt;
    std::vector<std::pair<Tokens, int32_t>> rejected;  // (evaluated prefix, the rejected draft)
    int32_t last = fresh(1)[0];
    session.append_output(last);
    const int64_t length = 1 + random(14);
    for (int64_t emitted = 1; emitted < length;) {
      if (random(4) == 0) {  // a plain decode step
        ASSERT_TRUE(stack_.forward_and_check(Tokens{last}, evaluated + Tokens{last}));
        EXPECT_LE(cache_.paged_out_bytes(), budget_) << "after a decode step";
        evaluated.push_back(last);
        last = fresh(1)[0];
        session.append_output(last);
        ++emitted;
        continue;
      }
      const int64_t k = 1 + random(4), accepted = random(k + 1);
      const Tokens drafts = fresh(k), verify = Tokens{last} + drafts;
      // Either the session learns the drafts up front and takes the rejected ones back, or it
      // learns only the accepted ones.
      const bool eager = random(2) == 0;
      if (eager) {
        for (int32_t d : drafts) session.append_output(d);
      }
      round_.begin(k);
      ASSERT_TRUE(stack_.forward_and_check(verify, evaluated + verify));
      // The verify forward's writes (and the rollback's) copy out only what the budget reserved.
      EXPECT_LE(cache_.paged_out_bytes(), budget_) << "after a verify forward";
      round_.accept(accepted);
      EXPECT_LE(cache_.paged_out_bytes(), budget_) << "after accepting " << accepted;
      evaluated.insert(evaluated.end(), verify.begin(), verify.begin() + accepted + 1);
      if (accepted < k) rejected.emplace_back(evaluated, drafts[static_cast<size_t>(accepted)]);
      if (eager) {
        session.retract_outputs(k - accepted);
      } else {
        for (int64_t i = 0; i < accepted; ++i) {
          session.append_output(drafts[static_cast<size_t>(i)]);
        }
      }
      last = fresh(1)[0];  // the model's own token where the drafts stopped
      session.append_output(last);
      emitted += accepted + 1;
    }
    session.close();
    EXPECT_EQ(cache_.paged_out_bytes(), cache_.recount_paged_out_bytes());
    EXPECT_LE(cache_.paged_out_bytes(), budget_);
    ASSERT_EQ(cache_.check_invariants(), "") << cache_.debug_string();
    // A rejected draft never reaches the trie: nothing restores past its position.
    for (const auto& [prefix, draft] : rejected) {
      EXPECT_LE(cache_.match(prefix + Tokens{draft, 0}), static_cast<int64_t>(prefix.size()));
    }
    if (budget_ > (int64_t(1) << 30)) {
      EXPECT_EQ(cache_.match(evaluated + Tokens{last}), static_cast<int64_t>(evaluated.size()));
    }
    done_.push_back({prompt, evaluated, last});
  }

  struct Done {
    Tokens prompt, evaluated;
    int32_t last;
  };
  std::mt19937 rng_;
  int64_t budget_;
  int32_t next_ = 100;
  HybridStack stack_;
  PrefixCache cache_;
  Speculation round_;
  std::vector<Done> done_;
};

class SpeculationSessions : public ::testing::TestWithParam<bool> {};

TEST_P(SpeculationSessions, RandomInterleavingsEqualRecomputation) {
  for (uint32_t seed = 1; seed <= 6 && !HasFailure(); ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    SpeculativeConversations conversations(seed, GetParam(), int64_t(1) << 40);
    conversations.run(14);
    EXPECT_GT(conversations.stats().rounds, 0);
    EXPECT_GT(conversations.reused_all, 0);
  }
}

TEST_P(SpeculationSessions, RandomInterleavingsUnderASmallBudget) {
  for (uint32_t seed = 11; seed <= 14 && !HasFailure(); ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    SpeculativeConversations conversations(seed, GetParam(), 3000);
    conversations.run(14);
  }
}

// A rollback of the layers into the prompt is not one of drafts: the trie's nodes on the
// session's path name those columns (here lazily, in the live caches), and re-evaluating them
// would copy them into the trie unreserved. retract_outputs refuses it, changing nothing.
TEST(SpeculationSessions, RetractOutputsRefusesLayersRolledBackIntoThePrompt) {
  HybridStack stack(/*with_recurrent=*/false, /*window_size=*/64);  // both layers rewind
  PrefixCache cache(stack.layers());
  const Tokens prompt = tokens(100, 6);
  {
    PrefixCache::Session first = cache.begin(prompt);
    ASSERT_TRUE(stack.forward_and_check(first.remaining(), prompt));
    first.prefill_done();
  }
  const Tokens longer = prompt + tokens(300, 4);
  PrefixCache::Session session = cache.begin(longer);
  ASSERT_EQ(session.cached(), 6);
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), longer));
  session.prefill_done();
  session.append_output(7);
  session.append_output(8);
  ASSERT_TRUE(stack.forward_and_check(Tokens{7}, longer + Tokens{7}));
  // Layers that disagree, all past the prompt (a forward half done): not a rollback into it.
  ASSERT_TRUE(stack.window.restore(0, nullptr, 10));
  session.retract_outputs(0);
  ASSERT_TRUE(stack.attention().restore(0, nullptr, 9));  // one token short of the prompt's end
  try {
    session.retract_outputs(1);
    ADD_FAILURE() << "retract_outputs accepted a layer inside the prompt";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 0 stands at offset 9, inside the 10-token prompt"),
              std::string::npos)
        << e.what();
  }
  // Unchanged: the session still holds 7 and 8. Back past the prompt, with 7 evaluated again,
  // taking 8 back leaves the 11 tokens the layers hold, which close() pages out (had the refused
  // call taken a token, the session would know fewer tokens than the layers hold, and page out
  // none of them).
  ASSERT_TRUE(stack.window.restore(0, nullptr, 9));
  ASSERT_TRUE(stack.forward_and_check(Tokens{longer.back()}, longer));
  ASSERT_TRUE(stack.forward_and_check(Tokens{7}, longer + Tokens{7}));
  session.retract_outputs(1);
  session.close();
  EXPECT_EQ(cache.match(longer + Tokens{7, 99}), 11);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(SpeculationSessions, RetractOutputsChecksItsCount) {
  HybridStack stack;
  PrefixCache cache(stack.layers());
  const Tokens prompt = {1, 2, 3, 4};
  PrefixCache::Session session = cache.begin(prompt);
  EXPECT_THROW(session.retract_outputs(0), Error);  // before prefill_done
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), prompt));
  session.prefill_done();
  session.append_output(7);
  session.append_output(8);
  EXPECT_THROW(session.retract_outputs(3), Error);  // only 2 generated: the prompt stays
  EXPECT_THROW(session.retract_outputs(-1), Error);
  session.retract_outputs(1);  // 8 was a rejected draft; the model's token is 9
  session.append_output(9);
  ASSERT_TRUE(stack.forward_and_check(Tokens{7}, prompt + Tokens{7}));
  ASSERT_TRUE(stack.forward_and_check(Tokens{9}, prompt + Tokens{7, 9}));
  session.append_output(10);
  session.close();
  EXPECT_EQ(cache.match(prompt + Tokens{7, 9, 10}), 6);  // 7 and 9 paged out, never 8
  EXPECT_LT(cache.match(prompt + Tokens{7, 8, 10}), 6);
}

// A session closed while a Speculation round is open (its client gone before the verify forward)
// leaves the round's captures scheduled on the slot. The next begin there refuses, naming them,
// and changes nothing — it would have taken or cancelled them, and reset the slot when a restore
// refused them. Once the round is cancelled, begin goes on and outputs equal recomputation.
TEST(SpeculationSessions, BeginRefusesASlotWhereARoundIsStillOpen) {
  HybridStack stack;  // the window (8) and the recurrent layer capture past offset 8
  PrefixCache cache(stack.layers());
  Speculation round(stack.layers());
  const Tokens prompt = tokens(100, 6);
  PrefixCache::Session session = cache.begin(prompt);
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), prompt));
  session.prefill_done();
  session.append_output(7);
  round.begin(3);  // captures at 7..9
  session.close();
  const std::string trie = cache.debug_string();
  const Tokens next = prompt + Tokens{7, 300};
  try {
    (void)cache.begin(next);
    ADD_FAILURE() << "begin took a slot where a round is open";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.starts_with("PrefixCache::begin: layer ")) << what;
    EXPECT_NE(what.find("has 3 capture(s) scheduled for slot 0 (offsets 7..9)"), std::string::npos)
        << what;
  }
  EXPECT_EQ(cache.debug_string(), trie);
  EXPECT_EQ(stack.attention().offset(0), 6);
  ASSERT_TRUE(round.open());
  round.cancel();
  PrefixCache::Session again = cache.begin(next);
  EXPECT_EQ(again.cached(), 6);
  ASSERT_TRUE(stack.forward_and_check(again.remaining(), next));
  again.prefill_done();
  EXPECT_EQ(cache.check_invariants(), "");
}

INSTANTIATE_TEST_SUITE_P(ContiguousAndPaged, SpeculationSessions, ::testing::Bool());

}  // namespace
}  // namespace kvsnap
