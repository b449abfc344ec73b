// The gated MLP's activation (ops/activations.h): silu(gate) * up within a few ulp of the double
// computation for every length (vector body and masked tail), saturating at both ends, and the
// floats past the end untouched — in every variant this CPU runs (silu_gated_variants).
#include "ops/activations.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace kvsnap::detail {
namespace {

double silu_gated_double(double g, double u) { return g / (1.0 + std::exp(-g)) * u; }

TEST(Activations, SiluGatedMatchesDoublePrecisionForEveryLength) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> value(-30.0f, 30.0f);
  for (const SiluVariant& variant : silu_gated_variants()) {
    SCOPED_TRACE(variant.name);
    for (const int64_t n : {0, 1, 5, 15, 16, 17, 32, 47, 768, 1000}) {
      std::vector<float> gate(static_cast<size_t>(n) + 4, 3.0f), up(gate.size(), 2.0f);
      for (int64_t i = 0; i < n; ++i) {
        gate[static_cast<size_t>(i)] = value(rng);
        up[static_cast<size_t>(i)] = value(rng);
      }
      const std::vector<float> before = gate;
      variant.run(gate.data(), up.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const auto at = static_cast<size_t>(i);
        const double expected = silu_gated_double(before[at], up[at]);
        EXPECT_NEAR(gate[at], expected, 1e-6 * std::abs(expected) + 1e-30)
            << "n " << n << " at " << i << " gate " << before[at];
      }
      for (size_t i = static_cast<size_t>(n); i < gate.size(); ++i) EXPECT_EQ(gate[i], 3.0f);
    }
  }
}

TEST(Activations, SiluSaturatesAtBothEnds) {
  for (const SiluVariant& variant : silu_gated_variants()) {
    SCOPED_TRACE(variant.name);
    std::vector<float> gate{200.0f, -200.0f, 0.0f, 120.0f, -100.0f}, up(5, 1.0f);
    variant.run(gate.data(), up.data(), 5);
    EXPECT_EQ(gate[0], 200.0f);  // e^-200 underflows: silu(v) = v
    EXPECT_EQ(gate[1], 0.0f);    // e^200 overflows: silu(v) = -0
    EXPECT_EQ(gate[2], 0.0f);
    EXPECT_EQ(gate[3], 120.0f);
    EXPECT_EQ(gate[4], 0.0f);  // e^100 overflows float too (the exact -3.7e-42 is a denormal)
  }
}

}  // namespace
}  // namespace kvsnap::detail
