// Internal: Batch::row without allocating once warm, for the caches' updates of several rows.
#pragma once

#include <cstdint>

#include "kvsnap/batch.h"

namespace kvsnap::detail {

// Row `row` of `batch` (whose length() is `length`) into `one`, as Batch::row makes it, reusing
// one's vectors; placeholder ids (the batch has none and the row is shorter than `length`) are a
// view of `placeholder`, zeros made again only when shorter than `length`.
inline void row_batch(const Batch& batch, int64_t row, int64_t length, Batch& one,
                      Array& placeholder) {
  const auto r = static_cast<size_t>(row);
  if (!batch.input_ids.empty()) {
    one.input_ids = batch.input_ids.slice(0, row, row + 1);
  } else if (batch.seq_query_lens[r] < length) {
    if (placeholder.empty() || placeholder.dim(1) < length) {
      placeholder = Array::zeros(DType::i32, {1, length});
    }
    one.input_ids = placeholder.slice(1, 0, length);
  } else {
    one.input_ids = Array();
  }
  one.seq_offsets.assign(1, batch.seq_offsets[r]);
  one.seq_query_lens.assign(1, batch.seq_query_lens[r]);
  one.seq_ids.assign(1, batch.seq_id(row));
}

}  // namespace kvsnap::detail
