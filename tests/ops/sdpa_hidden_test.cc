// Columns a query does not see hold whatever they hold. The kernels weigh a range of columns for
// several queries at once (a chunk's causal range, a window's older columns, an explicit mask's
// every column, another row's part of a shared block) with weight 0 where a query does not see
// one, and 0 times an infinite or NaN value is NaN: none of that may reach the query. A value it
// does see still reaches it.
#include <gtest/gtest.h>
#include <kvsnap/ops.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "ops/decode_kernels.h"
#include "support/test_support.h"

namespace kvsnap::sdpa_hidden_test {
namespace {

using testing::random_array;

constexpr float kBad[] = {std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()};

// `values` [1, H, K, Dv] with column `column` of every head set to `bad`.
Array with_column(const Array& values, int64_t column, float bad) {
  std::vector<float> v = values.to_floats();
  const int64_t heads = values.dim(1), columns = values.dim(2), depth = values.dim(3);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < depth; ++d)
      v[static_cast<size_t>((h * columns + column) * depth + d)] = bad;
  }
  return Array::from_floats(v, values.shape());
}

// Query l's outputs (every head) of `out` [B, Hq, L, Dv], row b.
std::vector<float> query(const Array& out, int64_t b, int64_t l) {
  const std::vector<float> all = out.to_floats();
  std::vector<float> q;
  const int64_t heads = out.dim(1), queries = out.dim(2), depth = out.dim(3);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < depth; ++d) {
      q.push_back(all[static_cast<size_t>(((b * heads + h) * queries + l) * depth + d)]);
    }
  }
  return q;
}

bool none_finite(const std::vector<float>& v) {
  for (const float x : v) {
    if (std::isfinite(x)) return false;
  }
  return true;
}

// Query l of row b: the same outputs from `bad` as from `clean` (bitwise with the kernels, which
// add the columns in one order either way; within rounding through BLAS), all finite.
::testing::AssertionResult unaffected(const Array& bad, const Array& clean, int64_t b, int64_t l,
                                      float tolerance) {
  const std::vector<float> got = query(bad, b, l), want = query(clean, b, l);
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || std::fabs(got[i] - want[i]) > tolerance) {
      return ::testing::AssertionFailure() << "row " << b << " query " << l << " output " << i
                                           << ": " << got[i] << ", not " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// A causal chunk of 5 queries (one block of the kernels: columns [0, 5) for all), a window of 2
// over it, an explicit mask: a bad value in a column a query does not see changes nothing of it;
// the queries that see it get nothing finite.
TEST(SdpaHiddenValues, ReachNoQueryOfAChunk) {
  std::mt19937 rng(21);
  const Array q = random_array({1, 4, 5, 8}, rng), k = random_array({1, 2, 5, 8}, rng);
  const Array v = random_array({1, 2, 5, 8}, rng);
  const auto explicit_mask = AttentionMask::from_array(
      Array::from_ints(std::vector<int32_t>{0, 0, 0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0,
                                            1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1},
                       {1, 1, 5, 5}));  // query 0 sees nothing, no query sees column 2
  struct Case {
    const char* name;
    AttentionMask mask;
    int64_t column;
    std::vector<bool> sees;  // per query: whether it sees `column`
  };
  const Case cases[] = {
      {"causal", AttentionMask::causal(), 3, {false, false, false, true, true}},
      {"window", AttentionMask::sliding_window(2), 1, {false, true, true, false, false}},
      {"explicit", explicit_mask, 2, {false, false, false, false, false}},
  };
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    for (const Case& c : cases) {
      const Array clean =
          sdpa(Batch::uniform(1, 5, 0), q, KVHistory(k, with_column(v, c.column, 0)), c.mask, 0.3f);
      for (const float bad : kBad) {
        const Array out = sdpa(Batch::uniform(1, 5, 0), q,
                               KVHistory(k, with_column(v, c.column, bad)), c.mask, 0.3f);
        for (int64_t l = 0; l < 5; ++l) {
          if (c.sees[static_cast<size_t>(l)]) {
            EXPECT_TRUE(none_finite(query(out, 0, l))) << c.name << " query " << l;
          } else {
            EXPECT_TRUE(unaffected(out, clean, 0, l, kernels ? 0.0f : 1e-6f))
                << c.name << " " << bad << " kernels " << kernels;
          }
        }
      }
      if (c.name == std::string("explicit")) {  // a query that sees nothing gets zeros
        const Array out = sdpa(Batch::uniform(1, 5, 0), q, KVHistory(k, with_column(v, 0, kBad[2])),
                               c.mask, 0.3f);
        for (const float x : query(out, 0, 0)) EXPECT_EQ(x, 0.0f);
      }
    }
  }
}

// A decode step over paged histories (16-token blocks) in a window of 4: row 0 decodes at
// position 9 (it sees columns 6..9); row 1 shares row 0's block with 6 columns of it (sees
// 2..5). The block's first 10 columns are weighed for both rows at once.
TEST(SdpaHiddenValues, ReachNoRowOfAPagedDecodeStep) {
  std::mt19937 rng(22);
  const Array keys = random_array({1, 2, 16, 32}, rng), values = random_array({1, 2, 16, 32}, rng);
  const Array q = random_array({2, 4, 1, 32}, rng);
  const Batch batch = Batch::rows({{0, 9, {0}}, {1, 5, {0}}});
  const auto rows = [&](const Array& v) {
    return KVHistory::of_rows({KVHistory(PagedColumns{{keys}, {v}, 1, 16, {0}, 10}),
                               KVHistory(PagedColumns{{keys}, {v}, 1, 16, {0}, 6})});
  };
  const AttentionMask mask = AttentionMask::sliding_window(4);
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    const float tolerance = kernels ? 0.0f : 1e-6f;
    for (const float bad : kBad) {
      for (const int64_t column : {int64_t{0}, int64_t{3}, int64_t{8}}) {
        const Array clean = sdpa(batch, q, rows(with_column(values, column, 0)), mask, 0.2f);
        const Array out = sdpa(batch, q, rows(with_column(values, column, bad)), mask, 0.2f);
        for (int64_t b = 0; b < 2; ++b) {
          const bool sees = b == 0 ? column >= 6 : column >= 2 && column <= 5;
          if (sees) {
            EXPECT_TRUE(none_finite(query(out, b, 0))) << "row " << b << " column " << column;
          } else {
            EXPECT_TRUE(unaffected(out, clean, b, 0, tolerance))
                << bad << " in column " << column << ", kernels " << kernels;
          }
        }
      }
    }
  }
}

// A float mask's bias at a column the causal rule hides is not added there: an infinite or NaN
// bias (-inf + inf is NaN) would be a visible score and make the query's whole row NaN.
TEST(SdpaHiddenValues, AFloatMaskAddsNothingWhereAnotherRuleHides) {
  std::mt19937 rng(23);
  const Array q = random_array({1, 2, 3, 8}, rng), k = random_array({1, 2, 5, 8}, rng);
  const Array v = random_array({1, 2, 5, 8}, rng);
  const auto biased = [&](float bias) {
    std::vector<float> b(15, 0.0f);
    b[4] = bias;  // query 0 (position 2), key 4: after it
    return AttentionMask::causal().intersect(
        AttentionMask::from_array(Array::from_floats(b, {1, 1, 3, 5})));
  };
  const Array clean = sdpa(Batch::uniform(1, 3, 2), q, KVHistory(k, v), biased(0.0f), 0.4f);
  for (const float bad : kBad) {
    const Array out = sdpa(Batch::uniform(1, 3, 2), q, KVHistory(k, v), biased(bad), 0.4f);
    EXPECT_TRUE(unaffected(out, clean, 0, 0, 0.0f)) << bad;
  }
}

}  // namespace
}  // namespace kvsnap::sdpa_hidden_test
