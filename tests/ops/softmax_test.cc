// The softmax pieces attention runs on (ops/softmax.h, ops/visibility.h): the exponentials within a
// few ulp of exp in double, masked entries weighing exactly 0, the maximum exact, the lanes past
// a row's end untouched, and the numerators' sum what the division needs — the kernels in every
// variant this CPU runs (softmax_variants), not only the one attention picks.
#include "ops/softmax.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "ops/visibility.h"

namespace kvsnap::detail {
namespace {

TEST(Softmax, ExponentialsAreWithinAFewUlpOfDoubleAndTheSumIsTheirs) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> value(-90.0f, 20.0f);
  for (const SoftmaxVariant& variant : softmax_variants()) {
    SCOPED_TRACE(variant.name);
    for (const int64_t n : {0, 1, 7, 15, 16, 17, 31, 33, 100, 257, 1000}) {
      std::vector<float> row(static_cast<size_t>(n) + 8, 7.0f);  // 8 guard floats past the end
      for (int64_t i = 0; i < n; ++i) row[static_cast<size_t>(i)] = value(rng);
      const std::vector<float> in = row;
      const float shift = 3.5f;
      const float sum = variant.exp_shifted(row.data(), n, shift);
      double expected_sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float x = in[static_cast<size_t>(i)] - shift;  // rounded to float, as the kernel does
        const double expected = std::exp(static_cast<double>(x));
        expected_sum += expected;
        const float got = row[static_cast<size_t>(i)];
        if (expected < 1e-37) {  // below float's normal range: 0 or a tiny denormal
          EXPECT_LE(got, 1e-37f) << "n " << n << " at " << i;
        } else {
          EXPECT_NEAR(got, expected, 4e-7 * expected) << "n " << n << " at " << i;
        }
      }
      EXPECT_NEAR(sum, expected_sum, 1e-6 * expected_sum + 1e-30) << "n " << n;
      for (size_t i = static_cast<size_t>(n); i < row.size(); ++i) EXPECT_EQ(row[i], 7.0f);
    }
  }
}

// Exponentials whose results are denormal (below e^-87.3) are right to within a denormal's last
// bit, never 0 where the exact value rounds to a denormal, and from e^-110 down exactly 0; those
// just below float's largest are finite and right, and from e^89 up +inf. The AVX2 variant
// applies 2^k in two halves, which must round once, as AVX-512's scalef does (a regrouping of
// the halves, which -ffast-math allowed, overflowed at k = 128 and underflowed at k = -150).
TEST(Softmax, ExponentialsAtTheEdgesOfTheFloatRangeRoundOnce) {
  const double denormal_bit = std::ldexp(1.0, -149);
  for (const SoftmaxVariant& variant : softmax_variants()) {
    SCOPED_TRACE(variant.name);
    std::vector<float> row;
    for (float x = -104.5f; x <= -86.0f; x += 0.015625f) row.push_back(x);
    for (float x = 88.0f; x <= 88.72f; x += 0.0078125f) row.push_back(x);
    for (const float x : {-110.0f, -120.0f, -1e30f, 89.0f, 100.0f}) row.push_back(x);
    const std::vector<float> in = row;
    variant.exp_shifted(row.data(), static_cast<int64_t>(row.size()), 0.0f);
    for (size_t i = 0; i < row.size(); ++i) {
      const double expected = std::exp(static_cast<double>(in[i]));
      if (in[i] <= -110.0f) {
        EXPECT_EQ(row[i], 0.0f) << in[i];
      } else if (in[i] >= 89.0f) {
        EXPECT_EQ(row[i], std::numeric_limits<float>::infinity()) << in[i];
      } else {
        EXPECT_NEAR(row[i], expected, 4e-7 * expected + denormal_bit) << in[i];
        if (expected > 0.51 * denormal_bit) {  // rounds up to the smallest denormal
          EXPECT_GT(row[i], 0.0f) << in[i];
        }
      }
    }
  }
}

TEST(Softmax, TheLargestEntryWeighsOneAndMaskedEntriesZero) {
  for (const SoftmaxVariant& variant : softmax_variants()) {
    SCOPED_TRACE(variant.name);
    std::vector<float> row{2.0f, kMasked, -1.0f, kMasked, 2.0f};
    const float sum = variant.exp_shifted(row.data(), static_cast<int64_t>(row.size()), 2.0f);
    EXPECT_EQ(row[0], 1.0f);
    EXPECT_EQ(row[4], 1.0f);
    EXPECT_EQ(row[1], 0.0f);
    EXPECT_EQ(row[3], 0.0f);
    EXPECT_NEAR(row[2], std::exp(-3.0), 4e-7 * std::exp(-3.0));
    EXPECT_NEAR(sum, 2.0 + std::exp(-3.0), 1e-6);
  }
}

TEST(Softmax, MaximumIsExactForEveryLength) {
  std::mt19937 rng(9);
  std::normal_distribution<float> value(0.0f, 50.0f);
  for (const SoftmaxVariant& variant : softmax_variants()) {
    SCOPED_TRACE(variant.name);
    for (int64_t n = 0; n <= 70; ++n) {
      std::vector<float> row(static_cast<size_t>(n));
      for (float& v : row) v = value(rng);
      const float expected = std::accumulate(row.begin(), row.end(), -1e9f,
                                             [](float a, float b) { return std::max(a, b); });
      EXPECT_EQ(variant.max_of(row.data(), n, -1e9f), expected) << "n " << n;
      EXPECT_EQ(variant.max_of(row.data(), n, 1e9f), 1e9f) << "the floor wins, n " << n;
    }
  }
}

TEST(Softmax, NumeratorsZeroOutsideTheViewAndDivideToTheSoftmax) {
  std::vector<float> row{9.0f, 1.0f, 2.0f, 3.0f, 9.0f, 9.0f};
  const float sum = softmax_numerators(row.data(), 6, 1, 4);
  EXPECT_EQ(row[0], 0.0f);
  EXPECT_EQ(row[4], 0.0f);
  EXPECT_EQ(row[5], 0.0f);
  const double z = std::exp(-2.0) + std::exp(-1.0) + 1.0;
  EXPECT_NEAR(sum, z, 1e-6);
  std::vector<float> out{row[1], row[2], row[3]};
  divide_by(out.data(), 3, sum);
  EXPECT_NEAR(out[0], std::exp(-2.0) / z, 1e-6);
  EXPECT_NEAR(out[2], 1.0 / z, 1e-6);

  // A row that sees nothing (everything masked) weighs nothing, and dividing by its 0 leaves 0.
  std::vector<float> masked{kMasked, kMasked, 4.0f};
  EXPECT_EQ(softmax_numerators(masked.data(), 3, 0, 2), 0.0f);
  EXPECT_EQ(masked, (std::vector<float>{0.0f, 0.0f, 0.0f}));
  std::vector<float> zeros{0.0f, 0.0f};
  divide_by(zeros.data(), 2, 0.0f);
  EXPECT_EQ(zeros, (std::vector<float>{0.0f, 0.0f}));
}

}  // namespace
}  // namespace kvsnap::detail
