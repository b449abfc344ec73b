// Reference attention over a history: the same causal attention computed in one prefill and in
// chunks against a growing key/value history gives the same outputs.
#include <kvsnap/kvsnap.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

std::vector<float> random_values(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

}  // namespace

int main() {
  constexpr int64_t kQueryHeads = 8, kKVHeads = 2, kDepth = 16, kTokens = 48, kChunk = 16;
  std::mt19937 rng(7);
  const auto q = kvsnap::Array::from_floats(random_values(kQueryHeads * kTokens * kDepth, rng),
                                            {1, kQueryHeads, kTokens, kDepth});
  const auto k = kvsnap::Array::from_floats(random_values(kKVHeads * kTokens * kDepth, rng),
                                            {1, kKVHeads, kTokens, kDepth}, kvsnap::DType::f16);
  const auto v = kvsnap::Array::from_floats(random_values(kKVHeads * kTokens * kDepth, rng),
                                            {1, kKVHeads, kTokens, kDepth}, kvsnap::DType::f16);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDepth));
  const auto causal = kvsnap::AttentionMask::causal();

  // One prefill over all tokens.
  const kvsnap::Array whole = kvsnap::sdpa(kvsnap::Batch::uniform(1, kTokens, 0), q,
                                           kvsnap::KVHistory(k, v), causal, scale);

  // Chunked: each chunk attends to the history of every token up to its end.
  float worst = 0.0f;
  for (int64_t start = 0; start < kTokens; start += kChunk) {
    const int64_t stop = start + kChunk;
    kvsnap::KVHistory history(k.slice(2, 0, stop), v.slice(2, 0, stop));
    const auto part = kvsnap::sdpa(kvsnap::Batch::uniform(1, kChunk, start),
                                   q.slice(2, start, stop), history, causal, scale);
    const auto expected = whole.slice(2, start, stop).to_floats();
    const auto got = part.to_floats();
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::fmax(worst, std::fabs(got[i] - expected[i]));
  }
  std::printf(
      "kvsnap reference attention: %lld tokens, %lld query heads over %lld KV heads (GQA)\n",
      static_cast<long long>(kTokens), static_cast<long long>(kQueryHeads),
      static_cast<long long>(kKVHeads));
  std::printf("  one prefill vs %lld-token chunks over a growing history: max |diff| = %.3g\n",
              static_cast<long long>(kChunk), worst);
  const auto first = whole.slice(2, 0, 1).to_floats();
  std::printf("  output[0][0][0][0..3] = %.4f %.4f %.4f %.4f\n", first[0], first[1], first[2],
              first[3]);
  std::printf("  live array bytes at exit: %lld\n", static_cast<long long>(kvsnap::live_bytes()));
  return worst < 1e-5f ? 0 : 1;
}
