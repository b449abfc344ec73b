// Decode attention's products, every variant this CPU runs (AVX2, AVX-512): right against double
// precision, bitwise the plain fma chains (so bitwise the same as each other), and a query's
// scores and output bitwise the same whatever queries share the product and wherever it sits among
// them (skipped on CPUs without AVX2, where decode attention uses BLAS).
#include "ops/decode_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "ops/activations.h"
#include "ops/kernel_report.h"
#include "ops/softmax.h"
#include "support/test_support.h"

namespace kvsnap::detail {
namespace {

using kvsnap::testing::random_floats;

// One variant through the library's signatures (the scratch kept as decode_scores keeps it).
struct Kernels {
  const DecodeKernelVariant& variant;
  void scores(const float* const* queries, int64_t m, int64_t depth, const ColumnRun* runs,
              size_t n_runs, int64_t stride, float scale, float* const* out,
              std::vector<float>& scratch) const {
    scratch.resize(static_cast<size_t>(depth * 32));
    variant.scores(queries, m, depth, runs, n_runs, stride, scale, out, scratch.data());
  }
  void weigh(const float* const* weights, int64_t m, const ColumnRun* runs, size_t n_runs,
             int64_t stride, int64_t value_depth, float* const* out) const {
    variant.weigh(weights, m, runs, n_runs, stride, value_depth, out);
  }
};

// The kernels over one run of columns.
void score_run(const Kernels& kernels, const float* const* queries, int64_t m, int64_t depth,
               const float* keys, int64_t stride, int64_t count, float scale, float* const* out,
               std::vector<float>& scratch) {
  const ColumnRun run{keys, count};
  kernels.scores(queries, m, depth, &run, 1, stride, scale, out, scratch);
}
void weigh_run(const Kernels& kernels, const float* const* weights, int64_t m, const float* values,
               int64_t stride, int64_t count, int64_t value_depth, float* const* out) {
  const ColumnRun run{values, count};
  kernels.weigh(weights, m, &run, 1, stride, value_depth, out);
}

// A test of the kernels, run for every variant this CPU has (skipped where it has none): the body
// gets `kernels`, the variant under test.
#define DECODE_KERNELS_TEST(Name)                                          \
  void Name(const Kernels& kernels);                                       \
  TEST(DecodeKernels, Name) {                                              \
    const std::vector<DecodeKernelVariant> all = decode_kernel_variants(); \
    if (all.empty()) GTEST_SKIP() << "no AVX2 on this CPU";                \
    for (const DecodeKernelVariant& variant : all) {                       \
      SCOPED_TRACE(variant.name);                                          \
      Name(Kernels{variant});                                              \
      if (HasFatalFailure()) return;                                       \
    }                                                                      \
  }                                                                        \
  void Name(const Kernels& kernels)

struct Case {
  int64_t depth, count, value_depth, stride_pad;
};

DECODE_KERNELS_TEST(ScoresAndOutputsEqualTheDoublePrecisionProducts) {
  std::mt19937 rng(21);
  std::vector<float> tile;
  // Counts past the kernels' runs of columns (256) as well as within one.
  for (const Case k : {Case{32, 100, 32, 0}, Case{7, 13, 40, 3}, Case{32, 1, 12, 5},
                       Case{32, 600, 32, 0}, Case{16, 513, 64, 2}}) {
    for (const int64_t m : {1, 3, 4, 5, 16, 17, 33}) {
      const int64_t key_stride = k.depth + k.stride_pad,
                    value_stride = k.value_depth + k.stride_pad;
      const auto q = random_floats(static_cast<size_t>(m * k.depth), rng);
      const auto keys = random_floats(static_cast<size_t>(k.count * key_stride), rng);
      const auto values = random_floats(static_cast<size_t>(k.count * value_stride), rng);
      std::vector<float> scores(static_cast<size_t>(m * k.count), -1.0f);
      auto out = random_floats(static_cast<size_t>(m * k.value_depth), rng);
      const auto before = out;
      std::vector<const float*> queries, weights;
      std::vector<float*> score_rows, out_rows;
      for (int64_t i = 0; i < m; ++i) {
        queries.push_back(q.data() + i * k.depth);
        score_rows.push_back(scores.data() + i * k.count);
        weights.push_back(scores.data() + i * k.count);
        out_rows.push_back(out.data() + i * k.value_depth);
      }
      score_run(kernels, queries.data(), m, k.depth, keys.data(), key_stride, k.count, 0.5f,
                score_rows.data(), tile);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t c = 0; c < k.count; ++c) {
          double want = 0, magnitude = 0;
          for (int64_t d = 0; d < k.depth; ++d) {
            want += 0.5 * double(q[i * k.depth + d]) * keys[c * key_stride + d];
            magnitude += std::abs(0.5 * double(q[i * k.depth + d]) * keys[c * key_stride + d]);
          }
          ASSERT_NEAR(scores[i * k.count + c], want, 1e-6 * magnitude + 1e-7) << m << " " << i;
        }
      }
      weigh_run(kernels, weights.data(), m, values.data(), value_stride, k.count, k.value_depth,
                out_rows.data());
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t v = 0; v < k.value_depth; ++v) {
          double want = before[i * k.value_depth + v], magnitude = std::abs(want);
          for (int64_t c = 0; c < k.count; ++c) {
            const double term = double(scores[i * k.count + c]) * values[c * value_stride + v];
            want += term;
            magnitude += std::abs(term);
          }
          ASSERT_NEAR(out[i * k.value_depth + v], want, 1e-6 * magnitude + 1e-7) << m << " " << i;
        }
      }
    }
  }
}

DECODE_KERNELS_TEST(AQuerysResultIsBitwiseTheSameWhateverQueriesShareTheProduct) {
  std::mt19937 rng(22);
  std::vector<float> tile;
  const int64_t depth = 32, count = 37, value_depth = 32, most = 35;
  const auto q = random_floats(static_cast<size_t>(most * depth), rng);
  const auto keys = random_floats(static_cast<size_t>(count * depth), rng);
  const auto values = random_floats(static_cast<size_t>(count * value_depth), rng);
  // scores, then outputs, of queries [first, first + m) computed together
  const auto run = [&](int64_t first, int64_t m) {
    std::vector<float> scores(static_cast<size_t>(m * count)),
        out(static_cast<size_t>(m * value_depth));
    std::vector<const float*> queries, weights;
    std::vector<float*> score_rows, out_rows;
    for (int64_t i = 0; i < m; ++i) {
      queries.push_back(q.data() + (first + i) * depth);
      score_rows.push_back(scores.data() + i * count);
      weights.push_back(scores.data() + i * count);
      out_rows.push_back(out.data() + i * value_depth);
    }
    score_run(kernels, queries.data(), m, depth, keys.data(), depth, count, 0.25f,
              score_rows.data(), tile);
    weigh_run(kernels, weights.data(), m, values.data(), value_depth, count, value_depth,
              out_rows.data());
    scores.insert(scores.end(), out.begin(), out.end());
    return scores;
  };
  for (int64_t i = 0; i < most; ++i) {
    const auto alone = run(i, 1);
    for (const auto& [first, m] :
         {std::pair<int64_t, int64_t>{0, most}, {i, most - i}, {0, i + 1}}) {
      const auto together = run(first, m);
      const int64_t at = i - first;
      ASSERT_EQ(std::memcmp(together.data() + at * count, alone.data(), count * sizeof(float)), 0)
          << "scores of query " << i << " among " << m;
      ASSERT_EQ(std::memcmp(together.data() + m * count + at * value_depth, alone.data() + count,
                            value_depth * sizeof(float)),
                0)
          << "output of query " << i << " among " << m;
    }
  }
}

// Each output adds the columns in order onto what it holds, so weighing columns [0, count) in one
// call is bitwise the same as in two calls split anywhere — within one of the kernels' runs of
// columns or across them — which is what lets decode attention weigh a row's history job by job.
DECODE_KERNELS_TEST(OutputsAreBitwiseTheSameWhereverTheColumnsAreSplitBetweenCalls) {
  std::mt19937 rng(23);
  const int64_t count = 600, value_depth = 40, m = 9;
  const auto weights = random_floats(static_cast<size_t>(m * count), rng);
  const auto values = random_floats(static_cast<size_t>(count * value_depth), rng);
  const auto start = random_floats(static_cast<size_t>(m * value_depth), rng);
  const auto weigh = [&](std::vector<float>& out, int64_t from, int64_t to) {
    std::vector<const float*> w;
    std::vector<float*> o;
    for (int64_t i = 0; i < m; ++i) {
      w.push_back(weights.data() + i * count + from);
      o.push_back(out.data() + i * value_depth);
    }
    weigh_run(kernels, w.data(), m, values.data() + from * value_depth, value_depth, to - from,
              value_depth, o.data());
  };
  std::vector<float> whole = start;
  weigh(whole, 0, count);
  for (const int64_t split : {1, 100, 255, 256, 257, 300, 512, 599}) {
    std::vector<float> parts = start;
    weigh(parts, 0, split);
    weigh(parts, split, count);
    ASSERT_EQ(std::memcmp(parts.data(), whole.data(), whole.size() * sizeof(float)), 0)
        << "split at column " << split;
  }
}

// A history in runs that do not continue each other in memory (a paged history's blocks, here
// scattered through one buffer in reverse order) gives, in one call over the runs, bitwise the
// scores and outputs of one call per run, and of the plain fma chain per element (depth in
// order from zero, then the scale; columns in order onto the output) — for the few-query kernels
// (keys in the lanes) and the many-query ones, depths that are not multiples of 16 and value
// depths that leave a scalar tail, runs of lengths that are not multiples of 8 or 16, and an
// empty run.
DECODE_KERNELS_TEST(OneCallOverScatteredRunsEqualsACallPerRunAndThePlainSums) {
  std::mt19937 rng(24);
  std::vector<float> tile;
  const std::vector<int64_t> lengths = {32, 5, 0, 17, 64, 1, 300, 32};
  int64_t count = 0;
  for (int64_t n : lengths) count += n;
  for (const auto& [depth, value_depth] : {std::pair<int64_t, int64_t>{32, 32}, {17, 40}}) {
    const int64_t stride = 44;  // padded columns
    const auto keys = random_floats(static_cast<size_t>(count * stride), rng);
    const auto values = random_floats(static_cast<size_t>(count * stride), rng);
    std::vector<ColumnRun> key_runs, value_runs;
    std::vector<int64_t> at_column;  // column c of the runs lies at at_column[c] * stride
    int64_t end = count;             // runs laid out back to front
    for (int64_t n : lengths) {
      end -= n;
      key_runs.push_back({keys.data() + end * stride, n});
      value_runs.push_back({values.data() + end * stride, n});
      for (int64_t c = 0; c < n; ++c) at_column.push_back(end + c);
    }
    for (const int64_t m : {1, 4, 8, 9, 32, 33}) {
      const auto q = random_floats(static_cast<size_t>(m * depth), rng);
      const auto start = random_floats(static_cast<size_t>(m * value_depth), rng);
      std::vector<float> scores_once(static_cast<size_t>(m * count)), scores_each = scores_once;
      std::vector<float> out_once = start, out_each = start;
      const auto rows = [&](std::vector<float>& data, int64_t width, int64_t at) {
        std::vector<float*> out;
        for (int64_t i = 0; i < m; ++i) out.push_back(data.data() + i * width + at);
        return out;
      };
      std::vector<const float*> queries;
      for (int64_t i = 0; i < m; ++i) queries.push_back(q.data() + i * depth);
      auto to = rows(scores_once, count, 0);
      kernels.scores(queries.data(), m, depth, key_runs.data(), key_runs.size(), stride, 0.3f,
                     to.data(), tile);
      int64_t at = 0;
      for (const ColumnRun& run : key_runs) {
        to = rows(scores_each, count, at);
        score_run(kernels, queries.data(), m, depth, run.data, stride, run.count, 0.3f, to.data(),
                  tile);
        at += run.count;
      }
      ASSERT_EQ(std::memcmp(scores_once.data(), scores_each.data(), scores_once.size() * 4), 0)
          << m << " queries, depth " << depth;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t c = 0; c < count; ++c) {
          float sum = 0.0f;
          for (int64_t d = 0; d < depth; ++d) {
            sum = std::fma(keys[at_column[c] * stride + d], q[i * depth + d], sum);
          }
          ASSERT_EQ(scores_once[i * count + c], sum * 0.3f) << m << " " << i << " " << c;
        }
      }
      auto weights = rows(scores_once, count, 0);
      std::vector<const float*> w(weights.begin(), weights.end());
      auto out = rows(out_once, value_depth, 0);
      kernels.weigh(w.data(), m, value_runs.data(), value_runs.size(), stride, value_depth,
                    out.data());
      out = rows(out_each, value_depth, 0);
      at = 0;
      for (const ColumnRun& run : value_runs) {
        for (int64_t i = 0; i < m; ++i) w[i] = scores_once.data() + i * count + at;
        weigh_run(kernels, w.data(), m, run.data, stride, run.count, value_depth, out.data());
        at += run.count;
      }
      ASSERT_EQ(std::memcmp(out_once.data(), out_each.data(), out_once.size() * 4), 0)
          << m << " queries, value depth " << value_depth;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t v = 0; v < value_depth; ++v) {
          float sum = start[i * value_depth + v];
          for (int64_t c = 0; c < count; ++c) {
            sum = std::fma(scores_once[i * count + c], values[at_column[c] * stride + v], sum);
          }
          ASSERT_EQ(out_once[i * value_depth + v], sum) << m << " " << i << " " << v;
        }
      }
    }
  }
}

// What kvsnap bench reports as this CPU's kernels is what the ops use: the last variant of each,
// and OpenBLAS for attention where no decode kernel variant runs.
TEST(KernelReport, NamesTheVariantsTheOpsRun) {
  const OpsKernels ops = ops_kernels();
  const std::vector<DecodeKernelVariant> attention = decode_kernel_variants();
  EXPECT_EQ(ops.attention, attention.empty() ? "OpenBLAS" : attention.back().name);
  EXPECT_EQ(attention.empty(), !decode_kernels_available());
  EXPECT_EQ(ops.softmax, softmax_variants().back().name);
  EXPECT_EQ(ops.silu, silu_gated_variants().back().name);
}

}  // namespace
}  // namespace kvsnap::detail
