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

namespace kvsnap::attention_parity_test {
namespace {

using testing::all_close;
using testing::TokenKV;

constexpr int64_t kQueryHeads = 4;  // GQA over TokenKV's 2 KV heads
const TokenKV kv{.heads = 2, .depth = 8};

Array queries(std::span<const int64_t> ids, std::mt19937& rng) {
  return testing::random_array({1, kQueryHeads, static_cast<int64_t>(ids.size()), kv.depth}, rng);
}

// The caller's logical mask for queries [start, start + length).
using MaskFor = std::function<AttentionMask(int64_t start, int64_t length)>;

AttentionMask causal_mask(int64_t, int64_t) { return AttentionMask::causal(); }
AttentionMask no_mask(int64_t, int64_t) { return AttentionMask::none(); }
// Causal, except that tokens in the same span of 5 positions see each other both ways (an
// image's patches, a prefix-LM prompt): a boolean array over absolute key positions.
AttentionMask span_mask(int64_t start, int64_t length) {
  const int64_t keys = start + length;
  std::vector<int32_t> visible;
  for (int64_t l = 0; l < length; ++l) {
    for (int64_t k = 0; k < keys; ++k) {
      visible.push_back(k <= start + l || k / 5 == (start + l) / 5 ? 1 : 0);
    }
  }
  return AttentionMask::from_array(Array::from_ints(visible, {1, 1, length, keys}));
}

struct Scenario {
  std::function<std::unique_ptr<Attention>()> make;
  int64_t window;              // 0 = unlimited
  MaskFor mask = causal_mask;  // what the caller passes with the cache's history
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
    // The cache's window hides only keys older than the window; the caller's mask the rest.
    const AttentionMask logical = scenario.mask(start, length);
    const AttentionMask expected_mask =
        scenario.window > 0 ? logical.intersect(AttentionMask::lookback(scenario.window)) : logical;
    const Array got = sdpa(batch, q, history, logical, 0.35f);
    ASSERT_TRUE(all_close(got, recompute(ids, start, q, expected_mask), 1e-5f))
        << "seed " << seed << " step " << step << " start " << start << " length " << length;
  }
}

TEST(AttentionParity, KVCacheEqualsRecomputationForRandomChunkings) {
  for (const MaskFor& mask : {MaskFor(causal_mask), MaskFor(no_mask), MaskFor(span_mask)}) {
    const Scenario scenario{[] { return std::make_unique<KVCache>(); }, 0, mask};
    for (uint32_t seed = 1; seed <= 20; ++seed) run(scenario, seed, 60);
  }
}

TEST(AttentionParity, PagedCacheEqualsRecomputationForRandomChunkings) {
  for (int64_t block : {1, 3, 16}) {
    for (const MaskFor& mask : {MaskFor(causal_mask), MaskFor(span_mask)}) {
      const Scenario scenario{
          [block] {
            return std::make_unique<PagedKVCache>(PagedKVCache::Options{block, 2});
          },
          0, mask};
      for (uint32_t seed = 1; seed <= 12; ++seed) run(scenario, seed * 10 + block, 60);
    }
  }
}

TEST(AttentionParity, RotatingCacheEqualsSlidingWindowRecomputation) {
  for (int64_t window : {1, 3, 8, 16}) {
    const Scenario scenario{[window] { return std::make_unique<RotatingKVCache>(window); }, window};
    for (uint32_t seed = 1; seed <= 15; ++seed) run(scenario, seed * 100 + window, 60);
  }
}

TEST(AttentionParity, RotatingCacheHonoursNonCausalAndBidirectionalMasks) {
  // The window hides only keys older than query - window + 1: none() lets a chunk's queries
  // see its later keys, and a span mask's bidirectional spans survive inside the window.
  for (const MaskFor& mask : {MaskFor(no_mask), MaskFor(span_mask)}) {
    for (int64_t window : {1, 3, 8, 16}) {
      const Scenario scenario{[window] { return std::make_unique<RotatingKVCache>(window); },
                              window, mask};
      for (uint32_t seed = 1; seed <= 10; ++seed) run(scenario, seed * 100 + window, 60);
    }
  }
}

TEST(AttentionParity, AWindowQuerySeesLaterKeysOfItsChunkUnderNone) {
  // The case: one 6-token update into a window of 4, attention with none().
  RotatingKVCache cache(4);
  const std::vector<int64_t> ids = testing::id_range(1, 6);
  std::mt19937 rng(3);
  const Array q = queries(ids, rng);
  const Batch batch = Batch::uniform(1, 6, 0);
  const KVHistory history = cache.update(batch, kv.keys(ids), kv.values(ids));
  const Array got = sdpa(batch, q, history, AttentionMask::none(), 0.35f);
  // Query 0 sees keys 0..5; query 5 sees 2..5.
  const Array expected = recompute(ids, 0, q, AttentionMask::lookback(4));
  EXPECT_TRUE(all_close(got, expected, 1e-5f));
  EXPECT_FALSE(all_close(got, recompute(ids, 0, q, AttentionMask::sliding_window(4)), 1e-3f));
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
}  // namespace kvsnap::attention_parity_test
