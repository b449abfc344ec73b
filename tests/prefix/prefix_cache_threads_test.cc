// Sessions on several slots from several threads at once: begin, forwards, prefill_done,
// decode and close race freely (the PrefixCache and the caches lock themselves). Every output
// equals recomputation and the trie stays consistent. Run under ThreadSanitizer in CI (the
// `tsan` preset).
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <random>
#include <thread>

#include "support/conversation.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::StackOptions;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// One thread's requests on its slot: conversations on shared system prompts, continued and
// branched, each checked against recomputation.
void serve(PrefixCache& cache, HybridStack& stack, SeqId slot, uint32_t seed, int requests,
           std::atomic<int64_t>& failures, std::atomic<int64_t>& reused) {
  std::mt19937 rng(seed);
  const Tokens systems[] = {tokens(100, 30), tokens(200, 17)};
  Tokens conversation;
  for (int r = 0; r < requests; ++r) {
    Tokens prompt = conversation.empty() || rng() % 3 == 0 ? systems[rng() % 2] : conversation;
    if (rng() % 4 == 0 && prompt.size() > 2) prompt.resize(1 + rng() % (prompt.size() - 1));
    for (uint32_t i = 0, n = 1 + rng() % 8; i < n; ++i) {
      prompt.push_back(1000 + slot * 100000 + r * 100 + static_cast<int32_t>(i));
    }
    PrefixCache::Session session = cache.begin(slot, prompt);
    reused += session.cached();
    const std::vector<int64_t> end_of_system{static_cast<int64_t>(systems[0].size())};
    if (session.cached() <= end_of_system[0] && prompt.size() > systems[0].size()) {
      session.schedule_snapshots(end_of_system);
    }
    if (!stack.forward_and_check(session.remaining(), prompt, slot)) ++failures;
    session.prefill_done();
    Tokens sequence = prompt;
    for (int32_t t = 0, n = 1 + static_cast<int32_t>(rng() % 4); t < n; ++t) {
      const int32_t token = 5000 + slot * 1000 + t;
      session.append_output(token);
      sequence.push_back(token);
      if (t + 1 < n && !stack.forward_and_check(std::span(&token, 1), sequence, slot)) {
        ++failures;
      }
    }
    session.close();
    conversation = Tokens(sequence.begin(), sequence.end() - 1);
  }
}

void race(bool paged) {
  constexpr SeqId kThreads = 4;
  HybridStack stack(StackOptions{.paged = paged, .check_copies = false});
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = 20000, .slots = kThreads});
  std::atomic<int64_t> failures{0}, reused{0};
  std::vector<std::thread> threads;
  for (SeqId slot = 0; slot < kThreads; ++slot) {
    threads.emplace_back(serve, std::ref(cache), std::ref(stack), slot, 7u + slot, 25,
                         std::ref(failures), std::ref(reused));
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(reused.load(), 500);
  EXPECT_EQ(cache.check_invariants(), "") << cache.debug_string();
  EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
  EXPECT_EQ(cache.stats().lookups, kThreads * 25);
}

// A few rounds each: a race that shows once in tens of runs still shows in CI.
TEST(PrefixCacheThreads, ConcurrentSessionsOnContiguousCaches) {
  for (int round = 0; round < 4; ++round) race(false);
}
TEST(PrefixCacheThreads, ConcurrentSessionsOnPagedCaches) {
  for (int round = 0; round < 4; ++round) race(true);
}

}  // namespace
}  // namespace kvsnap
