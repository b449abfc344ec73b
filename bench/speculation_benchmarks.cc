// Google Benchmark: the cost of a speculation round's capture scheduling and rollback
// (Speculation::begin + accept) on the built-in model's full stack at 1k and 32k tokens of
// context, against a plain decode step and the verify forward at the same context. The caches
// are filled with synthetic keys, values and states (what a prefill would leave, without
// spending minutes on one), so the forwards do the work of that context length.
//
//   kvsnap_speculation_benchmarks --benchmark_counters_tabular=true
//
// Counters, medians over the rounds (a preempted round on a busy machine does not move them):
// rollback_us (begin + accept), decode_step_us, verify_us (1 + k tokens), rollback_share
// (rollback over a decode step). Each round accepts 0..k-1 drafts in turn, so
// whole-state layers restore a capture every round; the context grows by about 3.5 tokens per
// iteration (a round and a decode step).
#include <benchmark/benchmark.h>
#include <kvsnap/kvsnap.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "model/model.h"

namespace kvsnap {
namespace {

using Clock = std::chrono::steady_clock;

Array random_array(Shape shape, std::mt19937& rng) {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> data(static_cast<size_t>(count));
  for (float& v : data) v = normal(rng);
  return Array::from_floats(data, shape);
}

// Brings every layer to `context` tokens of synthetic state.
void fill(const ModelConfig& config, const std::vector<Cache*>& layers, int64_t context) {
  std::mt19937 rng(7);
  constexpr int64_t kChunk = 1024;
  for (Cache* layer : layers) {
    if (auto* attention = dynamic_cast<Attention*>(layer)) {
      for (int64_t at = 0; at < context; at += kChunk) {
        const int64_t n = std::min(kChunk, context - at);
        const Shape shape{1, config.kv_heads, n, config.head_dim};
        (void)attention->update(Batch::uniform(1, n, at), random_array(shape, rng),
                                random_array(shape, rng));
      }
    } else if (auto* recurrent = dynamic_cast<RecurrentCache*>(layer)) {
      const Batch batch = Batch::uniform(1, context, 0);
      (void)recurrent->get(batch, DType::f32);
      const Array conv =
          Array::zeros(DType::f32, {1, recurrent->conv_tail(), recurrent->conv_dim()});
      const Array delta = random_array(
          {1, recurrent->num_v_heads(), recurrent->head_v_dim(), recurrent->head_k_dim()}, rng);
      recurrent->put(batch, std::span(&conv, 1), std::span(&delta, 1));
    }
  }
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void BM_SpeculationRollback(benchmark::State& state) {
  const Model model{ModelConfig{}};
  auto caches = model.make_caches();
  const std::vector<Cache*> layers = cache_pointers(caches);
  fill(model.config(), layers, state.range(0));
  constexpr int64_t k = 4;
  Speculation round(layers);
  const std::vector<int32_t> verify = {101, 102, 103, 104, 105};
  const int32_t token = 106;
  std::vector<double> rollback, decode, verify_seconds;  // per round: medians resist preemption
  int64_t accepted = 0;
  // With range(1) = 1, a 64 MiB write evicts the CPU caches before each timed call, so both
  // context lengths start equally cold (without it, the forward before a rollback at 32k tokens
  // has evicted more of what the rollback touches than the one at 1k).
  std::vector<char> flush(state.range(1) != 0 ? size_t(64) << 20 : 0);
  const auto evict = [&] {
    if (flush.empty()) return;
    std::fill(flush.begin(), flush.end(), static_cast<char>(flush[0] + 1));
    benchmark::ClobberMemory();
  };
  for (auto _ : state) {
    evict();
    auto start = Clock::now();
    round.begin(k);
    double seconds = since(start);
    start = Clock::now();
    Array logits = model.forward(verify, layers, true);
    verify_seconds.push_back(since(start));
    benchmark::DoNotOptimize(logits);
    evict();
    start = Clock::now();
    round.accept(accepted);
    seconds += since(start);
    rollback.push_back(seconds);
    start = Clock::now();
    logits = model.forward(std::span(&token, 1), layers);
    decode.push_back(since(start));
    benchmark::DoNotOptimize(logits);
    state.SetIterationTime(seconds);  // the benchmark's time: begin + accept
    accepted = (accepted + 1) % k;
  }
  const double median_rollback = median(rollback), median_decode = median(decode);
  state.counters["rollback_us"] = 1e6 * median_rollback;
  state.counters["decode_step_us"] = 1e6 * median_decode;
  state.counters["verify_us"] = 1e6 * median(verify_seconds);
  state.counters["rollback_share"] = median_rollback / median_decode;
  state.counters["restores_per_round"] =
      static_cast<double>(round.stats().restores) / static_cast<double>(state.iterations());
}
BENCHMARK(BM_SpeculationRollback)
    ->Args({1024, 0})
    ->Args({32768, 0})
    ->Args({1024, 1})
    ->Args({32768, 1})
    ->Iterations(60)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvsnap

BENCHMARK_MAIN();
