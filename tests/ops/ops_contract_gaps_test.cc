// A float mask's bias that brings a score to -1e30 or below hides the key (attention.h,
// AttentionMask::from_array): a query that sees only such keys gets zeros, as one that sees
// nothing — not the mean of their values, which a softmax over equal hidden scores would give.
// Checked through sdpa over a contiguous history and over the histories KVCache and PagedKVCache
// hand back, on a prefill chunk and a decode step, with the decode kernels and without.
#include <gtest/gtest.h>
#include <kvsnap/kv_cache.h>
#include <kvsnap/ops.h>
#include <kvsnap/paged_kv_cache.h>

#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ops/decode_kernels.h"
#include "support/test_support.h"

namespace kvsnap::ops_contract_gaps_test {
namespace {

using testing::all_close;
using testing::random_array;

constexpr int64_t kHeads = 2, kQueryHeads = 4, kDepth = 8, kKeys = 7;
constexpr float kScale = 0.4f;
constexpr float kLowest = std::numeric_limits<float>::lowest();  // finfo(float32).min
constexpr float kInf = std::numeric_limits<float>::infinity();

// Query patterns of the mask, by query index l (mod 5), over `keys` key positions:
//   0: every key biased by lowest()  (a padding row)      -> zeros
//   1: every key biased by exactly -1e30                   -> zeros
//   2: every key biased by -3e30                           -> zeros
//   3: keys 0 and 2 lowest(), 3 -inf, the last -1e30, the rest 0 -> attends to the rest alone
//   4: key 1 biased by 0.5, every other lowest()           -> attends to key 1 alone
float bias(int64_t pattern, int64_t key, int64_t keys) {
  switch (pattern) {
    case 0:
      return kLowest;
    case 1:
      return -1e30f;
    case 2:
      return -3e30f;
    case 3:
      if (key == 3) return -kInf;
      return key == 0 || key == 2 ? kLowest : key == keys - 1 ? -1e30f : 0.0f;
    default:
      return key == 1 ? 0.5f : kLowest;
  }
}
bool hidden_pattern(int64_t pattern) { return pattern <= 2; }

// The additive f32 mask [1, 1, L, keys] (query l of pattern (first_pattern + l) % 5) and the
// boolean i32 mask that shows exactly the keys whose bias leaves them visible.
struct Masks {
  AttentionMask additive, boolean;
};
Masks masks(int64_t queries, int64_t keys, int64_t first_pattern) {
  std::vector<float> additive;
  std::vector<int32_t> boolean;
  for (int64_t l = 0; l < queries; ++l) {
    for (int64_t k = 0; k < keys; ++k) {
      const float b = bias((first_pattern + l) % 5, k, keys);
      additive.push_back(b);
      boolean.push_back(b > -1e30f ? 1 : 0);
    }
  }
  return {AttentionMask::from_array(Array::from_floats(additive, {1, 1, queries, keys})),
          AttentionMask::from_array(Array::from_ints(boolean, {1, 1, queries, keys}))};
}

// Query l of `out` [1, Hq, L, Dv], every head.
std::vector<float> query(const Array& out, int64_t l) {
  std::vector<float> q;
  for (int64_t h = 0; h < out.dim(1); ++h) {
    const std::vector<float> row = out.slice(1, h, h + 1).slice(2, l, l + 1).to_floats();
    q.insert(q.end(), row.begin(), row.end());
  }
  return q;
}

// sdpa of `batch` over `history` under the additive mask: the queries of the hidden patterns get
// exact zeros, the others attend to the keys the boolean mask shows (and get something else than
// zeros); with the decode kernels and without.
::testing::AssertionResult hides_as_promised(const Batch& batch, const Array& q,
                                             const KVHistory& history, int64_t first_pattern) {
  const int64_t queries = batch.length();
  const Masks m = masks(queries, history.length(), first_pattern);
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    const Array out = sdpa(batch, q, history, m.additive, kScale);
    const Array expected = sdpa(batch, q, history, m.boolean, kScale);
    if (auto same = all_close(out, expected, 1e-5f); !same)
      return same << " (kernels " << kernels << ")";
    for (int64_t l = 0; l < queries; ++l) {
      const int64_t pattern = (first_pattern + l) % 5;
      bool zeros = true;
      for (const float x : query(out, l)) zeros &= x == 0.0f;
      if (zeros != hidden_pattern(pattern)) {
        return ::testing::AssertionFailure()
               << "query " << l << " (pattern " << pattern << ", kernels " << kernels << ") "
               << (zeros ? "got zeros" : "did not get zeros");
      }
    }
  }
  return ::testing::AssertionSuccess();
}

struct Histories {
  std::string name;
  KVHistory prefill;  // the first kKeys - 1 keys
  KVHistory decode;   // all kKeys keys
};

// The same keys and values as a contiguous history and as the histories KVCache and
// PagedKVCache (blocks of 4 tokens) return for a prefill of kKeys - 1 tokens, then a decode
// step of one.
std::vector<Histories> histories(const Array& keys, const Array& values,
                                 std::vector<std::unique_ptr<Attention>>& caches) {
  const int64_t first = kKeys - 1;
  std::vector<Histories> out;
  out.push_back({"contiguous", KVHistory(keys.slice(2, 0, first), values.slice(2, 0, first)),
                 KVHistory(keys, values)});
  caches.push_back(std::make_unique<KVCache>());
  caches.push_back(std::make_unique<PagedKVCache>(PagedKVCache::Options{4, 4}));
  for (const auto& cache : caches) {
    Histories h;
    h.name = dynamic_cast<PagedKVCache*>(cache.get()) != nullptr ? "PagedKVCache" : "KVCache";
    h.prefill = cache->update(Batch::uniform(1, first, 0), keys.slice(2, 0, first),
                              values.slice(2, 0, first));
    h.decode = cache->update(Batch::uniform(1, 1, first), keys.slice(2, first, kKeys),
                             values.slice(2, first, kKeys));
    out.push_back(std::move(h));
  }
  return out;
}

TEST(SdpaFloatMask, AScoreBiasedToMinus1e30OrBelowIsHiddenSoAQuerySeeingOnlySuchKeysGetsZeros) {
  std::mt19937 rng(7);
  const Array keys = random_array({1, kHeads, kKeys, kDepth}, rng);
  const Array values = random_array({1, kHeads, kKeys, kDepth}, rng);
  const Array prefill_q = random_array({1, kQueryHeads, kKeys - 1, kDepth}, rng);
  const Array decode_q = random_array({1, kQueryHeads, 1, kDepth}, rng);
  std::vector<std::unique_ptr<Attention>> caches;
  for (const Histories& h : histories(keys, values, caches)) {
    ASSERT_EQ(h.prefill.length(), kKeys - 1) << h.name;
    ASSERT_EQ(h.decode.length(), kKeys) << h.name;
    // A prefill chunk of every pattern (queries 0..5: patterns 0..4, then 0 again).
    EXPECT_TRUE(hides_as_promised(Batch::uniform(1, kKeys - 1, 0), prefill_q, h.prefill, 0))
        << h.name << " prefill";
    // A decode step of each pattern.
    for (int64_t pattern = 0; pattern < 5; ++pattern) {
      EXPECT_TRUE(hides_as_promised(Batch::uniform(1, 1, kKeys - 1), decode_q, h.decode, pattern))
          << h.name << " decode, pattern " << pattern;
    }
  }
}

// The threshold, not any large bias: keys every one biased by -1e29 (above it) stay visible, and
// a query over them gets about the mean of their values — what the hidden ones must not give.
TEST(SdpaFloatMask, ABiasAboveMinus1e30HidesNothing) {
  std::mt19937 rng(8);
  const Array keys = random_array({1, kHeads, kKeys, kDepth}, rng);
  const Array values = random_array({1, kHeads, kKeys, kDepth}, rng);
  const Array q = random_array({1, kQueryHeads, 1, kDepth}, rng);
  const AttentionMask mask = AttentionMask::from_array(
      Array::from_floats(std::vector<float>(kKeys, -1e29f), {1, 1, 1, kKeys}));
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    const Array out =
        sdpa(Batch::uniform(1, 1, kKeys - 1), q, KVHistory(keys, values), mask, kScale);
    // Each query head's output: the mean over the keys of its key head's values.
    std::vector<float> mean;
    for (int64_t h = 0; h < kQueryHeads; ++h) {
      const int64_t g = h / (kQueryHeads / kHeads);
      for (int64_t d = 0; d < kDepth; ++d) {
        float sum = 0.0f;
        for (int64_t k = 0; k < kKeys; ++k) {
          sum += values.slice(1, g, g + 1).slice(2, k, k + 1).slice(3, d, d + 1).to_floats()[0];
        }
        mean.push_back(sum / static_cast<float>(kKeys));
      }
    }
    EXPECT_TRUE(all_close(out, Array::from_floats(mean, {1, kQueryHeads, 1, kDepth}), 1e-4f))
        << "kernels " << kernels;
  }
}

}  // namespace
}  // namespace kvsnap::ops_contract_gaps_test
