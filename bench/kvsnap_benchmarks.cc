// Google Benchmark suite for kvsnap: the operations behind `kvsnap bench`, with bytes/s
// counters, for profiling and regressions. Compare each against BM_Memcpy of the same bytes.
#include <benchmark/benchmark.h>

#include "common.h"

namespace kvsnap::bench {
namespace {

const Shape kShape;

void BM_Memcpy(benchmark::State& state) {
  CopyBuffers buffers(state.range(0));
  for (auto _ : state) {
    buffers.copy();
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}
// The bytes of the operations below: a decode token's rows (4 KiB), 1k/32k/128k-token
// snapshots and prefills (4, 32, 128, 512 MiB).
BENCHMARK(BM_Memcpy)->Arg(4 << 10)->Arg(4 << 20)->Arg(32 << 20)->Arg(128 << 20)->Arg(512 << 20);

template <class Cache>
void decode_append(benchmark::State& state, Cache& cache, bool rewind, int64_t limit = 1 << 15) {
  const Chunk token(kShape, 1);
  Writer writer(1);
  for (auto _ : state) {
    if (rewind && cache.offset() == limit) (void)cache.restore(nullptr, 0);
    benchmark::DoNotOptimize(writer.write(cache, token));
  }
  state.SetBytesProcessed(state.iterations() * kShape.token_bytes());
}
void BM_DecodeAppendKVCache(benchmark::State& state) {
  KVCache cache;
  cache.reserve(1 << 15);
  decode_append(state, cache, true);
}
BENCHMARK(BM_DecodeAppendKVCache);
// The same over a 256-token buffer that stays in cache: the fixed cost without TLB and cache
// misses (compare with BM_DecodeAppendKVCache to see what the large buffer costs).
void BM_DecodeAppendKVCacheHot(benchmark::State& state) {
  KVCache cache;
  cache.reserve(256);
  decode_append(state, cache, true, 256);
}
BENCHMARK(BM_DecodeAppendKVCacheHot);
void BM_DecodeAppendRotating(benchmark::State& state) {
  RotatingKVCache cache(4096);
  decode_append(state, cache, false);
}
BENCHMARK(BM_DecodeAppendRotating);

void BM_ChunkedPrefill(benchmark::State& state) {
  const int64_t tokens = state.range(0), chunk_tokens = 512;
  const Chunk chunk(kShape, chunk_tokens);
  for (auto _ : state) {
    KVCache cache;
    Writer writer(chunk_tokens);
    for (int64_t i = 0; i < tokens / chunk_tokens; ++i) writer.write(cache, chunk);
    state.counters["copied_per_written"] =
        static_cast<double>(cache.copy_stats().appended_bytes + cache.copy_stats().growth_bytes) /
        static_cast<double>(cache.copy_stats().appended_bytes);
  }
  state.SetBytesProcessed(state.iterations() * tokens * kShape.token_bytes());
}
BENCHMARK(BM_ChunkedPrefill)->Arg(8 << 10)->Arg(128 << 10)->Unit(benchmark::kMillisecond);

void BM_LazySnapshot(benchmark::State& state) {
  KVCache cache;
  const Chunk chunk(kShape, 1024);
  Writer writer(1024);
  for (int i = 0; i < 101; ++i) writer.write(cache, chunk);
  for (auto _ : state) benchmark::DoNotOptimize(cache.snapshot(cache.offset() - state.range(0)));
}
BENCHMARK(BM_LazySnapshot)->Arg(1)->Arg(1000)->Arg(100000);

void BM_RestoreOwned(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  KVCache cache;
  cache.reserve(tokens);
  const Chunk chunk(kShape, 1024);
  Writer writer(1024);
  for (int64_t i = 0; i < tokens / 1024; ++i) writer.write(cache, chunk);
  SnapshotPtr s = cache.snapshot(0);
  (void)cache.restore(nullptr, 0);
  for (int64_t i = 0; i < tokens / 1024; ++i) writer.write(cache, chunk);  // s is copied out
  const int64_t restored = cache.copy_stats().restored_bytes;
  for (auto _ : state) {
    (void)cache.restore(nullptr, 0);
    if (!cache.restore(s.get(), tokens)) {
      state.SkipWithError("restore refused the snapshot");
      return;
    }
  }
  // Every iteration wrote the snapshot's bytes back: a restore that did less is not timed.
  const int64_t bytes = tokens * kShape.token_bytes();
  if (cache.copy_stats().restored_bytes - restored != state.iterations() * bytes) {
    state.SkipWithError("restore did not write the snapshot's bytes back");
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_RestoreOwned)->Arg(1 << 10)->Arg(32 << 10)->Arg(128 << 10);

void BM_SplitMergeLazy(benchmark::State& state) {
  KVCache cache;
  const Chunk chunk(kShape, 1024);
  Writer writer(1024);
  for (int i = 0; i < 101; ++i) writer.write(cache, chunk);
  const int64_t range = state.range(0);
  for (auto _ : state) {
    auto [a, b] = cache.split(cache.snapshot(cache.offset() - range), cache.offset() - range / 2);
    benchmark::DoNotOptimize(cache.merge(std::move(a), std::move(b)));
  }
}
BENCHMARK(BM_SplitMergeLazy)->Arg(1000)->Arg(100000);

}  // namespace
}  // namespace kvsnap::bench

BENCHMARK_MAIN();
