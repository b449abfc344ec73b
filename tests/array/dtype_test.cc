#include <gtest/gtest.h>
#include <kvsnap/dtype.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kvsnap {
namespace {

float bits_to_float(uint32_t bits) { return std::bit_cast<float>(bits); }

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4);
  EXPECT_EQ(dtype_size(DType::f16), 2);
  EXPECT_EQ(dtype_size(DType::bf16), 2);
  EXPECT_EQ(dtype_size(DType::i32), 4);
  EXPECT_EQ(dtype_name(DType::bf16), "bf16");
}

TEST(Float16, EveryHalfRoundTripsExactlyThroughFloat) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto half = static_cast<uint16_t>(h);
    const float value = f16_to_float(half);
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(value)))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(float_to_f16(value), half) << std::hex << h;
  }
}

TEST(Float16, KnownValues) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(float_to_f16(0.0f), 0x0000);
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);  // sign of zero kept
  EXPECT_EQ(float_to_f16(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(f16_to_float(0x3555), 0.333251953125f);
}

TEST(Float16, SubnormalsConvertExactly) {
  const float smallest = std::ldexp(1.0f, -24);  // smallest half subnormal
  EXPECT_EQ(float_to_f16(smallest), 0x0001);
  EXPECT_EQ(f16_to_float(0x0001), smallest);
  EXPECT_EQ(float_to_f16(std::ldexp(1023.0f, -24)), 0x03ff);  // largest subnormal
  EXPECT_EQ(f16_to_float(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(float_to_f16(-smallest), 0x8001);
}

TEST(Float16, TiesRoundToEven) {
  // 1 + 2^-11 is halfway between 1 (even mantissa) and 1 + 2^-10: rounds down to even.
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3*2^-11 is halfway between 1+2^-10 (odd) and 1+2^-9 (even): rounds up to even.
  EXPECT_EQ(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Just above a tie rounds up.
  EXPECT_EQ(float_to_f16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Subnormal ties: 2^-25 is halfway between 0 and 2^-24 -> 0; 3*2^-25 -> 2*2^-24.
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -25)), 0x0002);
  EXPECT_EQ(float_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  // Rounding carries from the largest subnormal into the smallest normal.
  EXPECT_EQ(float_to_f16(std::ldexp(1023.5f, -24)), 0x0400);
}

TEST(Float16, OverflowInfinityAndNaN) {
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);  // below the halfway point to 65536
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // tie to even -> inf
  EXPECT_EQ(float_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(float_to_f16(-1e10f), 0xfc00);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(std::isinf(f16_to_float(0x7c00)));
  const uint16_t nan = float_to_f16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  EXPECT_TRUE(std::isnan(f16_to_float(nan)));
  // A signalling NaN whose payload lies only in the dropped bits must still stay NaN.
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(bits_to_float(0x7f800001u)))));
  EXPECT_EQ(float_to_f16(bits_to_float(0xffc00000u)) & 0x8000, 0x8000);  // sign kept
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -30)), 0x0000);                // underflow to zero
}

TEST(BFloat16, KnownValuesAndRoundTrip) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float value = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(value))));
      continue;
    }
    ASSERT_EQ(float_to_bf16(value), h) << std::hex << h;
  }
}

TEST(BFloat16, TiesRoundToEvenAndOverflowToInfinity) {
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3f808001u)), 0x3f81);  // above tie
  EXPECT_EQ(float_to_bf16(bits_to_float(0x00008000u)), 0x0000);  // subnormal tie -> even
  EXPECT_EQ(float_to_bf16(bits_to_float(0x00018000u)), 0x0002);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_to_float(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

}  // namespace
}  // namespace kvsnap
