// Element types of kvsnap arrays and the exact conversions between them.
//
// f16 is IEEE 754 binary16, bf16 is the upper half of binary32. Conversions from float round to
// nearest, ties to even; they keep infinities, signed zeros and subnormals, and map NaN to a
// quiet NaN of the same sign:
//
//   uint16_t h = kvsnap::float_to_f16(1.0f / 3);   // 0x3555
//   float x = kvsnap::f16_to_float(h);            // 0.333251953125f
#pragma once

#include <cstdint>
#include <string_view>

#include "kvsnap/export.h"

namespace kvsnap {

enum class DType : uint8_t { f32, f16, bf16, i32 };

// Bytes per element: 4, 2, 2, 4. (Inline: every element access and copy asks it.)
constexpr int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
  }
  return 0;
}
// "f32", "f16", "bf16", "i32" — the names error messages and files use.
KVSNAP_EXPORT std::string_view dtype_name(DType);

// binary32 -> binary16, round to nearest even; overflow gives ±inf.
KVSNAP_EXPORT uint16_t float_to_f16(float) noexcept;
// binary16 -> binary32, exact.
KVSNAP_EXPORT float f16_to_float(uint16_t) noexcept;
// binary32 -> bfloat16, round to nearest even; overflow gives ±inf.
KVSNAP_EXPORT uint16_t float_to_bf16(float) noexcept;
// bfloat16 -> binary32, exact.
KVSNAP_EXPORT float bf16_to_float(uint16_t) noexcept;

}  // namespace kvsnap
