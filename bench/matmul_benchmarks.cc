// The built-in model's projections (src/model/matmul.cc) against cblas_sgemm / cblas_sgemv of the
// same shapes and a memcpy of the weight matrix, for the row counts of a decode step (1, 8 fused
// sequences) and of a prefill chunk (512). The memcpy is a reference, not a bound: it reads W
// and writes as many bytes, and its loads are not fetched ahead, so a product of one row, which
// only reads W and fetches it ahead, takes less (a plain read loop measured no faster here).
//
//   build/release/bench/kvsnap_matmul_benchmarks
//
// Each benchmark cycles over 24 matrices (the model's ~18 MB of projections), so W comes from
// the last-level cache as in a forward, not from L1. Counters: `per_row_us` and `vs_memcpy`
// (time / the memcpy of the same W bytes in this run).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <chrono>
#include <cstring>
#include <random>

#include "model/weights.h"

namespace {

using kvsnap::detail::Floats;

constexpr int64_t kIn = 256, kOut = 768, kMatrices = 24;

struct Inputs {
  std::vector<Floats> weights;                       // row-major, for OpenBLAS
  std::vector<kvsnap::detail::PackedMatrix> packed;  // the same, as the model holds them
  Floats x, y;
  Inputs() : x(512 * kIn), y(512 * kOut) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t m = 0; m < kMatrices; ++m) {
      Floats w(kIn * kOut);
      for (float& v : w) v = normal(rng);
      packed.emplace_back(w, kIn, kOut);
      weights.push_back(std::move(w));
    }
    for (float& v : x) v = normal(rng);
  }
};

Inputs& inputs() {
  static Inputs in;
  return in;
}

// Seconds per memcpy of one W, measured in this run (the ratio's denominator).
double memcpy_seconds() {
  static const double seconds = [] {
    const Inputs& in = inputs();
    Floats copy(kIn * kOut);
    const int iterations = 2000;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) {
      std::memcpy(copy.data(), in.weights[i % kMatrices].data(), copy.size() * sizeof(float));
      benchmark::DoNotOptimize(copy.data());
      benchmark::ClobberMemory();
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
           iterations;
  }();
  return seconds;
}

template <class Product>
void run(benchmark::State& state, Product product) {
  const int64_t rows = state.range(0);
  Inputs& in = inputs();
  const double copy = memcpy_seconds();
  int64_t i = 0;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    product(rows, static_cast<size_t>(i++ % kMatrices), in);
    benchmark::DoNotOptimize(in.y.data());
    benchmark::ClobberMemory();
  }
  const double each =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
      static_cast<double>(i);
  state.counters["per_row_us"] = each * 1e6 / static_cast<double>(rows);
  state.counters["memcpy_us"] = copy * 1e6;
  state.counters["vs_memcpy"] = each / copy;
}

void BM_ModelMatmul(benchmark::State& state) {
  run(state, [](int64_t rows, size_t m, Inputs& in) {
    kvsnap::detail::matmul(in.x.data(), rows, in.packed[m], in.y.data());
  });
}

void BM_OpenBLAS(benchmark::State& state) {
  run(state, [](int64_t rows, size_t m, Inputs& in) {
    const Floats& w = in.weights[m];
    if (rows == 1) {
      cblas_sgemv(CblasRowMajor, CblasTrans, kIn, kOut, 1.0f, w.data(), kOut, in.x.data(), 1, 0.0f,
                  in.y.data(), 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), kOut, kIn,
                  1.0f, in.x.data(), kIn, w.data(), kOut, 0.0f, in.y.data(), kOut);
    }
  });
}

BENCHMARK(BM_ModelMatmul)->Arg(1)->Arg(8)->Arg(64)->Arg(512);
BENCHMARK(BM_OpenBLAS)->Arg(1)->Arg(8)->Arg(64)->Arg(512);

}  // namespace

BENCHMARK_MAIN();
