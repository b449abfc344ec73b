// The gated MLP block: right against a double-precision reference, and a long run of tokens
// (processed a bounded number of tokens at a time) bitwise the same as each token alone.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "model/weights.h"
#include "support/test_support.h"

namespace kvsnap::detail {
namespace {

using kvsnap::testing::random_floats;

TEST(MlpBlock, LongRunsEqualTokensAloneAndTheDoublePrecisionBlock) {
  std::mt19937 rng(23);
  ModelWeights w;
  w.config.hidden = 8;
  w.config.mlp_hidden = 2048;  // 2M floats of gate and up hold 512 tokens: 1300 take three runs
  const int64_t hidden = w.config.hidden, width = w.config.mlp_hidden, tokens = 1300;
  LayerWeights l;
  l.w_gate = random_floats(static_cast<size_t>(hidden * width), rng);
  l.w_up = random_floats(static_cast<size_t>(hidden * width), rng);
  l.w_down = random_floats(static_cast<size_t>(width * hidden), rng);
  l.packed.w_gate = PackedMatrix(l.w_gate, hidden, width);
  l.packed.w_up = PackedMatrix(l.w_up, hidden, width);
  l.packed.w_down = PackedMatrix(l.w_down, width, hidden);
  const Floats h = random_floats(static_cast<size_t>(tokens * hidden), rng);
  const Floats residual = random_floats(h.size(), rng);

  Floats together = residual;
  mlp_block(w, l, tokens, h, together.data());
  Floats alone = residual;
  for (int64_t t = 0; t < tokens; ++t) {
    const Floats one(h.begin() + t * hidden, h.begin() + (t + 1) * hidden);
    mlp_block(w, l, 1, one, alone.data() + t * hidden);
  }
  ASSERT_EQ(std::memcmp(together.data(), alone.data(), together.size() * sizeof(float)), 0);

  for (const int64_t t : {int64_t{0}, int64_t{511}, int64_t{512}, int64_t{1299}}) {
    std::vector<double> middle(static_cast<size_t>(width));
    for (int64_t j = 0; j < width; ++j) {
      double gate = 0, up = 0;
      for (int64_t k = 0; k < hidden; ++k) {
        gate += double(h[t * hidden + k]) * l.w_gate[k * width + j];
        up += double(h[t * hidden + k]) * l.w_up[k * width + j];
      }
      middle[static_cast<size_t>(j)] = gate / (1.0 + std::exp(-gate)) * up;
    }
    for (int64_t k = 0; k < hidden; ++k) {
      double want = residual[t * hidden + k], magnitude = std::abs(want);
      for (int64_t j = 0; j < width; ++j) {
        want += middle[static_cast<size_t>(j)] * l.w_down[j * hidden + k];
        magnitude += std::abs(middle[static_cast<size_t>(j)] * l.w_down[j * hidden + k]);
      }
      EXPECT_NEAR(together[t * hidden + k], want, 1e-5 * magnitude + 1e-6)
          << "token " << t << " column " << k;
    }
  }
}

}  // namespace
}  // namespace kvsnap::detail
