#include <gtest/gtest.h>
#include <kvsnap/ops.h>

#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::all_close;
using testing::random_array;
using testing::throws_error;
using testing::uniform_floats;

struct DeltaInputs {
  Array q, k, v, g, beta;
};

DeltaInputs make_inputs(int64_t B, int64_t L, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                        uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t gates = static_cast<size_t>(B * L * Hv);
  // Keys scaled so beta*|k|^2 stays below 2 and the recurrence is stable.
  auto keys = testing::random_floats(static_cast<size_t>(B * L * Hk * Dk), rng, 0.3f);
  return {random_array({B, L, Hk, Dk}, rng), Array::from_floats(keys, {B, L, Hk, Dk}),
          random_array({B, L, Hv, Dv}, rng),
          Array::from_floats(uniform_floats(gates, rng, 0.8f, 1.0f), {B, L, Hv}),
          Array::from_floats(uniform_floats(gates, rng, 0.1f, 0.9f), {B, L, Hv})};
}

DeltaInputs slice_time(const DeltaInputs& in, int64_t start, int64_t stop) {
  return {in.q.slice(1, start, stop), in.k.slice(1, start, stop), in.v.slice(1, start, stop),
          in.g.slice(1, start, stop), in.beta.slice(1, start, stop)};
}

// Independent reference in double using the matrix form S_t = g S (I - b k k^T) + b v k^T.
std::vector<double> naive_outputs(const DeltaInputs& in) {
  const int64_t B = in.q.dim(0), L = in.q.dim(1), Hk = in.q.dim(2), Dk = in.q.dim(3);
  const int64_t Hv = in.v.dim(2), Dv = in.v.dim(3);
  const auto q = in.q.to_floats(), k = in.k.to_floats(), v = in.v.to_floats();
  const auto g = in.g.to_floats(), beta = in.beta.to_floats();
  std::vector<double> out(static_cast<size_t>(B * L * Hv * Dv));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t kh = h / (Hv / Hk);
      std::vector<double> S(static_cast<size_t>(Dv * Dk), 0.0);
      for (int64_t t = 0; t < L; ++t) {
        const float* kt = &k[((b * L + t) * Hk + kh) * Dk];
        const float* qt = &q[((b * L + t) * Hk + kh) * Dk];
        const float* vt = &v[((b * L + t) * Hv + h) * Dv];
        const double gt = g[(b * L + t) * Hv + h], bt = beta[(b * L + t) * Hv + h];
        std::vector<double> next(S.size());
        for (int64_t i = 0; i < Dv; ++i)
          for (int64_t j = 0; j < Dk; ++j) {
            double projected = 0.0;  // (S (I - b k k^T))[i][j]
            for (int64_t m = 0; m < Dk; ++m)
              projected += S[i * Dk + m] * ((m == j ? 1.0 : 0.0) - bt * kt[m] * kt[j]);
            next[i * Dk + j] = gt * projected + bt * vt[i] * kt[j];
          }
        S = next;
        for (int64_t i = 0; i < Dv; ++i) {
          double o = 0.0;
          for (int64_t j = 0; j < Dk; ++j) o += S[i * Dk + j] * qt[j];
          out[((b * L + t) * Hv + h) * Dv + i] = o;
        }
      }
    }
  return out;
}

// Key depths below, at and past the kernel's 16 lanes, with a tail after them.
TEST(GatedDelta, MatchesTheMatrixFormOfTheRecurrence) {
  for (const int64_t key_depth : {6, 16, 37}) {
    const auto in = make_inputs(2, 9, 2, 4, key_depth, 5, 1);
    const auto result = gated_delta(in.q, in.k, in.v, in.g, in.beta, Array());
    const auto got = result.output.to_floats();
    const auto expected = naive_outputs(in);
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], expected[i], 1e-5 * std::max(1.0, std::fabs(expected[i])))
          << "key depth " << key_depth << ", element " << i;
    }
    EXPECT_EQ(result.states.back().shape(), (Shape{2, 4, 5, key_depth}));
    EXPECT_EQ(result.states.back().dtype(), DType::f32);
  }
}

// A row's results do not depend on the rows beside it: every sum has one order, so a sequence
// decoding in a batch continues bitwise as it would alone.
TEST(GatedDelta, EachRowOfABatchIsBitwiseItsRunAlone) {
  const auto in = make_inputs(3, 5, 2, 4, 37, 8, 4);
  const auto batch = gated_delta(in.q, in.k, in.v, in.g, in.beta, Array());
  for (int64_t b = 0; b < 3; ++b) {
    const auto alone =
        gated_delta(in.q.slice(0, b, b + 1), in.k.slice(0, b, b + 1), in.v.slice(0, b, b + 1),
                    in.g.slice(0, b, b + 1), in.beta.slice(0, b, b + 1), Array());
    EXPECT_EQ(alone.output.to_floats(), batch.output.slice(0, b, b + 1).to_floats()) << b;
    EXPECT_EQ(alone.states.back().to_floats(), batch.states.back().slice(0, b, b + 1).to_floats())
        << b;
  }
}

TEST(GatedDelta, SegmentedRunEqualsOneRun) {
  const auto in = make_inputs(1, 23, 2, 4, 8, 8, 2);
  const auto whole = gated_delta(in.q, in.k, in.v, in.g, in.beta, Array());
  const std::vector<int64_t> cuts{1, 2, 9, 16, 23};
  Array state;
  int64_t start = 0;
  for (int64_t cut : cuts) {
    const auto part_in = slice_time(in, start, cut);
    const auto part = gated_delta(part_in.q, part_in.k, part_in.v, part_in.g, part_in.beta, state);
    EXPECT_TRUE(all_close(part.output, whole.output.slice(1, start, cut), 1e-5f)) << cut;
    state = part.states.back();
    start = cut;
  }
  EXPECT_TRUE(all_close(state, whole.states.back(), 1e-5f));
}

TEST(GatedDelta, BoundaryStatesEqualStatesOfSeparateRuns) {
  const auto in = make_inputs(1, 12, 1, 2, 4, 4, 3);
  const std::vector<int64_t> boundaries{1, 5, 11};
  const auto whole = gated_delta(in.q, in.k, in.v, in.g, in.beta, Array(), boundaries);
  ASSERT_EQ(whole.states.size(), 4u);
  for (size_t i = 0; i < boundaries.size(); ++i) {
    const auto prefix = slice_time(in, 0, boundaries[i]);
    const auto run = gated_delta(prefix.q, prefix.k, prefix.v, prefix.g, prefix.beta, Array());
    EXPECT_TRUE(all_close(whole.states[i], run.states.back(), 1e-6f)) << boundaries[i];
  }
}

TEST(GatedDelta, HalfPrecisionInputsKeepAFloat32State) {
  const auto in = make_inputs(1, 4, 1, 1, 4, 4, 4);
  const auto half = gated_delta(in.q.astype(DType::bf16), in.k.astype(DType::bf16),
                                in.v.astype(DType::bf16), in.g, in.beta, Array());
  EXPECT_EQ(half.states.back().dtype(), DType::f32);
  EXPECT_EQ(half.output.dtype(), DType::f32);
}

TEST(GatedDeltaErrors, ShapesStateAndBoundaries) {
  const auto in = make_inputs(1, 4, 2, 4, 4, 3, 5);
  EXPECT_TRUE(throws_error(
      [&] { (void)gated_delta(in.q, in.k, in.v, in.g.slice(2, 0, 2), in.beta, Array()); },
      {"gated_delta", "g f32[1, 4, 2]", "[1, 4, 4]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)gated_delta(in.q, in.k, in.v, in.g, in.beta, Array::zeros(DType::f16, {1, 4, 3, 4}));
      },
      {"gated_delta", "state f16[1, 4, 3, 4]", "f32[1, 4, 3, 4]"}));
  const auto odd = make_inputs(1, 4, 3, 4, 4, 3, 6);
  EXPECT_TRUE(
      throws_error([&] { (void)gated_delta(odd.q, odd.k, odd.v, odd.g, odd.beta, Array()); },
                   {"4 value heads", "3 key heads"}));
  const std::vector<int64_t> bad{0};
  EXPECT_TRUE(
      throws_error([&] { (void)gated_delta(in.q, in.k, in.v, in.g, in.beta, Array(), bad); },
                   {"gated_delta", "boundary 0"}));
  EXPECT_TRUE(throws_error(
      [&] { (void)gated_delta(in.q, in.k.slice(3, 0, 2), in.v, in.g, in.beta, Array()); },
      {"gated_delta", "k f32[1, 4, 2, 2]"}));
}

}  // namespace
}  // namespace kvsnap
