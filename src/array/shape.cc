#include "kvsnap/shape.h"

#include <fmt/format.h>

#include "kvsnap/error.h"

namespace kvsnap {

void Shape::require(size_type count) {
  if (count > kCapacity) {
    throw Error(
        fmt::format("Shape: {} extents do not fit; a shape holds at most {}", count, kCapacity));
  }
}

}  // namespace kvsnap
