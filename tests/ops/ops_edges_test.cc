// Edge contracts of the reference kernels: a heterogeneous prefill batch with a row that has no
// queries, queries that lie before every position a history holds, AttentionMask::for_row at the
// edges of a mask's rows, and gated_delta over strided views and over no value heads.
#include <gtest/gtest.h>
#include <kvsnap/kv_cache.h>
#include <kvsnap/ops.h>
#include <kvsnap/paged_kv_cache.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ops/decode_kernels.h"
#include "support/test_support.h"

namespace kvsnap::ops_edges_test {
namespace {

using testing::all_close;
using testing::random_array;
using testing::throws_error;

constexpr int64_t kHeads = 2, kQueryHeads = 4, kDepth = 8;
constexpr float kScale = 0.3f;

// Whether every element of `a` is exactly zero.
::testing::AssertionResult all_zero(const Array& a) {
  const std::vector<float> values = a.to_floats();
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] != 0.0f)
      return ::testing::AssertionFailure() << "element " << i << " is " << values[i];
  }
  return ::testing::AssertionSuccess();
}

// Row b of `history` alone, as a contiguous one-row history.
KVHistory row_alone(const KVHistory& history, int64_t b) {
  const KVHistory& own = history.row(b);
  if (history.ragged()) return own.contiguous();
  return KVHistory(own.keys().slice(0, b, b + 1), own.values().slice(0, b, b + 1),
                   own.first_position(), own.oldest_column(), own.window());
}

// sdpa of `batch` over `history` (causal), with the decode kernels and without: a row without
// queries gets zeros, every other row its attention computed alone over its own history, and
// its padding queries zeros.
::testing::AssertionResult rows_attend_alone(const Batch& batch, const Array& q,
                                             const KVHistory& history) {
  const int64_t length = batch.length();
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    const Array out = sdpa(batch, q, history, AttentionMask::causal(), kScale);
    for (int64_t b = 0; b < batch.batch_size(); ++b) {
      const int64_t real = batch.seq_query_lens[static_cast<size_t>(b)];
      const Array row = out.slice(0, b, b + 1);
      if (auto r = all_zero(row.slice(2, real, length)); !r) {
        return r << " (row " << b << "'s padding, kernels " << kernels << ")";
      }
      if (real == 0) continue;
      const Batch one = Batch::uniform(1, real, batch.seq_offsets[static_cast<size_t>(b)]);
      const Array alone = sdpa(one, q.slice(0, b, b + 1).slice(2, 0, real), row_alone(history, b),
                               AttentionMask::causal(), kScale);
      if (auto r = all_close(row.slice(2, 0, real), alone, 1e-5f); !r) {
        return r << " (row " << b << ", kernels " << kernels << ")";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// A prefill step of three sequences (L = 3) whose middle row has no query tokens this step (a
// sequence of the batch that waits), over contiguous per-row histories and over one contiguous
// history of every row: that row's outputs are zeros, the others' those of each row alone.
TEST(OpsEdges, ARowWithoutQueriesInAPrefillBatchGetsZerosOverContiguousHistories) {
  std::mt19937 rng(1);
  const Batch batch = Batch::rows({{0, 5, {1, 2, 3}}, {1, 3, {}}, {2, 0, {4, 5}}});
  ASSERT_EQ(batch.seq_query_lens, (std::vector<int32_t>{3, 0, 2}));
  const Array q = random_array({3, kQueryHeads, 3, kDepth}, rng);
  std::vector<KVHistory> rows;
  for (const int64_t keys : {8, 3, 2}) {
    rows.emplace_back(random_array({1, kHeads, keys, kDepth}, rng),
                      random_array({1, kHeads, keys, kDepth}, rng));
  }
  EXPECT_TRUE(rows_attend_alone(batch, q, KVHistory::of_rows(rows)));
  // One history of every row ([3, H, 8, D]): each row's offset decides what it sees.
  const KVHistory shared(random_array({3, kHeads, 8, kDepth}, rng),
                         random_array({3, kHeads, 8, kDepth}, rng));
  EXPECT_TRUE(rows_attend_alone(batch, q, shared));
}

// The same step over the ragged histories KVCache and PagedKVCache hand back for it: contiguous
// rows and rows of paged blocks (the waiting row's history is its earlier tokens).
TEST(OpsEdges, ARowWithoutQueriesInAPrefillBatchGetsZerosOverCacheHistories) {
  std::mt19937 rng(2);
  std::vector<std::unique_ptr<Attention>> caches;
  caches.push_back(std::make_unique<KVCache>());
  caches.push_back(std::make_unique<PagedKVCache>(PagedKVCache::Options{2, 4}));
  for (const auto& cache : caches) {
    SCOPED_TRACE(dynamic_cast<PagedKVCache*>(cache.get()) != nullptr ? "paged" : "contiguous");
    for (const auto& [seq, length] : {std::pair<int32_t, int64_t>{0, 5}, {1, 3}}) {
      const Batch prefill = Batch::rows({{seq, 0, std::vector<int32_t>(length, 9)}});
      (void)cache->update(prefill, random_array({1, kHeads, length, kDepth}, rng),
                          random_array({1, kHeads, length, kDepth}, rng));
    }
    const Batch batch = Batch::rows({{0, 5, {1, 2, 3}}, {1, 3, {}}, {2, 0, {4, 5}}});
    const KVHistory history = cache->update(batch, random_array({3, kHeads, 3, kDepth}, rng),
                                            random_array({3, kHeads, 3, kDepth}, rng));
    ASSERT_TRUE(history.ragged());
    ASSERT_EQ(history.row(1).length(), 3);  // the waiting row's earlier tokens, nothing new
    EXPECT_TRUE(rows_attend_alone(batch, random_array({3, kQueryHeads, 3, kDepth}, rng), history));
  }
}

// Keys [1, H, K, D] in position order stored rotated: position first + i in column
// (i + oldest) % K.
Array rotated(const Array& a, int64_t oldest) {
  const int64_t k = a.dim(2);
  Array out = Array::zeros(a.dtype(), a.shape());
  out.slice(2, oldest, k).assign(a.slice(2, 0, k - oldest));
  if (oldest > 0) out.slice(2, 0, oldest).assign(a.slice(2, k - oldest, k));
  return out;
}

// A causal query at a position before the history's first one sees no key and gets zeros — in
// position order or rotated, with a lookback window or none, on the decode path (one query) and
// the prefill path, with the decode kernels and without — while the queries at the history's
// positions attend as they would over the same keys at positions from 0.
TEST(OpsEdges, ACausalQueryBeforeTheHistorysFirstPositionGetsZeros) {
  std::mt19937 rng(3);
  const Array k = random_array({1, kHeads, 5, kDepth}, rng);
  const Array v = random_array({1, kHeads, 5, kDepth}, rng);
  const Array q = random_array({1, kQueryHeads, 4, kDepth}, rng);
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    for (const int64_t oldest : {0, 2}) {
      for (const int64_t window : {0, 5}) {
        SCOPED_TRACE(::testing::Message()
                     << "kernels " << kernels << ", oldest " << oldest << ", window " << window);
        const KVHistory history(rotated(k, oldest), rotated(v, oldest), 10, oldest, window);
        const KVHistory from_zero(k, v, 0, 0, window);
        const auto causal = AttentionMask::causal();
        for (const int64_t position : {0, 4, 9}) {  // one query, before position 10
          EXPECT_TRUE(all_zero(
              sdpa(Batch::uniform(1, 1, position), q.slice(2, 0, 1), history, causal, kScale)))
              << "position " << position;
        }
        EXPECT_TRUE(all_close(
            sdpa(Batch::uniform(1, 1, 12), q.slice(2, 0, 1), history, causal, kScale),
            sdpa(Batch::uniform(1, 1, 2), q.slice(2, 0, 1), from_zero, causal, kScale), 1e-5f));
        // Queries at 8..11: the first two before the history, the last two inside it.
        const Array out = sdpa(Batch::uniform(1, 4, 8), q, history, causal, kScale);
        EXPECT_TRUE(all_zero(out.slice(2, 0, 2)));
        EXPECT_TRUE(all_close(
            out.slice(2, 2, 4),
            sdpa(Batch::uniform(1, 2, 0), q.slice(2, 2, 4), from_zero, causal, kScale), 1e-5f));
      }
    }
  }
}

Array ones_mask(int64_t rows, int64_t queries, int64_t keys) {
  return Array::from_ints(std::vector<int32_t>(static_cast<size_t>(rows * queries * keys), 1),
                          {rows, 1, queries, keys});
}

// A row outside an explicit mask's per-row slices has no mask: for_row refuses it with a
// kvsnap::Error naming the row asked for and the mask (its rows), past the end and below 0.
TEST(OpsEdges, ForRowRefusesARowOutsideAPerRowMask) {
  const AttentionMask mask = AttentionMask::from_array(ones_mask(2, 3, 4));
  EXPECT_NO_THROW((void)mask.for_row(1));
  for (const int64_t row : {2, 7, -1}) {
    const std::string said = "AttentionMask::for_row: row " + std::to_string(row) +
                             " is outside [0, 2) of the mask i32[2, 1, 3, 4]";
    EXPECT_TRUE(throws_error([&] { (void)mask.for_row(row); }, {said.c_str()}));
  }
  const AttentionMask both = AttentionMask::causal().intersect(mask);
  EXPECT_TRUE(throws_error([&] { (void)both.for_row(2); },
                           {"AttentionMask::for_row: row 2 is outside [0, 2)"}));
}

// A broadcast (one-row) mask serves every row: for_row returns it unchanged, its array the same
// view; in an intersection only the per-row array is cut, to the row's slice.
TEST(OpsEdges, ForRowOfABroadcastMaskReturnsItUnchanged) {
  std::vector<int32_t> allowed(2 * 3 * 4, 1);
  allowed[1 * 12 + 5] = 0;  // row 1 hides one key
  const Array broadcast = ones_mask(1, 3, 4);
  const AttentionMask mask = AttentionMask::from_array(broadcast);
  for (const int64_t row : {0, 1, 5}) {
    const AttentionMask cut = mask.for_row(row);
    EXPECT_EQ(cut.kind(), AttentionMask::Kind::array) << row;
    ASSERT_EQ(cut.arrays().size(), 1u) << row;
    EXPECT_EQ(cut.arrays()[0].shape(), broadcast.shape()) << row;
    EXPECT_TRUE(cut.arrays()[0].shares_storage(broadcast)) << row;
    EXPECT_EQ(cut.arrays()[0].to_ints(), broadcast.to_ints()) << row;
  }
  const Array per_row = Array::from_ints(allowed, {2, 1, 3, 4});
  const AttentionMask mixed = AttentionMask::sliding_window(3)
                                  .intersect(AttentionMask::from_array(broadcast))
                                  .intersect(AttentionMask::from_array(per_row));
  const AttentionMask cut = mixed.for_row(1);
  EXPECT_TRUE(cut.is_causal());
  EXPECT_EQ(cut.window(), 3);
  ASSERT_EQ(cut.arrays().size(), 2u);
  EXPECT_TRUE(cut.arrays()[0].shares_storage(broadcast));
  EXPECT_EQ(cut.arrays()[0].shape(), broadcast.shape());
  EXPECT_EQ(cut.arrays()[1].shape(), (Shape{1, 1, 3, 4}));
  EXPECT_EQ(cut.arrays()[1].to_ints(), per_row.slice(0, 1, 2).to_ints());
  const AttentionMask plain = AttentionMask::sliding_window(3).for_row(4);  // no arrays
  EXPECT_EQ(plain.kind(), AttentionMask::Kind::sliding_window);
  EXPECT_EQ(plain.window(), 3);
}

// gated_delta reads its inputs through their strides: views whose axes are exchanged (time and
// heads; heads and depth, so the innermost axis is strided) — q, k, v, the gates and the state
// — give bitwise the outputs and states of their contiguous copies.
TEST(OpsEdges, GatedDeltaOnTransposedViewsEqualsItsContiguousCopies) {
  const int64_t B = 2, L = 5, Hk = 2, Hv = 4, Dk = 18, Dv = 3;
  std::mt19937 rng(4);
  const auto gates = [&](float low, float high) {  // [B, Hv, L] stored, viewed as [B, L, Hv]
    return Array::from_floats(
               testing::uniform_floats(static_cast<size_t>(B * Hv * L), rng, low, high), {B, Hv, L})
        .transpose(1, 2);
  };
  const std::vector<int64_t> boundaries{2};
  for (const bool inner : {false, true}) {
    SCOPED_TRACE(inner ? "depth axis strided" : "time axis strided");
    // Stored [B, Hk, L, Dk] (or [B, L, Dk, Hk]) and viewed as [B, L, Hk, Dk].
    const auto view = [&](int64_t heads, int64_t depth, float stddev) {
      const auto values =
          testing::random_floats(static_cast<size_t>(B * L * heads * depth), rng, stddev);
      return inner ? Array::from_floats(values, {B, L, depth, heads}).transpose(2, 3)
                   : Array::from_floats(values, {B, heads, L, depth}).transpose(1, 2);
    };
    const Array q = view(Hk, Dk, 1.0f), k = view(Hk, Dk, 0.3f), v = view(Hv, Dv, 1.0f);
    const Array g = gates(0.8f, 1.0f), beta = gates(0.1f, 0.9f);
    const Array state = random_array({B, Hv, Dk, Dv}, rng).transpose(2, 3);
    for (const Array* a : {&q, &k, &v, &g, &beta, &state}) ASSERT_FALSE(a->is_contiguous());
    const auto views = gated_delta(q, k, v, g, beta, state, boundaries);
    const auto copies = gated_delta(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                    beta.contiguous(), state.contiguous(), boundaries);
    EXPECT_EQ(views.output.shape(), (Shape{B, L, Hv, Dv}));
    EXPECT_EQ(views.output.to_floats(), copies.output.to_floats());
    ASSERT_EQ(views.states.size(), 2u);
    ASSERT_EQ(copies.states.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(views.states[i].to_floats(), copies.states[i].to_floats()) << "state " << i;
    }
  }
}

// No value heads is a multiple of any number of key heads: gated_delta takes it and returns
// outputs [B, L, 0, Dv] and states [B, 0, Dv, Dk], one per boundary and one at the end.
TEST(OpsEdges, GatedDeltaOverNoValueHeadsReturnsEmptyOutputsAndStates) {
  std::mt19937 rng(5);
  const int64_t B = 2, L = 4, Hk = 2, Dk = 6, Dv = 3;
  const Array q = random_array({B, L, Hk, Dk}, rng), k = random_array({B, L, Hk, Dk}, rng);
  const Array v = Array::zeros(DType::f32, {B, L, 0, Dv});
  const Array gates = Array::zeros(DType::f32, {B, L, 0});
  const std::vector<int64_t> boundaries{1, 3};
  for (const Array& state : {Array(), Array::zeros(DType::f32, {B, 0, Dv, Dk})}) {
    const auto result = gated_delta(q, k, v, gates, gates, state, boundaries);
    EXPECT_EQ(result.output.shape(), (Shape{B, L, 0, Dv}));
    EXPECT_EQ(result.output.dtype(), DType::f32);
    ASSERT_EQ(result.states.size(), 3u);
    for (const Array& s : result.states) {
      EXPECT_EQ(s.shape(), (Shape{B, 0, Dv, Dk}));
      EXPECT_EQ(s.dtype(), DType::f32);
    }
  }
}

}  // namespace
}  // namespace kvsnap::ops_edges_test
