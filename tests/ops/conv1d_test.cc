#include <gtest/gtest.h>
#include <kvsnap/ops.h>

#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::all_close;
using testing::random_array;
using testing::throws_error;

TEST(CausalConv1d, MatchesHandComputedExample) {
  // One channel, width 3: y[t] = w0*x[t-2] + w1*x[t-1] + w2*x[t], tail holds x[-2], x[-1].
  const auto x = Array::from_floats(std::vector<float>{1, 2, 3}, {1, 3, 1});
  const auto w = Array::from_floats(std::vector<float>{1, 10, 100}, {1, 3});
  const auto tail = Array::from_floats(std::vector<float>{5, 7}, {1, 2, 1});
  const auto result = causal_conv1d(x, w, tail);
  EXPECT_EQ(result.output.to_floats(),
            (std::vector<float>{5 + 70 + 100, 7 + 10 + 200, 1 + 20 + 300}));
  ASSERT_EQ(result.tails.size(), 1u);
  EXPECT_EQ(result.tails[0].to_floats(), (std::vector<float>{2, 3}));
}

TEST(CausalConv1d, EmptyTailMeansZeros) {
  std::mt19937 rng(1);
  const auto x = random_array({2, 5, 3}, rng);
  const auto w = random_array({3, 4}, rng);
  const auto zero_tail = Array::zeros(DType::f32, {2, 3, 3});
  EXPECT_TRUE(
      all_close(causal_conv1d(x, w, Array()).output, causal_conv1d(x, w, zero_tail).output, 0.0f));
}

TEST(CausalConv1d, SegmentedRunEqualsOneRun) {
  std::mt19937 rng(2);
  for (DType dtype : {DType::f32, DType::bf16}) {
    const auto x = random_array({2, 17, 6}, rng, dtype);
    const auto w = random_array({6, 4}, rng);
    const auto whole = causal_conv1d(x, w, Array());
    const std::vector<int64_t> cuts{1, 5, 6, 12, 17};
    Array tail;
    int64_t start = 0;
    for (int64_t cut : cuts) {
      const auto part = causal_conv1d(x.slice(1, start, cut), w, tail);
      EXPECT_TRUE(all_close(part.output, whole.output.slice(1, start, cut), 1e-5f));
      tail = part.tails.back();
      start = cut;
    }
    EXPECT_TRUE(all_close(tail, whole.tails.back(), 0.0f));
    EXPECT_EQ(tail.dtype(), dtype);  // tails stay in the activation dtype
  }
}

TEST(CausalConv1d, BoundaryTailsEqualTailsOfSeparateRuns) {
  std::mt19937 rng(3);
  const auto x = random_array({1, 10, 4}, rng);
  const auto w = random_array({4, 3}, rng);
  const std::vector<int64_t> boundaries{1, 4, 9};
  const auto whole = causal_conv1d(x, w, Array(), boundaries);
  ASSERT_EQ(whole.tails.size(), 4u);
  for (size_t i = 0; i < boundaries.size(); ++i) {
    const auto prefix = causal_conv1d(x.slice(1, 0, boundaries[i]), w, Array());
    EXPECT_TRUE(all_close(whole.tails[i], prefix.tails.back(), 0.0f)) << boundaries[i];
  }
  // A boundary before W-1 tokens still carries the zero history in front.
  EXPECT_EQ(whole.tails[0].slice(1, 0, 1).to_floats(), (std::vector<float>(4, 0.0f)));
}

TEST(CausalConv1dErrors, ShapesDtypesAndBoundaries) {
  std::mt19937 rng(4);
  const auto x = random_array({1, 6, 4}, rng);
  const auto w = random_array({4, 3}, rng);
  EXPECT_TRUE(throws_error(
      [&] {
        (void)causal_conv1d(x, random_array({5, 3}, rng), Array());
      },
      {"causal_conv1d", "weight", "axis 0 must be 4"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)causal_conv1d(x, w, Array::zeros(DType::f32, {1, 3, 4}));
      },
      {"causal_conv1d", "tail", "axis 1 must be 2"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)causal_conv1d(x, w, Array::zeros(DType::f16, {1, 2, 4}));
      },
      {"causal_conv1d", "x's dtype f32"}));
  const std::vector<int64_t> unsorted{3, 2};
  EXPECT_TRUE(throws_error([&] { (void)causal_conv1d(x, w, Array(), unsorted); },
                           {"boundary 2", "ascending"}));
  const std::vector<int64_t> outside{6};
  EXPECT_TRUE(
      throws_error([&] { (void)causal_conv1d(x, w, Array(), outside); }, {"boundary 6", "(0, 6)"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)causal_conv1d(x.reshape({6, 4}), w, Array());
      },
      {"x", "3-d"}));
}

}  // namespace
}  // namespace kvsnap
