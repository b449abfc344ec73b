// Prompt-lookup drafting, and speculative greedy decoding of the built-in model: the tokens and
// logits of plain greedy decoding, with fewer forwards where the drafts hit; the embedded
// code-edits workload through `replay --speculate`.
#include "speculate.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <tuple>

#include "model/model.h"
#include "support/tiny_model.h"
#include "workload.h"

namespace kvsnap::tools {
namespace {

using kvsnap::testing::tiny_model;

using Tokens = std::vector<int32_t>;

Tokens drafts_for(const Tokens& context, int64_t k, int64_t max_ngram = 4) {
  Tokens out;
  PromptLookup(max_ngram).draft(context, k, out);
  return out;
}

TEST(PromptLookup, TheLongestRecentMatchProposesItsContinuation) {
  // "3 4" occurs twice; "2 3 4" once, followed by 5 6 7: the longer match wins.
  EXPECT_EQ(drafts_for({1, 2, 3, 4, 5, 6, 7, 9, 3, 4, 8, 2, 3, 4}, 3), (Tokens{5, 6, 7}));
  // Among equal lengths the most recent occurrence: "3 4" then 8.
  EXPECT_EQ(drafts_for({3, 4, 5, 3, 4, 8, 1, 3, 4}, 2, 2), (Tokens{8, 1}));
}

TEST(PromptLookup, AContinuationThatReachesTheEndGoesOnOverTheDrafts) {
  EXPECT_EQ(drafts_for({7, 7, 7}, 4), (Tokens{7, 7, 7, 7}));           // period 1
  EXPECT_EQ(drafts_for({1, 2, 1, 2, 1}, 5), (Tokens{2, 1, 2, 1, 2}));  // period 2
}

TEST(PromptLookup, NoMatchNoDraftsAndAtMostK) {
  EXPECT_TRUE(drafts_for({1, 2, 3, 4}, 4).empty());
  EXPECT_TRUE(drafts_for({5}, 4).empty());
  EXPECT_TRUE(drafts_for({1, 2, 1}, 0).empty());
  EXPECT_EQ(drafts_for({1, 2, 3, 9, 1, 2}, 1), (Tokens{3}));
  EXPECT_THROW(PromptLookup(2, 0), Error);
  EXPECT_THROW(PromptLookup(1, 2), Error);
}

// A verify forward's drafts: accepted while they equal the model's tokens. A right draft that
// ends the reply (the end token) is accepted too — the layers never evaluate a reply's last
// token, so they keep only the drafts before it.
TEST(SettleDrafts, ARightDraftThatEndsTheReplyIsAccepted) {
  const auto settle = [](const Tokens& drafts, const Tokens& model) {
    Tokens chosen;
    const SettledDrafts s = settle_drafts(
        drafts,
        [&](int64_t row) {
          chosen.push_back(model[static_cast<size_t>(row)]);
          return chosen.back();
        },
        [](int32_t token) { return token == kEnd; });
    EXPECT_EQ(s.last, chosen.back());
    return std::tuple(s.kept, s.accepted, chosen);
  };
  EXPECT_EQ(settle({7, kEnd, 9}, {7, kEnd, 1, 1}), std::tuple(1, 2, Tokens{7, kEnd}));
  EXPECT_EQ(settle({kEnd}, {kEnd, 1}), std::tuple(0, 1, Tokens{kEnd}));
  EXPECT_EQ(settle({7, 8}, {7, 5, 1}), std::tuple(1, 1, Tokens{7, 5}));     // 8 was wrong
  EXPECT_EQ(settle({7, 8}, {7, 8, 9}), std::tuple(2, 2, Tokens{7, 8, 9}));  // and a bonus
  EXPECT_EQ(settle({7, 8}, {kEnd, 1}), std::tuple(0, 0, Tokens{kEnd}));     // a wrong draft
}

TEST(ModelSpeculation, GreedyTokensAndLogitsEqualPlainDecoding) {
  const Model model(tiny_model(/*window=*/8));  // shorter than the prompts: it captures
  const int64_t vocab = model.config().vocab_size;
  std::vector<int32_t> prompt;
  for (int r = 0; r < 4; ++r) {  // repetitive: prompt lookup proposes
    for (int32_t t : {5, 9, 17, 33, 65, 129}) prompt.push_back(t);
  }
  RequestResult plain, speculative;
  DecodeStats plain_stats, speculative_stats;
  for (int64_t k : {0, 4}) {
    auto caches = model.make_caches();
    const std::vector<Cache*> layers = cache_pointers(caches);
    const Array logits = model.forward(prompt, layers);
    SpeculativeDecoder decoder(model, layers, k);
    decoder.decode(nullptr, prompt, logits, 48, k == 0 ? plain : speculative,
                   k == 0 ? plain_stats : speculative_stats);
  }
  EXPECT_EQ(speculative.reply, plain.reply);
  ASSERT_EQ(speculative.logits.size(), plain.logits.size());
  const auto speculated = speculative.logits.all(), greedy = plain.logits.all();
  for (size_t i = 0; i < greedy.size(); ++i) {
    for (int64_t v = 0; v < vocab; ++v) {
      ASSERT_NEAR(speculated[i][static_cast<size_t>(v)], greedy[i][static_cast<size_t>(v)], 1e-4f)
          << "token " << i;
    }
  }
  EXPECT_GT(speculative_stats.rounds, 0);
  EXPECT_LT(speculative_stats.forwards, plain_stats.forwards);  // drafts were accepted
}

// The replay with speculation over the prefix cache: plain greedy decoding's tokens and logits,
// the prompt tokens plain decoding with the cache evaluates (the accepted tokens are paged out
// and reused), and fewer decode forwards.
TEST(ReplaySpeculative, AgreesWithPlainDecodingAndReusesAsMuch) {
  const Workload w = parse_workload(
      R"({"id": "a", "messages": [{"role": "user", "content": "abcabcabcabc"}], "max_tokens": 40}
{"id": "b", "after": "a", "messages": [{"role": "user", "content": "again abcabc"}], "max_tokens": 40}
{"id": "a2", "regenerate": "a", "max_tokens": 30}
{"id": "c", "after": "b", "messages": [{"role": "tool", "content": "abc"}], "max_tokens": 40})",
      "test");
  const Model model(tiny_model(/*window=*/8));  // shorter than the prompts: it captures
  const SpeculativeRun speculative = replay_speculative(w, model, {.speculate = 4});
  const SpeculativeRun plain = replay_speculative(w, model, {.speculate = 0});
  ReplayOptions reference;
  reference.with_cache = false;
  const RunResult uncached = replay(w, model, reference);
  const Comparison c = compare(speculative.run, uncached, 1e-4);
  EXPECT_TRUE(c.first_difference.empty()) << c.first_difference;
  ASSERT_EQ(speculative.run.requests.size(), plain.run.requests.size());
  for (size_t i = 0; i < plain.run.requests.size(); ++i) {
    EXPECT_EQ(speculative.run.requests[i].evaluated, plain.run.requests[i].evaluated) << i;
  }
  EXPECT_EQ(plain.decode.rounds, 0);
  EXPECT_GT(speculative.decode.rounds, 0);
  EXPECT_EQ(speculative.decode.tokens, plain.decode.tokens);
  EXPECT_LT(speculative.decode.forwards, plain.decode.forwards);
  // Drafts corrupted at random: rounds reject some, every layer rolls back, and the replies
  // are still plain greedy decoding's.
  const SpeculativeRun noisy = replay_speculative(w, model, {.speculate = 4, .draft_noise = 0.3});
  const Comparison n = compare(noisy.run, uncached, 1e-4);
  EXPECT_TRUE(n.first_difference.empty()) << n.first_difference;
  EXPECT_LT(noisy.decode.accepted, noisy.decode.drafted);
  EXPECT_GT(noisy.decode.accepted, 0);
  for (size_t i = 0; i < plain.run.requests.size(); ++i) {
    EXPECT_EQ(noisy.run.requests[i].evaluated, plain.run.requests[i].evaluated) << i;
  }
}

// --speculate checks both runs with the cache against recomputation: the speculative one and the
// plain one that gives the speed baseline (it was never checked).
TEST(ReplaySpeculative, ThePlainRunWithTheCacheIsCheckedToo) {
  const Workload w = parse_workload(
      R"({"id": "a", "messages": [{"role": "user", "content": "abcabcabc"}], "max_tokens": 12})",
      "test");
  const Model model(tiny_model());
  const auto none = [](size_t, size_t) {};
  SpeculateReport r = speculate_report(w, model, {.speculate = 4}, none, none);
  EXPECT_TRUE(r.agree()) << r.comparison.first_difference << r.plain_comparison.first_difference;
  EXPECT_NE(r.table.find("plain decoding with the cache  agrees too"), std::string::npos);
  r.plain.run.requests[0].reply[0] += 1;  // as if the plain run had gone wrong
  finish_report(r, "test", {.speculate = 4});
  EXPECT_FALSE(r.agree());
  EXPECT_TRUE(r.comparison.first_difference.empty());
  EXPECT_NE(r.table.find("PLAIN DECODING WITH THE CACHE DISAGREES: request 1 (a)"),
            std::string::npos)
      << r.table;
  const nlohmann::json json = nlohmann::json::parse(r.json);
  EXPECT_FALSE(json.at("agree").get<bool>());
  EXPECT_FALSE(json.at("plain_agree").get<bool>());
}

}  // namespace
}  // namespace kvsnap::tools
