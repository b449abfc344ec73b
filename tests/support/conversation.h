// Runs requests through a PrefixCache over a HybridStack, checking every output against
// recomputation from scratch.
#pragma once

#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <functional>
#include <vector>

#include "support/hybrid_stack.h"

namespace kvsnap::testing {

using Tokens = std::vector<int32_t>;

// `count` distinct tokens starting at `first`.
inline Tokens tokens(int32_t first, int32_t count) {
  Tokens out;
  for (int32_t i = 0; i < count; ++i) out.push_back(first + i);
  return out;
}
inline Tokens operator+(Tokens a, const Tokens& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Turn {
  int64_t cached = 0;     // tokens restored
  int64_t evaluated = 0;  // prompt tokens the model evaluated
};

// One request: begin, evaluate remaining(), prefill_done, generate `reply` (the model evaluates
// every reply token but the last, as a decoder does), close.
// `after_each` runs after every PrefixCache call and every forward.
inline Turn run_turn(
    PrefixCache& cache, HybridStack& stack, const Tokens& prompt, const Tokens& reply,
    const std::vector<int64_t>& user_offsets = {},
    const std::function<void()>& after_each = [] {}) {
  Turn turn;
  PrefixCache::Session session = cache.begin(prompt);
  after_each();
  if (!user_offsets.empty()) {
    session.schedule_snapshots(user_offsets);
    after_each();
  }
  turn.cached = session.cached();
  const auto remaining = session.remaining();
  turn.evaluated = static_cast<int64_t>(remaining.size());
  EXPECT_EQ(turn.cached + turn.evaluated, static_cast<int64_t>(prompt.size()));
  EXPECT_GE(turn.evaluated, 1);
  EXPECT_TRUE(stack.forward_and_check(remaining, prompt));
  after_each();
  session.prefill_done();
  after_each();
  Tokens sequence = prompt;
  for (size_t i = 0; i < reply.size(); ++i) {
    session.append_output(reply[i]);
    sequence.push_back(reply[i]);
    if (i + 1 < reply.size()) {
      EXPECT_TRUE(stack.forward_and_check(std::span(&reply[i], 1), sequence));
      after_each();
    }
  }
  session.close();
  after_each();
  EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
  EXPECT_EQ(cache.check_invariants(), "") << cache.debug_string();
  return turn;
}

// The system prompt of warm_up's conversations.
inline const Tokens kWarmSystem = tokens(100, 12);

// A cache that has seen two conversations (one of two turns) on a shared system prompt
// (kWarmSystem, a restore point at its end): what the persistence tests save and load.
inline void warm_up(PrefixCache& cache, HybridStack& stack) {
  const std::vector<int64_t> end_of_system{12};
  run_turn(cache, stack, kWarmSystem + tokens(200, 6), tokens(300, 4), end_of_system);
  run_turn(cache, stack, kWarmSystem + tokens(200, 6) + tokens(300, 4) + tokens(400, 5),
           tokens(500, 3));
  run_turn(cache, stack, kWarmSystem + tokens(800, 7), tokens(900, 2));
}

}  // namespace kvsnap::testing
