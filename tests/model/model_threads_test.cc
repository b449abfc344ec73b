// The built-in model with the kernels' threads (kvsnap::set_threads): a schedule of batched
// forwards — a prefix restored into several sequences (over paged caches their blocks are
// shared, so decode attention multiplies shared blocks for several rows at once), decode steps
// of all of them, prefill chunks of other lengths beside — gives bitwise the same logits with
// 1, 2 or 3 threads: work is split by rows, columns and heads, never inside a sum.
#include <gtest/gtest.h>
#include <kvsnap/ops.h>

#include <cstring>
#include <random>

#include "model/model.h"

namespace kvsnap {
namespace {

ModelConfig config() {
  ModelConfig c;
  c.vocab_size = 64;
  c.hidden = 64;
  c.mlp_hidden = 256;  // wide enough that the products are split between threads
  c.query_heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.window = 8;
  c.pattern = "RSAR";
  c.delta_key_heads = 1;
  c.delta_value_heads = 2;
  c.delta_head_dim = 8;
  return c;
}

std::vector<Array> run_schedule(const Model& model, Model::CacheOptions options, int threads) {
  set_threads(threads);
  std::mt19937 rng(31);
  const auto token = [&] { return static_cast<int32_t>(rng() % 64); };
  auto caches = model.make_caches(options);
  const auto pointers = cache_pointers(caches);
  std::vector<int32_t> prefix(40);
  for (int32_t& t : prefix) t = token();
  std::vector<Array> outs{model.forward(prefix, pointers, /*all_positions=*/true)};
  constexpr int kSequences = 5;
  for (Cache* cache : pointers) {
    const SnapshotPtr snapshot = cache->snapshot(0, 0);
    for (SeqId s = 1; s < kSequences; ++s) EXPECT_TRUE(cache->restore(s, snapshot.get(), 40));
  }
  std::vector<std::vector<int32_t>> pending(kSequences);
  for (int step = 0; step < 14; ++step) {
    std::vector<Model::Chunk> chunks;
    for (SeqId s = 0; s < kSequences; ++s) {
      auto& tokens = pending[static_cast<size_t>(s)];
      tokens.assign(step % 4 == 3 && s % 2 == 0 ? 2 + rng() % 8 : 1, 0);
      for (int32_t& t : tokens) t = token();
      chunks.push_back({s, tokens});
    }
    outs.push_back(model.forward(chunks, pointers, /*all_positions=*/true));
  }
  set_threads(1);
  return outs;
}

void check_every_thread_count(Model::CacheOptions options) {
  const Model model(config());
  const std::vector<Array> one = run_schedule(model, options, 1);
  for (const int threads : {2, 3}) {
    const std::vector<Array> many = run_schedule(model, options, threads);
    ASSERT_EQ(many.size(), one.size());
    for (size_t i = 0; i < one.size(); ++i) {
      ASSERT_EQ(many[i].shape(), one[i].shape());
      ASSERT_EQ(std::memcmp(many[i].data<float>(), one[i].data<float>(),
                            static_cast<size_t>(one[i].nbytes())),
                0)
          << "forward " << i << " with " << threads << " threads";
    }
  }
}

TEST(ModelThreads, EveryThreadCountGivesBitwiseTheSameLogitsOverPagedCaches) {
  check_every_thread_count({.paged = true, .block_tokens = 4});
}

TEST(ModelThreads, EveryThreadCountGivesBitwiseTheSameLogitsOverContiguousCaches) {
  check_every_thread_count({});
}

}  // namespace
}  // namespace kvsnap
