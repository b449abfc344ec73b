#include "kvsnap/batch.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

namespace kvsnap {
namespace {

// `value` as a batch's int32 offset or length; Error naming `call`, the row (when >= 0), `what`
// and the value when it does not fit (a silent cast would move the row to another position).
int32_t to_int32(int64_t value, const char* call, const char* what, int64_t row = -1) {
  if (value >= std::numeric_limits<int32_t>::min() &&
      value <= std::numeric_limits<int32_t>::max()) {
    return static_cast<int32_t>(value);
  }
  const std::string where = row >= 0 ? fmt::format("row {} ", row) : std::string();
  throw Error(
      fmt::format("{}: {}{} {} does not fit in int32 (a batch's offsets and lengths are int32)",
                  call, where, what, value));
}

}  // namespace

Batch Batch::single(std::span<const int32_t> tokens, int64_t offset) {
  const int32_t start = to_int32(offset, "Batch::single", "offset");
  const int32_t count =
      to_int32(static_cast<int64_t>(tokens.size()), "Batch::single", "token count");
  Batch batch;
  batch.input_ids = Array::from_ints(tokens, {1, count});
  batch.seq_offsets = {start};
  batch.seq_query_lens = {count};
  return batch;
}

Batch Batch::uniform(int64_t rows, int64_t length, int64_t offset) {
  const int32_t start = to_int32(offset, "Batch::uniform", "offset");
  const int32_t columns = to_int32(length, "Batch::uniform", "length");
  if (rows < 0 || rows > std::numeric_limits<int32_t>::max() || length < 0) {
    throw Error(fmt::format(
        "Batch::uniform: {} rows of length {}: need 0 <= rows <= 2^31 - 1 (row b is sequence "
        "b, an int32) and length >= 0",
        rows, length));
  }
  Batch batch;
  batch.input_ids = Array::zeros(DType::i32, {rows, length});
  batch.seq_offsets.assign(static_cast<size_t>(rows), start);
  batch.seq_query_lens.assign(static_cast<size_t>(rows), columns);
  return batch;
}

Batch Batch::rows(std::span<const Chunk> chunks) {
  Batch batch;
  size_t longest = 0;
  for (size_t r = 0; r < chunks.size(); ++r) {  // every row checked before anything is made
    const auto row = static_cast<int64_t>(r);
    (void)to_int32(chunks[r].offset, "Batch::rows", "offset", row);
    (void)to_int32(static_cast<int64_t>(chunks[r].tokens.size()), "Batch::rows", "token count",
                   row);
    longest = std::max(longest, chunks[r].tokens.size());
  }
  std::vector<int32_t> ids(chunks.size() * longest, 0);
  for (size_t r = 0; r < chunks.size(); ++r) {
    std::copy(chunks[r].tokens.begin(), chunks[r].tokens.end(), ids.begin() + r * longest);
    batch.seq_ids.push_back(chunks[r].seq);
    batch.seq_offsets.push_back(static_cast<int32_t>(chunks[r].offset));
    batch.seq_query_lens.push_back(static_cast<int32_t>(chunks[r].tokens.size()));
  }
  batch.input_ids =
      Array::from_ints(ids, {static_cast<int64_t>(chunks.size()), static_cast<int64_t>(longest)});
  return batch;
}

void Batch::bad_row(const char* call, int64_t row, size_t rows) {
  throw Error(
      fmt::format("{}: row {} of a batch of {} rows: need 0 <= row < {}", call, row, rows, rows));
}

Batch Batch::row(int64_t row) const {
  if (row < 0 || row >= batch_size()) bad_row("Batch::row", row, seq_offsets.size());
  if (seq_query_lens.size() != seq_offsets.size()) {
    throw Error(
        fmt::format("Batch::row: the batch has {} seq_offsets but {} seq_query_lens (one per row)",
                    seq_offsets.size(), seq_query_lens.size()));
  }
  Batch one;
  if (!input_ids.empty()) {
    one.input_ids = input_ids.slice(0, row, row + 1);
  } else if (seq_query_lens[static_cast<size_t>(row)] < length()) {
    // Without ids the row's length would be its own query length, not the batch's L columns
    // its keys and values span: placeholder ids (0) keep L.
    one.input_ids = Array::zeros(DType::i32, {1, length()});
  }
  one.seq_offsets = {seq_offsets[static_cast<size_t>(row)]};
  one.seq_query_lens = {seq_query_lens[static_cast<size_t>(row)]};
  one.seq_ids = {seq_id(row)};
  return one;
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
  if (seq_ids.empty()) return;
  if (seq_ids.size() != seq_offsets.size()) {
    throw Error(fmt::format("{}: batch has {} seq_ids for {} rows (one per row, or none)", call,
                            seq_ids.size(), seq_offsets.size()));
  }
  for (size_t row = 0; row < seq_ids.size(); ++row) {
    if (seq_ids[row] < 0) {
      throw Error(
          fmt::format("{}: row {} has sequence id {}; ids are >= 0", call, row, seq_ids[row]));
    }
    for (size_t other = 0; other < row; ++other) {
      if (seq_ids[other] == seq_ids[row]) {
        throw Error(
            fmt::format("{}: rows {} and {} are both sequence {} (a sequence has one row "
                        "per batch)",
                        call, other, row, seq_ids[row]));
      }
    }
  }
}

}  // namespace kvsnap
