// `kvsnap replay --parallel N`: the workload served as an engine serves it — N sequences at
// once over one prefix cache, continuous batching of chunked prefills with fused decode steps.
#pragma once

#include <cstdint>
#include <functional>

#include "replay.h"

namespace kvsnap::tools {

struct ParallelOptions {
  int64_t parallel = 8;         // slots: sequences evaluated together
  int64_t prefill_chunk = 512;  // prompt tokens per step, over all prefilling sequences
  // Tokens per block of the paged attention caches: fewer, larger blocks mean fewer products per
  // decode step; a restore into the middle of a block copies that one block.
  int64_t block_tokens = 32;
  int64_t max_paged_out_bytes = int64_t(8) << 30;
  // As ReplayOptions: load the trie from here at start when saved there; the run's
  // RunResult::save_cache saves it there (the scheduler's memory is held until then).
  std::string cache_dir;
  // As ReplayOptions: trust a cache_dir that another user owns or that others can write.
  bool shared_cache_dir = false;
  std::string model_id;
  std::function<void(size_t, size_t)> progress = [](size_t, size_t) {};
};

// What the memory of the full-attention layers held at its peak (after a step): the blocks
// the live sequences use, what copies of each sequence's tokens would take, and the least
// any cache could hold (every token the sequences share counted once).
struct KVMemory {
  int64_t peak_bytes = 0;      // the pools' live blocks at their peak
  int64_t unshared_bytes = 0;  // each sequence's tokens on its own, at that step
  int64_t ideal_bytes = 0;     // the sequences' distinct prefixes, at that step
  // The pools' blocks in use at their own peak: the live sequences' and those only the prefix
  // cache's snapshots keep (which it counts as paged-out bytes).
  int64_t pool_bytes = 0;
};

struct ParallelRun {
  RunResult run;  // with_cache; per request in workload order
  int64_t parallel = 0;
  int64_t steps = 0;         // forwards
  int64_t fused_steps = 0;   // forwards carrying prompt chunks and decode tokens together
  int64_t reply_tokens = 0;  // generated
  KVMemory kv;
  double throughput() const {  // reply tokens per second
    return run.seconds > 0 ? static_cast<double>(reply_tokens) / run.seconds : 0.0;
  }
};

// The scheduler. A request is admitted once the request it follows (after / regenerate /
// edit) has finished, on the free slot whose live state it shares most with, unless a
// sequence still prefilling shares more of its prompt than the cache holds now (it waits for
// that prefill's restore points instead of computing the same tokens twice). Each step is one
// Model::forward: a token for every decoding sequence and up to `prefill_chunk` prompt tokens
// of the prefilling ones, in admission order. A request's ttft_seconds counts from when it took
// its slot, its waited_seconds from when it could be admitted (the run's start, or the end of
// the request it follows) to then; the report adds them, for the sequential run too. Throws
// Error as replay does (context length, vocabulary, options < 1).
ParallelRun replay_parallel(const Workload&, const Model&, const ParallelOptions&);

std::string format_parallel_table(const ParallelRun& parallel, const RunResult& uncached,
                                  const Comparison&, const std::string& workload);
// Both runs' requests, paired (check_paired).
std::string format_parallel_json(const ParallelRun& parallel, const RunResult& uncached,
                                 const Comparison&, const std::string& workload);

}  // namespace kvsnap::tools
