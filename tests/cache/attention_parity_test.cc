// Attention through a cache equals attention over the whole recomputed sequence: for random
// chunkings (decode and prefill mixed), across ring wrap-around, and after snapshot/restore
// and live rewinds that switch to another branch of tokens.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <functional>
#include <memory>
#include <random>

#include "support/cache_support.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::all_close;
using testing::TokenKV;

constexpr int64_t kQueryHeads = 4;  // GQA over TokenKV's 2 KV heads
const TokenKV kv{.heads = 2, .depth = 8};

Array queries(std::span<const int64_t> ids, std::mt19937& rng) {
  return testing::random_array({1, kQueryHeads, static_cast<int64_t>(ids.size()), kv.depth}, rng);
}

struct Scenario {
  std::function<std::unique_ptr<Attention>()> make;
  AttentionMask logical;  // what the full recomputation uses
  int64_t window;         // 0 = unlimited
};

// The attention of `q` (queries at positions [start, start + L)) over every token `ids`
// holds up to start + L, recomputed from scratch with the logical mask.
Array recompute(const std::vector<int64_t>& ids, int64_t start, const Array& q,
                const AttentionMask& logical) {
  const int64_t length = q.dim(2);
  const std::span<const int64_t> prefix(ids.data(), static_cast<size_t>(start + length));
  const KVHistory full(kv.keys(prefix), kv.values(prefix));
  return sdpa(Batch::uniform(1, length, start), q, full, logical, 0.35f);
}

void run(const Scenario& scenario, uint32_t seed, int steps) {
  std::mt19937 rng(seed);
  auto cache = scenario.make();
  std::vector<int64_t> ids;  // the token at each position of the live sequence
  int64_t next_id = 1;
  SnapshotPtr saved;
  std::vector<int64_t> saved_ids;
  const int64_t lengths[] = {1, 1, 1, 1, 2, 3, 5, 8, 13};

  for (int step = 0; step < steps; ++step) {
    const int action = static_cast<int>(rng() % 10);
    if (action == 7) {  // save the whole state
      saved = cache->snapshot(0);
      saved_ids = ids;
      continue;
    }
    if (action == 8 && saved != nullptr) {  // return to the saved state, then a new branch
      ASSERT_TRUE(cache->restore(saved.get(), static_cast<int64_t>(saved_ids.size())));
      ids = saved_ids;
      continue;
    }
    if (action == 9 && !ids.empty()) {  // live rewind where the kind allows it
      const int64_t target = static_cast<int64_t>(rng() % ids.size());
      const bool allowed = scenario.window == 0 || cache->offset() <= scenario.window;
      ASSERT_EQ(cache->restore(nullptr, target), allowed);
      if (allowed) ids.resize(static_cast<size_t>(target));
      continue;
    }
    const int64_t length = lengths[rng() % std::size(lengths)];
    std::vector<int64_t> chunk;
    for (int64_t i = 0; i < length; ++i) chunk.push_back(next_id++);
    const int64_t start = cache->offset();
    const Array q = queries(chunk, rng);
    const Batch batch = Batch::uniform(1, length, start);
    const KVHistory history = cache->update(batch, kv.keys(chunk), kv.values(chunk));
    ids.insert(ids.end(), chunk.begin(), chunk.end());
    const Array got = sdpa(batch, q, history, AttentionMask::causal(), 0.35f);
    ASSERT_TRUE(all_close(got, recompute(ids, start, q, scenario.logical), 1e-5f))
        << "seed " << seed << " step " << step << " start " << start << " length " << length;
  }
}

TEST(AttentionParity, KVCacheEqualsRecomputationForRandomChunkings) {
  const Scenario scenario{[] { return std::make_unique<KVCache>(); }, AttentionMask::causal(), 0};
  for (uint32_t seed = 1; seed <= 20; ++seed) run(scenario, seed, 60);
}

TEST(AttentionParity, RotatingCacheEqualsSlidingWindowRecomputation) {
  for (int64_t window : {1, 3, 8, 16}) {
    const Scenario scenario{[window] { return std::make_unique<RotatingKVCache>(window); },
                            AttentionMask::sliding_window(window), window};
    for (uint32_t seed = 1; seed <= 15; ++seed) run(scenario, seed * 100 + window, 60);
  }
}

TEST(AttentionParity, RotatingCacheOverLongDecodeAfterPrefill) {
  RotatingKVCache cache(32);
  std::mt19937 rng(9);
  std::vector<int64_t> ids = testing::id_range(1, 100);
  cache.update(Batch::uniform(1, 100, 0), kv.keys(ids), kv.values(ids));
  for (int64_t step = 0; step < 80; ++step) {
    const std::vector<int64_t> token{1000 + step};
    const Array q = queries(token, rng);
    const Batch batch = Batch::uniform(1, 1, cache.offset());
    const KVHistory history = cache.update(batch, kv.keys(token), kv.values(token));
    ids.push_back(token[0]);
    const Array expected =
        recompute(ids, batch.seq_offsets[0], q, AttentionMask::sliding_window(32));
    ASSERT_TRUE(all_close(sdpa(batch, q, history, AttentionMask::causal(), 0.35f), expected, 1e-5f))
        << step;
  }
}

}  // namespace
}  // namespace kvsnap
