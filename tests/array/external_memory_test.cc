// Array::wrap — arrays over memory kvsnap does not own (an engine's buffer, a numpy array).
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <numeric>
#include <vector>

#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::throws_error;

TEST(ExternalMemory, WrapReadsTheCallersBytesWithoutCopying) {
  std::vector<float> buffer{1, 2, 3, 4, 5, 6};
  const int64_t before = live_bytes();
  const Array a = Array::wrap(buffer.data(), DType::f32, {2, 3});
  EXPECT_EQ(live_bytes(), before);
  EXPECT_EQ(a.data<float>(), buffer.data());
  EXPECT_EQ(a.strides(), (Shape{3, 1}));
  buffer[4] = 50;
  EXPECT_EQ(a.to_floats(), (std::vector<float>{1, 2, 3, 4, 50, 6}));
}

TEST(ExternalMemory, ReleaseRunsOnceWhenTheLastViewGoes) {
  std::vector<float> buffer(8);
  int released = 0;
  Array view;
  {
    const Array a = Array::wrap(buffer.data(), DType::f32, {8}, {}, [&] { ++released; });
    view = a.slice(0, 2, 4);
  }
  EXPECT_EQ(released, 0);
  view = Array();
  EXPECT_EQ(released, 1);
}

TEST(ExternalMemory, StridesAreElementStridesOfTheCallersLayout) {
  std::vector<float> buffer(12);
  std::iota(buffer.begin(), buffer.end(), 0.0f);
  // A column-major 3x4 matrix: element (i, j) at i + 3 j.
  const Array a = Array::wrap(buffer.data(), DType::f32, {3, 4}, {1, 3});
  EXPECT_FALSE(a.is_contiguous());
  EXPECT_EQ(a.to_floats(), (std::vector<float>{0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11}));
}

TEST(ExternalMemory, CopiesOfWrappedMemoryAreOwnedAndCounted) {
  std::vector<float> buffer{1, 2, 3, 4};
  const Array a = Array::wrap(buffer.data(), DType::f32, {4});
  const int64_t before = live_bytes();
  const Array copy = a.contiguous();
  EXPECT_FALSE(copy.shares_storage(a));
  EXPECT_EQ(live_bytes(), before + copy.nbytes());
}

TEST(ExternalMemory, ACacheAdoptsWrappedRecurrentStatesWithoutCopying) {
  RecurrentCache cache(2, 3, 1, 2, 2);
  std::vector<float> conv(1 * 2 * 3), delta(1 * 1 * 2 * 2);
  int released = 0;
  const Array conv_state = Array::wrap(conv.data(), DType::f32, {1, 2, 3}, {}, [&] { ++released; });
  const Array delta_state =
      Array::wrap(delta.data(), DType::f32, {1, 1, 2, 2}, {}, [&] { ++released; });
  const Batch batch = Batch::uniform(1, 4, 0);
  const int64_t before = live_bytes();
  (void)cache.get(batch, DType::f32);  // zero states, released when put replaces them
  cache.put(batch, std::vector<Array>{conv_state}, std::vector<Array>{delta_state});
  EXPECT_EQ(live_bytes(), before);
  EXPECT_TRUE(cache.state()[0].shares_storage(conv_state));
  cache.reset();
  EXPECT_EQ(released, 0);  // the local handles still name the memory
}

TEST(ExternalMemory, BadLayoutsThrowAndLeaveTheMemoryWithTheCaller) {
  std::vector<float> buffer(8);
  int released = 0;
  const auto release = [&] { ++released; };
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Array::wrap(buffer.data(), DType::f32, {2, 4}, {4}, release);
      },
      {"Array::wrap", "1 strides given for shape [2, 4]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Array::wrap(buffer.data(), DType::f32, {2, 4}, {-4, 1}, release);
      },
      {"Array::wrap", "negative"}));
  // Strides whose last element lies more than 2^62 bytes on (a slice or copy would overflow).
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Array::wrap(buffer.data(), DType::f32, {2, 3}, {INT64_MAX / 2, 1}, release);
      },
      {"Array::wrap: strides [4611686018427387903, 1] over shape [2, 3] reach more than 2^62 "
       "bytes from the data"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Array::wrap(buffer.data(), DType::f32, {3, 2}, {int64_t{1} << 59, 1}, release);
      },
      {"reach more than 2^62 bytes"}));
  // Within the bound (the memory is the caller's to vouch for), and an empty shape reaches none.
  EXPECT_EQ(Array::wrap(buffer.data(), DType::f32, {2, 3}, {(int64_t{1} << 60) - 2, 1}).size(), 6);
  EXPECT_EQ(Array::wrap(buffer.data(), DType::f32, {0, 3}, {INT64_MAX, 1}).size(), 0);
  EXPECT_TRUE(throws_error([&] { (void)Array::wrap(nullptr, DType::f32, {2}, {}, release); },
                           {"Array::wrap: null data for shape [2]"}));
  EXPECT_TRUE(throws_error(
      [&] { (void)Array::wrap(reinterpret_cast<char*>(buffer.data()) + 2, DType::f32, {2}); },
      {"Array::wrap", "not aligned to 4 bytes"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Array::wrap(buffer.data(), DType::f32, {1, 1, 1, 1, 1});
      },
      {"Array::wrap", "at most 4"}));
  EXPECT_EQ(released, 0);
}

TEST(ExternalMemory, EmptyShapesMayWrapNull) {
  const Array a = Array::wrap(nullptr, DType::f16, {0, 4});
  EXPECT_EQ(a.size(), 0);
  EXPECT_TRUE(a.to_floats().empty());
}

}  // namespace
}  // namespace kvsnap
