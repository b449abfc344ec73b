// Shared setup for kvsnap's benchmarks (`kvsnap bench` and the Google Benchmark suite): the
// benchmark layer shape and small helpers to drive caches with it.
#pragma once

#include <kvsnap/kvsnap.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace kvsnap::bench {

// The shape every figure uses unless stated: f16, 8 KV heads, head dim 128, one layer.
struct Shape {
  int64_t heads = 8;
  int64_t depth = 128;
  DType dtype = DType::f16;
  // Keys + values of one token.
  int64_t token_bytes() const { return 2 * heads * depth * dtype_size(dtype); }
};

// Keys and values [1, H, tokens, D] filled with a pattern (contents do not matter for speed).
struct Chunk {
  Array keys, values;
  Chunk(const Shape& shape, int64_t tokens)
      : keys(Array::zeros(shape.dtype, {1, shape.heads, tokens, shape.depth})),
        values(Array::zeros(shape.dtype, {1, shape.heads, tokens, shape.depth})) {}
  int64_t tokens() const { return keys.dim(2); }
};

// A reusable one-row batch whose offset is moved to the cache's before every write.
struct Writer {
  Batch batch;
  explicit Writer(int64_t tokens) : batch(Batch::uniform(1, tokens, 0)) {}
  KVHistory write(Attention& cache, const Chunk& chunk) {
    batch.seq_offsets[0] = static_cast<int32_t>(cache.offset());
    return cache.update(batch, chunk.keys, chunk.values);
  }
};

using Clock = std::chrono::steady_clock;

// Set while a smoke run of `kvsnap bench` runs (BenchOptions::smoke): the figures shrink their
// sizes (figure_parts.h: smoke(), sized()) and time_ns calls its op once.
inline bool smoke_run = false;

// Nanoseconds per call of `op`, the best of several timed batches of at least `min_seconds`.
template <class Op>
double time_ns(Op&& op, double min_seconds = 0.05, int repeats = 3) {
  if (smoke_run) {
    min_seconds = 0;
    repeats = 1;
  }
  int64_t iterations = 1;
  double best = 1e300;
  for (int r = 0; r < repeats;) {
    const auto start = Clock::now();
    for (int64_t i = 0; i < iterations; ++i) op();
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (elapsed < min_seconds && iterations < (int64_t(1) << 40)) {
      iterations *= 2;
      continue;
    }
    best = std::min(best, elapsed * 1e9 / static_cast<double>(iterations));
    ++r;
  }
  return best;
}

// Warm source and destination buffers for memcpy limits, from the allocator kvsnap's own
// buffers come from (the same alignment and page backing: huge pages from 2 MiB on), so a limit
// is not slower than the operation it bounds only for having plain 4 KB pages.
struct CopyBuffers {
  Array source, destination;
  explicit CopyBuffers(int64_t bytes)
      : source(Array::zeros(DType::i32, {(bytes + 3) / 4})),
        destination(Array::zeros(DType::i32, {(bytes + 3) / 4})),
        bytes_(static_cast<size_t>(bytes)) {
    std::memset(source.mutable_data<int32_t>(), 1, bytes_);  // touched: warm, not zero pages
  }
  void copy() { std::memcpy(destination.mutable_data<int32_t>(), source.data<int32_t>(), bytes_); }

 private:
  size_t bytes_;
};

// Keeps the optimizer from dropping a result.
template <class T>
inline void keep(const T& value) {
  asm volatile("" : : "g"(&value) : "memory");
}

}  // namespace kvsnap::bench
