// Randomized conversation trees through a PrefixCache with a small byte budget: new
// conversations sharing system prompts, continuations, regenerations, edits of earlier turns
// and returns to old branches, over tokens from a small vocabulary (so unrelated prompts share
// prefixes by accident too). Every output must equal recomputation, the budget must hold after
// every call and every forward (checked before the writes copied anything out), the byte counter
// must equal the sum of snapshot sizes, and nothing may leak.
#include <gtest/gtest.h>
#include <kvsnap/prefix_cache.h>

#include <cstdlib>
#include <random>

#include "support/conversation.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::Tokens;
using testing::operator+;

class ConversationTree {
 public:
  ConversationTree(uint32_t seed, int64_t budget)
      : rng_(seed), budget_(budget), cache_(stack_.layers(), {.max_paged_out_bytes = budget}) {}

  void run(int turns) {
    for (int t = 0; t < turns && !::testing::Test::HasFailure(); ++t) turn();
  }
  PrefixCache::Stats stats() const { return cache_.stats(); }

 private:
  Tokens random_tokens(int64_t min, int64_t max) {
    Tokens out(static_cast<size_t>(min + random(max - min + 1)));
    const bool small_vocabulary = rng_() % 2 == 0;
    for (int32_t& t : out) t = small_vocabulary ? 1 + static_cast<int32_t>(random(6)) : next_++;
    return out;
  }
  int64_t random(int64_t below) { return below <= 0 ? 0 : static_cast<int64_t>(rng_() % below); }
  template <class T>
  const T& pick(const std::vector<T>& items) {
    return items[static_cast<size_t>(random(static_cast<int64_t>(items.size())))];
  }

  Tokens next_prompt() {
    const int op = static_cast<int>(rng_() % 5);
    if (op == 0 || conversations_.empty()) {  // a new conversation on one of three system prompts
      static const Tokens systems[] = {testing::tokens(100, 9), testing::tokens(200, 14), {7}};
      return systems[rng_() % 3] + random_tokens(1, 8);
    }
    if (op == 1) return pick(conversations_) + random_tokens(1, 8);  // continue (maybe an old one)
    if (op == 2) return pick(prompts_);                              // regenerate
    const Tokens& base = pick(op == 3 ? prompts_ : conversations_);  // edit an earlier turn
    const int64_t cut = 1 + random(static_cast<int64_t>(base.size()) - 1);
    return Tokens(base.begin(), base.begin() + cut) + random_tokens(1, 6);
  }

  void turn() {
    const Tokens prompt = next_prompt();
    const Tokens reply = random_tokens(1, 5);
    std::vector<int64_t> offsets;
    // User restore points are given as absolute offsets; begin() has to run first to know the
    // restored prefix, so schedule them inside the prompt's second half.
    if (rng_() % 3 == 0 && prompt.size() > 2) {
      offsets.push_back(static_cast<int64_t>(prompt.size()) - 1 - random(2));
    }
    const auto check = [&] {
      ASSERT_LE(cache_.paged_out_bytes(), budget_) << cache_.debug_string();
      ASSERT_EQ(cache_.paged_out_bytes(), cache_.recount_paged_out_bytes());
      ASSERT_EQ(cache_.check_invariants(), "") << cache_.debug_string();
    };
    const auto result = run_turn(cache_, stack_, prompt, reply, {}, check);
    (void)result;
    if (!offsets.empty() && !::testing::Test::HasFailure()) {
      // A second request with the restore point, now that most of the prompt is cached.
      PrefixCache::Session session = cache_.begin(prompt);
      const int64_t cached = session.cached();
      std::vector<int64_t> valid;
      for (int64_t o : offsets) {
        if (o >= cached) valid.push_back(o);
      }
      session.schedule_snapshots(valid);
      ASSERT_TRUE(stack_.forward_and_check(session.remaining(), prompt));
      check();
      session.prefill_done();
      check();
      session.close();
      check();
    }
    prompts_.push_back(prompt);
    // Only the reply tokens the model evaluated are part of the conversation's state.
    conversations_.push_back(prompt + Tokens(reply.begin(), reply.end() - 1));
  }

  std::mt19937 rng_;
  int64_t budget_;
  HybridStack stack_;
  PrefixCache cache_;
  std::vector<Tokens> prompts_, conversations_;
  int32_t next_ = 1000;
};

TEST(PrefixCacheRandom, ConversationTreesEqualRecomputationWithinTheBudget) {
  const int64_t baseline = live_bytes();
  int64_t evicted = 0, reused = 0;
  // KVSNAP_SOAK_SEEDS raises the number of trees for a longer soak run.
  const char* soak = std::getenv("KVSNAP_SOAK_SEEDS");
  const uint32_t seeds = soak != nullptr ? static_cast<uint32_t>(std::atoi(soak)) : 120;
  for (uint32_t seed = 1; seed <= seeds; ++seed) {
    {
      const int64_t budget = 1500 + 1000 * static_cast<int64_t>(seed % 8);
      ConversationTree tree(seed, budget);
      tree.run(40);
      evicted += tree.stats().evicted_nodes;
      reused += tree.stats().reused_tokens;
    }
    ASSERT_FALSE(::testing::Test::HasFailure()) << "seed " << seed;
    ASSERT_EQ(live_bytes(), baseline) << "seed " << seed << " leaked array bytes";
  }
  EXPECT_GT(evicted, 100);  // the budget was small enough to matter
  EXPECT_GT(reused, 1000);  // and the cache still reused a lot
}

}  // namespace
}  // namespace kvsnap
