// Internal: a paged history's columns copied into contiguous arrays.
#pragma once

#include "kvsnap/attention.h"

namespace kvsnap::detail {

// Copies the `p.length` columns of `p` into `keys` [1, H, length, D] and `values`
// [1, H, length, Dv] (allocated by the caller in the chunks' dtypes), block after block.
void gather_paged(const PagedColumns& p, const Array& keys, const Array& values);

}  // namespace kvsnap::detail
