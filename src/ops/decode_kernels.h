// Internal: the two products of decode attention over one run of key/value columns, for a set of
// queries that all see it (the query heads of one key/value head, for every row whose history
// holds the run): scores = scale * Q K^T, then out += P V.
//
// Each result is one sum in a fixed order — scores over the depth from zero, outputs over the
// columns onto what the output holds — so a query's result does not depend on which other
// queries share the product: a row's decode attention is the same whether its prefix blocks are
// shared with seven other rows or not. Keys and values are read in place (no packing): a run is
// read once for all the queries, in register tiles of them. Built for AVX-512 and for AVX2 with
// FMA (decode_kernels_available()), bitwise the same sums on both; elsewhere decode attention
// keeps its BLAS products.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvsnap::detail {

// Whether this CPU runs the kernels below (AVX-512F, or AVX2 with FMA); callers use BLAS
// otherwise.
bool decode_kernels_available();

// For tests: while one lives, decode_kernels_available() answers false, so attention takes the
// BLAS products it takes on a CPU without AVX2 (on one with it, a path otherwise never run).
class DecodeKernelsOff {
 public:
  DecodeKernelsOff();
  ~DecodeKernelsOff();
  DecodeKernelsOff(const DecodeKernelsOff&) = delete;
  DecodeKernelsOff& operator=(const DecodeKernelsOff&) = delete;
};

// `count` key or value columns from `data`, a stride apart: one run of a history, which may
// be one of several that do not continue each other in memory (a paged history's blocks).
struct ColumnRun {
  const float* data;
  int64_t count;
};

// scores[i][c] = scale * sum_d queries[i][d] * key(c)[d], for i in [0, m) and the columns c of
// the runs one after another (scores[i] holds that many); each queries[i] holds `depth` floats
// and each key column `depth` floats. `scratch` is reused between calls.
void decode_scores(const float* const* queries, int64_t m, int64_t depth, const ColumnRun* runs,
                   size_t n_runs, int64_t key_stride, float scale, float* const* scores,
                   std::vector<float>& scratch);

// out[i][v] += sum_c weights[i][c] * value(c)[v], for v in [0, value_depth), where the columns c
// are the runs' columns one after another (weights[i] holds that many), added in order: the
// same sums as one call per run, kept in registers across the runs (a history in blocks that do
// not continue each other in memory is weighed in one call).
void decode_weigh(const float* const* weights, int64_t m, const ColumnRun* runs, size_t n_runs,
                  int64_t value_stride, int64_t value_depth, float* const* out);

// For tests: each variant of the kernels this CPU runs, the one decode_scores and decode_weigh
// use last; every variant gives bitwise the same results. `scores` takes a scratch of depth x 32
// floats.
struct DecodeKernelVariant {
  const char* name;
  void (*scores)(const float* const* queries, int64_t m, int64_t depth, const ColumnRun* runs,
                 size_t n_runs, int64_t key_stride, float scale, float* const* scores,
                 float* scratch);
  void (*weigh)(const float* const* weights, int64_t m, const ColumnRun* runs, size_t n_runs,
                int64_t value_stride, int64_t value_depth, float* const* out);
};
std::vector<DecodeKernelVariant> decode_kernel_variants();

}  // namespace kvsnap::detail
