// Internal: the decode step of many sequences at once, over paged histories.
#pragma once

#include <cstddef>
#include <optional>

#include "kvsnap/array.h"
#include "kvsnap/attention.h"
#include "kvsnap/batch.h"

namespace kvsnap::detail {

// The most floats of attention scratch (scores, stacked queries) a thread keeps between calls
// (8 MB): below it, buffers are reused instead of allocated, page-faulted and zeroed on every
// layer of every step; above it (prefills of very long contexts), they live for the call.
inline constexpr size_t kKeptScratch = size_t{2} << 20;

// The calling thread's kept Scratch when `floats` fit within kKeptScratch, else `once` (which
// lives for the call). One kept Scratch per type and thread.
template <class Scratch>
Scratch& scratch_for(size_t floats, Scratch& once) {
  thread_local Scratch kept;
  return floats <= kKeptScratch ? kept : once;
}

// Attention of a batch whose rows each hold one query over a paged f32 history under positional
// rules (causal, lookback): the decode step of many sequences. Every block is read once per
// key/value head for all the queries that see it: the query heads that share the key/value head
// and the rows whose histories hold that same block (a shared prefix) go through one product.
// nullopt when the batch is not of that form; the caller then takes the general path.
std::optional<Array> attend_decode(const Batch& batch, const Array& q, const KVHistory& history,
                                   const AttentionMask& logical, float scale);

// A BLAS leading dimension for rows of `n` floats: BLAS refuses one below 1 (and leaves its
// output unwritten), even where no element is read (a depth of 0).
inline int blas_ld(int64_t n) { return static_cast<int>(n < 1 ? 1 : n); }

}  // namespace kvsnap::detail
