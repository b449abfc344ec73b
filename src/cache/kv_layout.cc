#include "cache/kv_layout.h"

#include <fmt/format.h>

namespace kvsnap::detail {

KVLayout KVLayout::of(const Array& keys, const Array& values) {
  const Shape& k = keys.shape();
  const Shape& v = values.shape();
  return {k[0], k[1], k[3], v[3], keys.dtype(), values.dtype()};
}

std::string KVLayout::describe() const {
  return fmt::format("B={} H={} D={} Dv={} keys {} values {}", rows, heads, key_depth, value_depth,
                     dtype_name(key_dtype), dtype_name(value_dtype));
}

std::pair<Array, Array> KVLayout::allocate(int64_t tokens) const {
  return {Array::zeros(key_dtype, {rows, heads, tokens, key_depth}),
          Array::zeros(value_dtype, {rows, heads, tokens, value_depth})};
}

std::pair<Array, Array> KVLayout::allocate_uninitialized(int64_t tokens) const {
  return {Array::uninitialized(key_dtype, {rows, heads, tokens, key_depth}),
          Array::uninitialized(value_dtype, {rows, heads, tokens, value_depth})};
}

void check_same_layout(const KVLayout& existing, const KVLayout& incoming, const char* call) {
  if (existing != incoming) {
    throw Error(
        fmt::format("{}: layout {} differs from the cache's {} (batch size, heads, depth "
                    "and dtype are fixed until reset)",
                    call, incoming.describe(), existing.describe()));
  }
}

void check_one_row(const KVLayout& layout, const char* call) {
  if (layout.rows == 1) return;
  throw Error(fmt::format(
      "{}: the snapshot holds {} batch rows; a sequence is one row (B=1): restore each row's "
      "snapshot into its own sequence",
      call, layout.rows));
}

int64_t check_update(const Batch& batch, const Array& keys, const Array& values, int64_t offset,
                     const KVLayout* existing, const char* call, int64_t first_row, SeqId seq) {
  batch.validate(call);
  if (keys.empty() || values.empty() || keys.ndim() != 4 || values.ndim() != 4) {
    throw Error(fmt::format("{}: keys {} and values {} must be 4-d [B, H, L, D]", call,
                            keys.describe(), values.describe()));
  }
  if (keys.dtype() == DType::i32 || values.dtype() == DType::i32) {
    throw Error(fmt::format("{}: keys {} and values {} must be float (f32, f16, bf16)", call,
                            keys.describe(), values.describe()));
  }
  const int64_t rows = batch.batch_size();
  const int64_t length = batch.length();
  const Shape& k = keys.shape();
  const Shape& v = values.shape();
  if (k[0] != rows || v[0] != rows || k[1] != v[1] || k[2] != length || v[2] != length) {
    throw Error(fmt::format("{}: keys {} and values {} do not fit a batch of {} rows x {} tokens",
                            call, keys.describe(), values.describe(), rows, length));
  }
  if (k[1] < 1 || k[3] < 1 || v[3] < 1) {
    throw Error(fmt::format("{}: keys {} and values {}: heads and depths must be >= 1", call,
                            keys.describe(), values.describe()));
  }
  const int32_t query = batch.seq_query_lens[0];
  for (int64_t row = 0; row < rows; ++row) {
    if (batch.seq_offsets[row] != offset || batch.seq_query_lens[row] != query) {
      throw Error(fmt::format(
          "{}: row {} starts at {} with {} tokens; its sequence {} is at offset {} (every row "
          "must start at its sequence's offset)",
          call, first_row + row, batch.seq_offsets[row], batch.seq_query_lens[row], seq, offset));
    }
  }
  if (existing != nullptr) {
    const KVLayout incoming{k[0], k[1], k[3], v[3], keys.dtype(), values.dtype()};
    if (incoming != *existing) check_same_layout(*existing, incoming, call);
  }
  return query;
}

}  // namespace kvsnap::detail
