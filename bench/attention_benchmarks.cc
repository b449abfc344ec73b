// Decode attention's two products (src/ops/decode_kernels.h) against cblas_sgemm of the same
// shapes: the scores of m queries over one key/value head's history (scale * Q K^T) and the
// outputs weighed by them (P V), for the query counts of one sequence's decode step (the 4 query
// heads that share a key/value head), of 8 sequences sharing a prefix (32) and in between.
//
//   build/release/bench/kvsnap_attention_benchmarks
//
// The history is 4480 columns of depth 32 (a ~4k system prompt, as in data/many-users.jsonl):
// 560 KB of keys and as much of values, read in place. Counters: `gflops` (2 m columns depth per
// product) and `vs_sgemm` (time / OpenBLAS's time for the same product in this run; OpenBLAS
// packs its operands, the kernels do not, and their sums are each one fma chain in a fixed order,
// which OpenBLAS's are not).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <chrono>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "ops/decode_kernels.h"

namespace {

using kvsnap::detail::ColumnRun;

constexpr int64_t kColumns = 4480, kDepth = 32, kMostQueries = 32;

struct Inputs {
  std::vector<float> queries, keys, values, scores, out;
  std::vector<float> scratch;
  Inputs()
      : queries(kMostQueries * kDepth),
        keys(kColumns * kDepth),
        values(kColumns * kDepth),
        scores(kMostQueries * kColumns),
        out(kMostQueries * kDepth) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    for (auto* v : {&queries, &keys, &values, &scores}) {
      for (float& x : *v) x = uniform(rng);
    }
  }
  // Row pointers of the m first queries, score rows and outputs.
  template <class T>
  static std::vector<T*> rows(std::vector<float>& data, int64_t m, int64_t width) {
    std::vector<T*> out;
    for (int64_t i = 0; i < m; ++i) out.push_back(data.data() + i * width);
    return out;
  }
};

Inputs& inputs() {
  static Inputs in;
  return in;
}

enum class Product { scores, weigh };

// Seconds per call of `product`, measured for `seconds` of wall time.
template <class Call>
double seconds_per_call(Call&& call, double seconds = 0.2) {
  int64_t calls = 0;
  const auto start = std::chrono::steady_clock::now();
  double spent = 0;
  while (spent < seconds) {
    call();
    benchmark::ClobberMemory();
    ++calls;
    spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return spent / static_cast<double>(calls);
}

void sgemm(Product product, int64_t m, Inputs& in) {
  if (product == Product::scores) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), kColumns, kDepth,
                0.125f, in.queries.data(), kDepth, in.keys.data(), kDepth, 0.0f, in.scores.data(),
                kColumns);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), kDepth, kColumns,
                1.0f, in.scores.data(), kColumns, in.values.data(), kDepth, 1.0f, in.out.data(),
                kDepth);
  }
}

// OpenBLAS's seconds for (product, m), measured once per run.
double sgemm_seconds(Product product, int64_t m) {
  static std::map<std::pair<Product, int64_t>, double> measured;
  auto [it, added] = measured.try_emplace({product, m}, 0.0);
  if (added) it->second = seconds_per_call([&] { sgemm(product, m, inputs()); });
  return it->second;
}

void kernels(Product product, int64_t m, Inputs& in) {
  if (product == Product::scores) {
    const auto queries = Inputs::rows<const float>(in.queries, m, kDepth);
    const auto scores = Inputs::rows<float>(in.scores, m, kColumns);
    const ColumnRun run{in.keys.data(), kColumns};
    kvsnap::detail::decode_scores(queries.data(), m, kDepth, &run, 1, kDepth, 0.125f, scores.data(),
                                  in.scratch);
  } else {
    const auto weights = Inputs::rows<const float>(in.scores, m, kColumns);
    const auto out = Inputs::rows<float>(in.out, m, kDepth);
    const ColumnRun run{in.values.data(), kColumns};
    kvsnap::detail::decode_weigh(weights.data(), m, &run, 1, kDepth, kDepth, out.data());
  }
}

template <Product P, bool Kernels>
void BM_DecodeAttention(benchmark::State& state) {
  const int64_t m = state.range(0);
  if (Kernels && !kvsnap::detail::decode_kernels_available()) {
    state.SkipWithError("no AVX2 or AVX-512 on this CPU: decode attention runs on BLAS");
    return;
  }
  Inputs& in = inputs();
  const double reference = sgemm_seconds(P, m);
  int64_t calls = 0;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (Kernels) {
      kernels(P, m, in);
    } else {
      sgemm(P, m, in);
    }
    benchmark::ClobberMemory();
    ++calls;
  }
  const double each =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
      static_cast<double>(calls);
  state.counters["gflops"] = 2.0 * static_cast<double>(m * kColumns * kDepth) / each / 1e9;
  state.counters["vs_sgemm"] = each / reference;
}

BENCHMARK(BM_DecodeAttention<Product::scores, true>)->Arg(4)->Arg(8)->Arg(16)->Arg(32);
BENCHMARK(BM_DecodeAttention<Product::scores, false>)->Arg(4)->Arg(8)->Arg(16)->Arg(32);
BENCHMARK(BM_DecodeAttention<Product::weigh, true>)->Arg(4)->Arg(8)->Arg(16)->Arg(32);
BENCHMARK(BM_DecodeAttention<Product::weigh, false>)->Arg(4)->Arg(8)->Arg(16)->Arg(32);

}  // namespace

BENCHMARK_MAIN();
