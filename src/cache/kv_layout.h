// Internal: the fixed layout of a KV cache's buffers and the checks shared by both KV kinds.
#pragma once

#include <cstdint>

#include "kvsnap/array.h"
#include "kvsnap/batch.h"
#include "kvsnap/cache.h"

namespace kvsnap::detail {

// B, H, D, Dv and dtypes of keys [B, H, *, D] and values [B, H, *, Dv].
struct KVLayout {
  int64_t rows = 0, heads = 0, key_depth = 0, value_depth = 0;
  DType key_dtype = DType::f32, value_dtype = DType::f32;

  static KVLayout of(const Array& keys, const Array& values);
  // The layout of one row of `keys` and `values` (B = 1).
  static KVLayout of_row(const Array& keys, const Array& values) {
    KVLayout layout = of(keys, values);
    layout.rows = 1;
    return layout;
  }
  bool operator==(const KVLayout&) const = default;
  // "B=1 H=8 D=128 Dv=128 keys f16 values f16"
  std::string describe() const;
  // Bytes of one token's keys and values over all rows and heads.
  int64_t token_bytes() const {
    return rows * heads *
           (key_depth * dtype_size(key_dtype) + value_depth * dtype_size(value_dtype));
  }
  // Allocates keys [B, H, tokens, D] and values [B, H, tokens, Dv], zeroed.
  std::pair<Array, Array> allocate(int64_t tokens) const;
  // The same, contents unspecified: for buffers about to be overwritten.
  std::pair<Array, Array> allocate_uninitialized(int64_t tokens) const;
};

// The most tokens a cache's sizes (a window, a pool chunk) may span: an array holds at most 2^60
// elements (check_shape in array.cc), so no buffer of more tokens can exist, and sizes this
// small leave room for the arithmetic on them (round_up, sums of two) not to overflow.
inline constexpr int64_t kMaxTokens = int64_t{1} << 60;

// `value` rounded up to a multiple of `step`.
constexpr int64_t round_up(int64_t value, int64_t step) { return (value + step - 1) / step * step; }

// Validates an update of one sequence: batch rows at `offset` with one shared query length,
// keys/values 4-d float [B, H, L, D] / [B, H, L, Dv] matching `existing` when it is set. Returns
// the real query length. Throws Error naming `call`; a misplaced row is named as row
// `first_row` + its index (the batch may be one row of a caller's larger batch) of sequence
// `seq`.
int64_t check_update(const Batch& batch, const Array& keys, const Array& values, int64_t offset,
                     const KVLayout* existing, const char* call, int64_t first_row = 0,
                     SeqId seq = 0);

// Throws Error naming `call` when `incoming` differs from `existing`.
void check_same_layout(const KVLayout& existing, const KVLayout& incoming, const char* call);
// Throws Error naming `call` unless a restored snapshot of `layout` is one batch row: a sequence
// is one row (a file or a store can hold a record of more).
void check_one_row(const KVLayout& layout, const char* call);

}  // namespace kvsnap::detail
