// The model's matrix product: right (against a double-precision reference) and batch-invariant
// (a row's result is bitwise the same whatever rows come with it), for every row count the
// kernel's blocking distinguishes and widths that leave partial column blocks — in every variant
// of the kernel this CPU runs (matmul_variants), not only the one matmul picks.
#include <gtest/gtest.h>
#include <kvsnap/ops.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "model/weights.h"
#include "support/test_support.h"

namespace kvsnap::detail {
namespace {

using kvsnap::testing::random_floats;

struct Shape2 {
  int64_t in, out;
};

TEST(Matmul, EveryVariantEqualsTheProductComputedInDoublePrecision) {
  std::mt19937 rng(7);
  // in = 0 (every sum 0) and 100 (stretches of 32 rows of W and a last of 4) among them.
  for (const Shape2 s : {Shape2{256, 768}, Shape2{768, 256}, Shape2{32, 4}, Shape2{17, 161},
                         Shape2{0, 40}, Shape2{100, 96}}) {
    for (const int64_t rows : {1, 2, 3, 5, 8, 13, 70}) {
      const Floats x = random_floats(static_cast<size_t>(rows * s.in), rng);
      const Floats w = random_floats(static_cast<size_t>(s.in * s.out), rng);
      const PackedMatrix packed(w, s.in, s.out);
      const Floats base = random_floats(static_cast<size_t>(rows * s.out), rng);
      for (const auto& [name, run] : matmul_variants()) {
        for (const bool accumulate : {false, true}) {
          Floats y = base;
          run(x.data(), rows, packed, y.data(), accumulate);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < s.out; ++j) {
              double want = accumulate ? base[r * s.out + j] : 0.0, magnitude = std::abs(want);
              for (int64_t k = 0; k < s.in; ++k) {
                want += double(x[r * s.in + k]) * double(w[k * s.out + j]);
                magnitude += std::abs(double(x[r * s.in + k]) * double(w[k * s.out + j]));
              }
              ASSERT_NEAR(y[r * s.out + j], want, 1e-6 * magnitude + 1e-6)
                  << name << " " << s.in << "x" << s.out << " rows " << rows << " row " << r
                  << " column " << j;
            }
          }
        }
      }
    }
  }
}

TEST(Matmul, ARowsResultIsBitwiseTheSameWhateverRowsComeWithIt) {
  std::mt19937 rng(11);
  for (const Shape2 s : {Shape2{256, 768}, Shape2{64, 100}, Shape2{40, 4}}) {
    const int64_t most = 137;
    const Floats x = random_floats(static_cast<size_t>(most * s.in), rng);
    const Floats w = random_floats(static_cast<size_t>(s.in * s.out), rng);
    const PackedMatrix packed(w, s.in, s.out);
    for (const auto& [name, run] : matmul_variants()) {
      // Each row alone.
      Floats alone(static_cast<size_t>(most * s.out));
      for (int64_t r = 0; r < most; ++r) {
        run(x.data() + r * s.in, 1, packed, alone.data() + r * s.out, false);
      }
      // Batches of every size the blocking treats differently, starting at different rows.
      for (const int64_t rows : {2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 64, 65, 137}) {
        for (const int64_t first : {int64_t{0}, int64_t{1}, most - rows}) {
          if (first + rows > most) continue;
          Floats y(static_cast<size_t>(rows * s.out));
          run(x.data() + first * s.in, rows, packed, y.data(), false);
          ASSERT_EQ(std::memcmp(y.data(), alone.data() + first * s.out, y.size() * sizeof(float)),
                    0)
              << name << " " << s.in << "x" << s.out << ": rows " << first << ".."
              << first + rows - 1 << " differ from the same rows multiplied one at a time";
        }
      }
    }
  }
}

// Each fused variant's output is the plain fma chain over k in order from zero (then added to y
// when accumulating), bitwise, for row counts its blocking distinguishes (the AVX2 variant: blocks
// of up to 24 rows in threes with a rest of one or two; one or two rows alone) — so the fused
// variants equal each other on every CPU, also where only one of them runs.
TEST(Matmul, FusedVariantsArePlainFmaChains) {
  std::mt19937 rng(19);
  for (const Shape2 s : {Shape2{256, 768}, Shape2{17, 161}, Shape2{40, 4}}) {
    const Floats w = random_floats(static_cast<size_t>(s.in * s.out), rng);
    const PackedMatrix packed(w, s.in, s.out);
    for (const int64_t rows : {1, 2, 3, 4, 5, 8, 9, 13, 26, 27, 50}) {
      const Floats x = random_floats(static_cast<size_t>(rows * s.in), rng);
      const Floats base = random_floats(static_cast<size_t>(rows * s.out), rng);
      for (const auto& [name, run] : matmul_variants()) {
        if (std::string(name) == "portable") continue;
        for (const bool accumulate : {false, true}) {
          Floats y = base;
          run(x.data(), rows, packed, y.data(), accumulate);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < s.out; ++j) {
              float sum = 0.0f;
              for (int64_t k = 0; k < s.in; ++k) {
                sum = std::fma(x[r * s.in + k], w[k * s.out + j], sum);
              }
              const float want = accumulate ? base[r * s.out + j] + sum : sum;
              ASSERT_EQ(y[r * s.out + j], want) << name << " " << s.in << "x" << s.out << ", "
                                                << rows << " rows: row " << r << " column " << j;
            }
          }
        }
      }
    }
  }
}

// The fused variants compute the same sums in the same order: bitwise equal to each other, so a
// model's logits do not depend on which of them the CPU runs.
TEST(Matmul, FusedVariantsAreBitwiseEqual) {
  std::vector<MatmulVariant> fused;
  for (const MatmulVariant& v : matmul_variants()) {
    if (std::string(v.name) != "portable") fused.push_back(v);
  }
  if (fused.size() < 2) GTEST_SKIP() << "this CPU runs fewer than two fused variants";
  std::mt19937 rng(17);
  for (const Shape2 s : {Shape2{256, 768}, Shape2{17, 161}, Shape2{40, 4}}) {
    const Floats w = random_floats(static_cast<size_t>(s.in * s.out), rng);
    const PackedMatrix packed(w, s.in, s.out);
    for (const int64_t rows : {1, 2, 3, 4, 5, 8, 9, 13}) {
      const Floats x = random_floats(static_cast<size_t>(rows * s.in), rng);
      const Floats base = random_floats(static_cast<size_t>(rows * s.out), rng);
      for (const bool accumulate : {false, true}) {
        Floats first = base;
        fused.front().run(x.data(), rows, packed, first.data(), accumulate);
        for (size_t i = 1; i < fused.size(); ++i) {
          Floats y = base;
          fused[i].run(x.data(), rows, packed, y.data(), accumulate);
          ASSERT_EQ(std::memcmp(y.data(), first.data(), y.size() * sizeof(float)), 0)
              << fused[i].name << " differs from " << fused.front().name << " at " << s.in << "x"
              << s.out << ", " << rows << " rows";
        }
      }
    }
  }
}

// Work split between threads (by rows for prefill sizes, by columns for decode sizes) changes no
// bit of any result: each output is the same sum on whichever thread computes it.
TEST(MatmulThreads, EveryThreadCountGivesBitwiseTheSameProduct) {
  std::mt19937 rng(13);
  for (const Shape2 s : {Shape2{256, 768}, Shape2{768, 256}, Shape2{256, 64}, Shape2{96, 1000}}) {
    const Floats w = random_floats(static_cast<size_t>(s.in * s.out), rng);
    const PackedMatrix packed(w, s.in, s.out);
    for (const int64_t rows : {1, 3, 8, 48, 137}) {
      const Floats x = random_floats(static_cast<size_t>(rows * s.in), rng);
      const Floats base = random_floats(static_cast<size_t>(rows * s.out), rng);
      for (const bool accumulate : {false, true}) {
        set_threads(1);
        Floats one = base;
        matmul(x.data(), rows, packed, one.data(), accumulate);
        for (const int threads : {2, 3, 5}) {
          set_threads(threads);
          Floats y = base;
          matmul(x.data(), rows, packed, y.data(), accumulate);
          set_threads(1);
          ASSERT_EQ(std::memcmp(y.data(), one.data(), y.size() * sizeof(float)), 0)
              << s.in << "x" << s.out << ", " << rows << " rows, " << threads << " threads";
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvsnap::detail
