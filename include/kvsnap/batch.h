// Batch — what one forward step of a layer processes: token ids and where each row stands.
//
// Row b holds seq_query_lens[b] real tokens (the rest of its L columns are padding) starting
// at absolute position seq_offsets[b]:
//
//   auto batch = kvsnap::Batch::single(std::vector<int32_t>{5, 6, 7}, /*offset=*/10);
//   // one row, positions 10, 11, 12
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvsnap/array.h"
#include "kvsnap/export.h"

namespace kvsnap {

struct KVSNAP_EXPORT Batch {
  Array input_ids;                      // [B, L] i32
  std::vector<int32_t> seq_offsets;     // per row: position where this chunk starts
  std::vector<int32_t> seq_query_lens;  // per row: real query length (rest is padding)

  // One row of `tokens` starting at `offset`, no padding.
  [[nodiscard]] static Batch single(std::span<const int32_t> tokens, int64_t offset);
  // `rows` rows of `length` placeholder tokens (id 0) each, all starting at `offset`; for
  // layers that only need positions.
  [[nodiscard]] static Batch uniform(int64_t rows, int64_t length, int64_t offset);

  // Rows B (from seq_offsets).
  int64_t batch_size() const { return static_cast<int64_t>(seq_offsets.size()); }
  // Columns L: input_ids' second axis, or the longest query when input_ids is empty.
  int64_t length() const;
  // Throws Error naming `call` unless the per-row vectors agree with each other and with
  // input_ids, and every offset and length is non-negative and no length exceeds L.
  void validate(const char* call) const;
};

}  // namespace kvsnap
