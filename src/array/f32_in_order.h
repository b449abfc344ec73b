// Internal: an array as f32 in row-major order, for code that reads its floats by index.
#pragma once

#include "kvsnap/array.h"

namespace kvsnap::detail {

// `a` itself when it already is f32 and contiguous (read in place: a large mask is not copied),
// else one converted, compact copy.
inline Array f32_in_order(const Array& a) {
  return a.dtype() == DType::f32 && a.is_contiguous() ? a : a.astype(DType::f32);
}

}  // namespace kvsnap::detail
