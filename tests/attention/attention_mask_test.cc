#include <gtest/gtest.h>
#include <kvsnap/attention.h>

#include <limits>

#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::throws_error;
constexpr float kInf = std::numeric_limits<float>::infinity();

// The physical mask as 0/1 visibility, row-major [B, H, L, K]; all ones for none().
std::vector<int> visibility(const AttentionMask& physical, const Batch& batch, int64_t keys) {
  if (physical.arrays().empty()) {
    return std::vector<int>(static_cast<size_t>(batch.batch_size() * batch.length() * keys), 1);
  }
  std::vector<int> out;
  for (float v : physical.arrays().front().to_floats()) out.push_back(v == -kInf ? 0 : 1);
  return out;
}

KVHistory history_of(int64_t keys, int64_t first_position = 0, int64_t oldest_column = 0,
                     int64_t window = 0) {
  return KVHistory(Array::zeros(DType::f32, {1, 1, keys, 2}),
                   Array::zeros(DType::f32, {1, 1, keys, 2}), first_position, oldest_column,
                   window);
}

TEST(AttentionMask, KindsAndCanonicalIntersection) {
  EXPECT_EQ(AttentionMask::none().kind(), AttentionMask::Kind::none);
  EXPECT_EQ(AttentionMask::causal().kind(), AttentionMask::Kind::causal);
  EXPECT_EQ(AttentionMask::sliding_window(4).kind(), AttentionMask::Kind::sliding_window);
  const auto array = AttentionMask::from_array(Array::zeros(DType::i32, {1, 1, 2, 2}));
  EXPECT_EQ(array.kind(), AttentionMask::Kind::array);
  EXPECT_EQ(array.intersect(AttentionMask::causal()).kind(), AttentionMask::Kind::intersection);
  // causal within a window is the window; two windows keep the narrower.
  const auto both = AttentionMask::causal().intersect(AttentionMask::sliding_window(8));
  EXPECT_EQ(both.kind(), AttentionMask::Kind::sliding_window);
  EXPECT_EQ(both.intersect(AttentionMask::sliding_window(3)).window(), 3);
  EXPECT_EQ(AttentionMask::sliding_window(3).intersect(AttentionMask::sliding_window(8)).window(),
            3);
}

TEST(AttentionMask, CausalOverAChunkMatchesHandComputed) {
  // 3 queries at positions 2, 3, 4 over 5 keys at positions 0..4.
  const auto batch = Batch::uniform(1, 3, 2);
  const auto mask = history_of(5).apply_mask(batch, AttentionMask::causal());
  EXPECT_EQ(visibility(mask, batch, 5), (std::vector<int>{1, 1, 1, 0, 0,  //
                                                          1, 1, 1, 1, 0,  //
                                                          1, 1, 1, 1, 1}));
}

TEST(AttentionMask, SlidingWindowMatchesHandComputed) {
  // window 2: query i sees i-1 and i.
  const auto batch = Batch::uniform(1, 3, 2);
  const auto mask = history_of(5).apply_mask(batch, AttentionMask::sliding_window(2));
  EXPECT_EQ(visibility(mask, batch, 5), (std::vector<int>{0, 1, 1, 0, 0,  //
                                                          0, 0, 1, 1, 0,  //
                                                          0, 0, 0, 1, 1}));
}

TEST(AttentionMask, HistoryWindowAppliesWithoutALogicalMask) {
  // A rotating cache's history carries its window even when the caller passes none(): as a
  // lookback only. Query 3 sees 1..4 (a later key too: none() is not causal), query 4 sees 2..4.
  const auto batch = Batch::uniform(1, 2, 3);
  const auto mask = history_of(5, 0, 0, 3).apply_mask(batch, AttentionMask::none());
  EXPECT_EQ(visibility(mask, batch, 5), (std::vector<int>{0, 1, 1, 1, 1,  //
                                                          0, 0, 1, 1, 1}));
  const auto causal = history_of(5, 0, 0, 3).apply_mask(batch, AttentionMask::causal());
  EXPECT_EQ(visibility(causal, batch, 5), (std::vector<int>{0, 1, 1, 1, 0,  //
                                                            0, 0, 1, 1, 1}));
}

TEST(AttentionMask, LookbackIsTheNonCausalHalfOfASlidingWindow) {
  const AttentionMask lookback = AttentionMask::lookback(3);
  EXPECT_EQ(lookback.kind(), AttentionMask::Kind::lookback);
  EXPECT_FALSE(lookback.is_causal());
  EXPECT_TRUE(lookback.allows(5, 9));   // later keys stay visible
  EXPECT_TRUE(lookback.allows(5, 3));   // 5 - 3 < 3
  EXPECT_FALSE(lookback.allows(5, 2));  // three positions back: outside
  const AttentionMask window = lookback.intersect(AttentionMask::causal());
  EXPECT_EQ(window.kind(), AttentionMask::Kind::sliding_window);
  EXPECT_FALSE(window.allows(5, 6));
  EXPECT_TRUE(throws_error([] { (void)AttentionMask::lookback(0); }, {"lookback", "window 0"}));
}

TEST(AttentionMask, RingOrderColumnsMapToTheirPositions) {
  // Ring of 4 slots holding positions 6..9, oldest (6) in column 2: columns hold 8, 9, 6, 7.
  const auto history = history_of(4, 6, 2);
  EXPECT_EQ(history.position(0), 8);
  EXPECT_EQ(history.position(1), 9);
  EXPECT_EQ(history.position(2), 6);
  EXPECT_EQ(history.position(3), 7);
  const auto batch = Batch::uniform(1, 1, 8);  // query at 8 sees 6, 7, 8 but not 9
  const auto mask = history.apply_mask(batch, AttentionMask::causal());
  EXPECT_EQ(visibility(mask, batch, 4), (std::vector<int>{1, 0, 1, 1}));
}

TEST(AttentionMask, DecodeThatSeesEverythingNeedsNoMask) {
  const auto batch = Batch::uniform(1, 1, 4);
  EXPECT_TRUE(history_of(5).apply_mask(batch, AttentionMask::causal()).arrays().empty());
  EXPECT_TRUE(history_of(4, 6, 2)
                  .apply_mask(Batch::uniform(1, 1, 9), AttentionMask::sliding_window(4))
                  .arrays()
                  .empty());
  EXPECT_FALSE(history_of(4, 6, 2)
                   .apply_mask(Batch::uniform(1, 1, 9), AttentionMask::sliding_window(3))
                   .arrays()
                   .empty());
}

TEST(AttentionMask, ExplicitBoolArrayIndexesAbsoluteKeyPositions) {
  // Keys at positions 2..4 (a history that starts at 2); the array covers positions 0..4.
  const std::vector<int32_t> allowed{1, 1, 0, 1, 1,   //  query 0
                                     1, 1, 1, 0, 1};  //  query 1
  const auto logical = AttentionMask::from_array(Array::from_ints(allowed, {1, 1, 2, 5}));
  const auto batch = Batch::uniform(1, 2, 0);
  const auto mask = history_of(3, 2).apply_mask(batch, logical);
  EXPECT_EQ(visibility(mask, batch, 3), (std::vector<int>{0, 1, 1,  //
                                                          1, 0, 1}));
}

TEST(AttentionMask, AdditiveArrayIsAddedAndIntersectedWithCausal) {
  const std::vector<float> bias{0.5f, -1.0f, 2.0f, 3.0f};
  const auto logical = AttentionMask::from_array(Array::from_floats(bias, {1, 1, 2, 2}))
                           .intersect(AttentionMask::causal());
  const auto mask = history_of(2).apply_mask(Batch::uniform(1, 2, 0), logical);
  ASSERT_EQ(mask.arrays().size(), 1u);
  EXPECT_EQ(mask.arrays().front().to_floats(), (std::vector<float>{0.5f, -kInf, 2.0f, 3.0f}));
}

TEST(AttentionMask, PaddingQueriesSeeNothing) {
  Batch batch = Batch::uniform(2, 3, 0);
  batch.seq_query_lens[1] = 1;
  const auto mask = history_of(3).apply_mask(batch, AttentionMask::none());
  EXPECT_EQ(visibility(mask, batch, 3), (std::vector<int>{1, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                                          1, 1, 1, 0, 0, 0, 0, 0, 0}));
}

// An explicit mask reads the same in any layout: f32 in order (read in place), a view in another
// order (a transposed array) and i32 booleans (1 visible, 0 hidden).
TEST(AttentionMask, ExplicitArraysOfAnyLayoutReadAlike) {
  const KVHistory history(Array::zeros(DType::f32, {1, 1, 4, 2}),
                          Array::zeros(DType::f32, {1, 1, 4, 2}), 0, 0, 0);
  const Batch batch = Batch::uniform(1, 2, 2);  // queries at positions 2 and 3, keys 0 to 3
  constexpr float kHide = -std::numeric_limits<float>::infinity();
  const std::vector<float> bias{0, kHide, 0.5f, kHide, kHide, 0, 0, -0.25f};  // [1, 1, 2, 4]
  const std::vector<float> transposed_bias{0, kHide, kHide, 0, 0.5f, 0, kHide, -0.25f};
  const std::vector<int32_t> visible{1, 0, 1, 0, 0, 1, 1, 1};
  const auto built = [&](const Array& array) {
    return history.apply_mask(batch, AttentionMask::from_array(array)).arrays().front().to_floats();
  };
  const std::vector<float> expected{0, kHide, 0.5f, kHide, kHide, 0, 0, -0.25f};
  EXPECT_EQ(built(Array::from_floats(bias, {1, 1, 2, 4})), expected);
  const Array view = Array::from_floats(transposed_bias, {1, 1, 4, 2}).transpose(2, 3);
  ASSERT_FALSE(view.is_contiguous());
  EXPECT_EQ(built(view), expected);
  const std::vector<float> hidden{0, kHide, 0, kHide, kHide, 0, 0, 0};
  EXPECT_EQ(built(Array::from_ints(visible, {1, 1, 2, 4})), hidden);
}

// A batch has a row per row of the history (or any rows over one row of keys), and a mask array
// 1 or B rows, ragged histories included: a 5-row mask over 2 rows was sliced as if it fit.
TEST(AttentionMaskErrors, BatchAndMaskRowsMustFitTheHistorys) {
  const KVHistory two(Array::zeros(DType::f32, {2, 1, 3, 2}),
                      Array::zeros(DType::f32, {2, 1, 3, 2}), 0, 0, 0);
  EXPECT_TRUE(
      throws_error([&] { (void)two.apply_mask(Batch::uniform(3, 1, 2), AttentionMask::causal()); },
                   {"KVHistory::apply_mask: a batch of 3 rows for a history of 2"}));
  EXPECT_NO_THROW((void)two.apply_mask(Batch::uniform(2, 1, 2), AttentionMask::causal()));
  const KVHistory ragged = KVHistory::of_rows({history_of(3), history_of(2)});
  const auto rows_of = [](int64_t rows) {
    return AttentionMask::from_array(Array::zeros(DType::f32, {rows, 1, 1, 4}));
  };
  EXPECT_TRUE(throws_error([&] { (void)ragged.apply_mask(Batch::uniform(2, 1, 2), rows_of(5)); },
                           {"KVHistory::apply_mask: mask array f32[5, 1, 1, 4] does not fit a "
                            "batch of 2 rows"}));
  EXPECT_NO_THROW((void)ragged.apply_mask(Batch::uniform(2, 1, 2), rows_of(2)));
  EXPECT_NO_THROW((void)ragged.apply_mask(Batch::uniform(2, 1, 2), rows_of(1)));
}

TEST(AttentionMaskErrors, BadWindowAndArrays) {
  EXPECT_TRUE(throws_error([] { (void)AttentionMask::sliding_window(0); },
                           {"AttentionMask::sliding_window", "window 0"}));
  EXPECT_TRUE(throws_error(
      [] {
        (void)AttentionMask::from_array(Array::zeros(DType::f32, {2, 2}));
      },
      {"AttentionMask::from_array", "f32[2, 2]"}));
  const auto logical = AttentionMask::from_array(Array::zeros(DType::i32, {1, 1, 2, 3}));
  EXPECT_TRUE(
      throws_error([&] { (void)history_of(4).apply_mask(Batch::uniform(1, 2, 0), logical); },
                   {"KVHistory::apply_mask", "i32[1, 1, 2, 3]"}));
  EXPECT_TRUE(throws_error([] { (void)history_of(4, 0, 4); }, {"KVHistory", "oldest column 4"}));
  EXPECT_TRUE(throws_error(
      [] {
        (void)KVHistory(Array::zeros(DType::f32, {1, 2, 4, 8}),
                        Array::zeros(DType::f32, {1, 2, 3, 8}));
      },
      {"KVHistory", "f32[1, 2, 4, 8]", "f32[1, 2, 3, 8]"}));
}

}  // namespace
}  // namespace kvsnap
