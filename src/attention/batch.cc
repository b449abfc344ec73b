#include "kvsnap/batch.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvsnap {

Batch Batch::single(std::span<const int32_t> tokens, int64_t offset) {
  Batch batch;
  batch.input_ids = Array::from_ints(tokens, {1, static_cast<int64_t>(tokens.size())});
  batch.seq_offsets = {static_cast<int32_t>(offset)};
  batch.seq_query_lens = {static_cast<int32_t>(tokens.size())};
  return batch;
}

Batch Batch::uniform(int64_t rows, int64_t length, int64_t offset) {
  Batch batch;
  batch.input_ids = Array::zeros(DType::i32, {rows, length});
  batch.seq_offsets.assign(static_cast<size_t>(rows), static_cast<int32_t>(offset));
  batch.seq_query_lens.assign(static_cast<size_t>(rows), static_cast<int32_t>(length));
  return batch;
}

int64_t Batch::length() const {
  if (!input_ids.empty() && input_ids.ndim() == 2) return input_ids.dim(1);
  int32_t longest = 0;
  for (int32_t len : seq_query_lens) longest = std::max(longest, len);
  return longest;
}

void Batch::validate(const char* call) const {
  if (seq_offsets.size() != seq_query_lens.size()) {
    throw Error(fmt::format("{}: batch has {} seq_offsets but {} seq_query_lens (one per row)",
                            call, seq_offsets.size(), seq_query_lens.size()));
  }
  if (seq_offsets.empty()) throw Error(fmt::format("{}: batch has no rows", call));
  if (!input_ids.empty()) {
    if (input_ids.ndim() != 2 || input_ids.dtype() != DType::i32) {
      throw Error(fmt::format("{}: input_ids is {}; need i32[B, L]", call, input_ids.describe()));
    }
    if (input_ids.dim(0) != batch_size()) {
      throw Error(fmt::format("{}: input_ids has {} rows but the batch has {} seq_offsets", call,
                              input_ids.dim(0), batch_size()));
    }
  }
  const int64_t columns = length();
  for (size_t row = 0; row < seq_offsets.size(); ++row) {
    if (seq_offsets[row] < 0 || seq_query_lens[row] < 0 || seq_query_lens[row] > columns) {
      throw Error(fmt::format(
          "{}: row {} has offset {} and query length {}; need offset >= 0 and 0 <= length <= {}",
          call, row, seq_offsets[row], seq_query_lens[row], columns));
    }
  }
}

}  // namespace kvsnap
