// Batch — what one forward step of a layer processes: token ids and where each row stands.
//
// Row b belongs to sequence seq_ids[b] (row b is sequence b when seq_ids is empty) and holds
// seq_query_lens[b] real tokens (the rest of its L columns are padding) starting at absolute
// position seq_offsets[b]. Rows of one batch are different sequences, each with its own offset
// and length (continuous batching: one row may prefill a chunk while others decode a token):
//
//   auto batch = kvsnap::Batch::single(std::vector<int32_t>{5, 6, 7}, /*offset=*/10);
//   // one row (sequence 0), positions 10, 11, 12
//   auto mixed = kvsnap::Batch::rows({{/*seq=*/3, /*offset=*/40, {9, 8, 7, 6}},
//                                     {/*seq=*/5, /*offset=*/900, {4}}});
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

#include "kvsnap/array.h"
#include "kvsnap/export.h"

namespace kvsnap {

struct KVSNAP_EXPORT Batch {
  Array input_ids;                      // [B, L] i32
  std::vector<int32_t> seq_offsets;     // per row: position where this chunk starts
  std::vector<int32_t> seq_query_lens;  // per row: real query length (rest is padding)
  std::vector<int32_t> seq_ids;         // per row: its sequence; empty: row b is sequence b

  // The factories throw Error when an offset or a length does not fit in int32.
  // One row of `tokens` starting at `offset`, no padding.
  [[nodiscard]] static Batch single(std::span<const int32_t> tokens, int64_t offset);
  // One row per chunk: its sequence, the position its tokens start at, and the tokens; rows are
  // padded to the longest chunk with token 0.
  struct Chunk {
    int32_t seq = 0;
    int64_t offset = 0;
    std::vector<int32_t> tokens;
  };
  [[nodiscard]] static Batch rows(std::span<const Chunk> chunks);
  [[nodiscard]] static Batch rows(std::initializer_list<Chunk> chunks) {
    return rows(std::span<const Chunk>(chunks.begin(), chunks.size()));
  }
  // `rows` rows of `length` placeholder tokens (id 0) each, all starting at `offset`; for
  // layers that only need positions. Error too for rows outside [0, 2^31) or length < 0.
  [[nodiscard]] static Batch uniform(int64_t rows, int64_t length, int64_t offset);

  // Rows B (from seq_offsets).
  int64_t batch_size() const { return static_cast<int64_t>(seq_offsets.size()); }
  // The sequence of row `row`; Error for a row outside [0, rows) (rows: seq_ids', else
  // batch_size()).
  int32_t seq_id(int64_t row) const {
    const size_t rows = seq_ids.empty() ? seq_offsets.size() : seq_ids.size();
    if (row < 0 || static_cast<size_t>(row) >= rows) bad_row("Batch::seq_id", row, rows);
    return seq_ids.empty() ? static_cast<int32_t>(row) : seq_ids[static_cast<size_t>(row)];
  }
  // The batch of row `row` alone (its input ids, offset, length and sequence), L columns wide
  // as this batch is (placeholder ids 0 when input_ids is empty and the row is shorter). Error
  // for a row outside [0, batch_size()), or a batch of fewer or more seq_query_lens than rows.
  [[nodiscard]] Batch row(int64_t row) const;
  // Columns L: input_ids' second axis, or the longest query when input_ids is empty.
  int64_t length() const;

  // Throws Error "CALL: row R of a batch of N rows: need 0 <= row < N" (seq_id's refusal,
  // kept out of line).
  [[noreturn]] static void bad_row(const char* call, int64_t row, size_t rows);
  // Throws Error naming `call` unless the per-row vectors agree with each other and with
  // input_ids, every offset and length is non-negative, no length exceeds L, and sequence ids
  // are non-negative and distinct (a sequence has one row per batch).
  void validate(const char* call) const;
};

}  // namespace kvsnap
