// Speculation over the built-in model's full stack (recurrent, sliding-window and attention
// layers, contiguous or paged): a verify forward of 1 + k tokens, then accepting any a in 0..k,
// gives the logits recomputing the accepted sequence from scratch gives.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <random>

#include "model/model.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::all_close;

ModelConfig speculation_config() {
  ModelConfig c;
  c.vocab_size = 300;
  c.hidden = 32;
  c.mlp_hidden = 48;
  c.query_heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.window = 6;  // shorter than the prompts: the window layer has evicted, so it captures
  c.pattern = "RSARSA";
  c.delta_key_heads = 1;
  c.delta_value_heads = 2;
  c.delta_head_dim = 8;
  return c;
}

// Logits of every position of `tokens` from empty caches: the recomputation.
Array from_scratch(const Model& model, const std::vector<int32_t>& tokens) {
  auto caches = model.make_caches();
  return model.forward(tokens, cache_pointers(caches), true);
}

class ModelRollback : public ::testing::TestWithParam<bool> {};

TEST_P(ModelRollback, EveryAcceptedLengthEqualsRecomputation) {
  const Model model(speculation_config());
  const int64_t vocab = model.config().vocab_size;
  constexpr int64_t k = 4;
  std::mt19937 rng(5);
  std::vector<int32_t> prompt(17);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
  for (int64_t accepted = 0; accepted <= k; ++accepted) {
    SCOPED_TRACE(::testing::Message() << "accepted " << accepted);
    auto caches = model.make_caches({.paged = GetParam(), .block_tokens = 4});
    const std::vector<Cache*> layers = cache_pointers(caches);
    (void)model.forward(prompt, layers);
    Speculation round(layers);
    round.begin(k);
    const std::vector<int32_t> verify = {11, 12, 13, 14, 15};
    std::vector<int32_t> sequence = prompt;
    sequence.insert(sequence.end(), verify.begin(), verify.end());
    const Array logits = model.forward(verify, layers, true);
    const int64_t n = static_cast<int64_t>(prompt.size());
    ASSERT_TRUE(all_close(logits, from_scratch(model, sequence).slice(0, n, n + k + 1), 1e-4f));
    round.accept(accepted);
    for (Cache* layer : layers) {
      if (layer != nullptr) {
        EXPECT_EQ(layer->offset(), n + accepted + 1);
      }
    }
    // Decode after the rollback: the logits recomputation of the accepted sequence gives.
    sequence.resize(static_cast<size_t>(n + accepted + 1));
    const std::vector<int32_t> next = {42, 43};
    sequence.insert(sequence.end(), next.begin(), next.end());
    const Array after = model.forward(next, layers, true);
    const int64_t m = static_cast<int64_t>(sequence.size());
    ASSERT_TRUE(all_close(after, from_scratch(model, sequence).slice(0, m - 2, m), 1e-4f));
  }
}

INSTANTIATE_TEST_SUITE_P(ContiguousAndPaged, ModelRollback, ::testing::Bool());

}  // namespace
}  // namespace kvsnap
