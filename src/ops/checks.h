// Internal: argument checks shared by the reference kernels.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <span>

#include "kvsnap/array.h"

namespace kvsnap::detail {

inline void require_ndim(const Array& array, int ndim, const char* call, const char* name,
                         const char* layout) {
  if (array.empty() || array.ndim() != ndim) {
    throw Error(fmt::format("{}: {} is {}; need a {}-d array {}", call, name, array.describe(),
                            ndim, layout));
  }
}

inline void require_float(const Array& array, const char* call, const char* name) {
  if (array.dtype() == DType::i32) {
    throw Error(fmt::format("{}: {} is {}; need a float dtype (f32, f16, bf16)", call, name,
                            array.describe()));
  }
}

inline void require_extent(const Array& array, int axis, int64_t expected, const char* call,
                           const char* name) {
  if (array.dim(axis) != expected) {
    throw Error(fmt::format("{}: {} is {}; axis {} must be {}", call, name, array.describe(), axis,
                            expected));
  }
}

// Boundaries must be ascending, unique and strictly inside (0, length).
inline void require_boundaries(std::span<const int64_t> boundaries, int64_t length,
                               const char* call) {
  int64_t previous = 0;
  for (int64_t boundary : boundaries) {
    if (boundary <= previous || boundary >= length) {
      throw Error(
          fmt::format("{}: boundary {} invalid for a chunk of {} tokens (boundaries must be "
                      "ascending, unique and inside (0, {}))",
                      call, boundary, length, length));
    }
    previous = boundary;
  }
}

}  // namespace kvsnap::detail
