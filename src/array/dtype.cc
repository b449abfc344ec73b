#include "kvsnap/dtype.h"

#include <bit>

namespace kvsnap {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "i32";
  }
  return "?";
}

uint16_t float_to_f16(float value) noexcept {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;

  if (magnitude >= 0x7f800000u) {  // inf or NaN; NaN stays NaN (quiet bit set)
    const uint32_t nan_payload =
        magnitude > 0x7f800000u ? (0x0200u | ((magnitude >> 13) & 0x3ffu)) : 0;
    return static_cast<uint16_t>(sign | 0x7c00u | nan_payload);
  }
  if (magnitude >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (magnitude < 0x38800000u) {    // below the smallest normal half (2^-14): subnormal or zero
    if (magnitude < 0x33000000u) {  // < 2^-25: rounds to zero (2^-25 itself is a tie to 0)
      return static_cast<uint16_t>(sign);
    }
    // Value = mantissa_with_hidden * 2^(exp-150); half subnormal unit is 2^-24.
    const uint32_t exponent = magnitude >> 23;
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14..24 bits to drop, so result in [0, 1024]
    const uint32_t truncated = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t result = truncated;
    if (remainder > halfway || (remainder == halfway && (truncated & 1u))) ++result;
    return static_cast<uint16_t>(sign | result);  // result may carry into the smallest normal
  }
  // Normal: rebias exponent (127 -> 15), drop 13 mantissa bits with round-to-nearest-even.
  const uint32_t rebiased = magnitude - 0x38000000u;
  const uint32_t truncated = rebiased >> 13;
  const uint32_t remainder = rebiased & 0x1fffu;
  uint32_t result = truncated;
  if (remainder > 0x1000u || (remainder == 0x1000u && (truncated & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);  // a carry into the exponent is the right result
}

float f16_to_float(uint16_t half) noexcept {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  uint32_t mantissa = half & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((mantissa & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t float_to_bf16(float value) noexcept {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force the quiet bit
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Round to nearest even on the dropped 16 bits; overflow of the largest finite gives inf.
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float bf16_to_float(uint16_t value) noexcept {
  return std::bit_cast<float>(static_cast<uint32_t>(value) << 16);
}

}  // namespace kvsnap
