// Internal to the benchmarks: the groups of figures `kvsnap bench` runs, each appending to the
// list, and the limits they share.
#pragma once

#include <vector>

#include "common.h"
#include "figures.h"

namespace kvsnap::bench {

constexpr double kMiB = 1024.0 * 1024.0;

// Whether this is a smoke run (BenchOptions::smoke), and `n` scaled for it: n / 64, at least
// `least`, in a smoke run; n otherwise.
bool smoke();
int64_t sized(int64_t n, int64_t least = 1);

// memcpy of `bytes` into a warm destination (the bandwidth limit for copies into live buffers).
double memcpy_ns(int64_t bytes);
// compute_limit.cc: floating-point operations one core issues per ns in the widest fma the
// model's kernels use here, nothing waiting on memory (the limit of compute-bound figures);
// measured on the first call outside a smoke run, the same afterwards.
double fma_peak_flops_per_ns();

// cache_figures.cc
void decode_figures(std::vector<Figure>& out, const Shape& shape);
void outstanding_snapshot_figures(std::vector<Figure>& out, const Shape& shape);
void prefill_figures(std::vector<Figure>& out, const Shape& shape);
void capture_figures(std::vector<Figure>& out, const Shape& shape);
void copy_figures(std::vector<Figure>& out, const Shape& shape);
void merge_split_figures(std::vector<Figure>& out, const Shape& shape);
void recurrent_figures(std::vector<Figure>& out);

// serving_figures.cc
void trie_figures(std::vector<Figure>& out);
void model_figures(std::vector<Figure>& out);
void prefix_overhead_figures(std::vector<Figure>& out, const BenchOptions& options);
void end_to_end_figures(std::vector<Figure>& out, const BenchOptions& options);
void parallel_figures(std::vector<Figure>& out, const BenchOptions& options);

// tier_figures.cc
void tier_figures(std::vector<Figure>& out, const Shape& shape);

}  // namespace kvsnap::bench
