#include <gtest/gtest.h>
#include <kvsnap/array.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "array/strided_copy.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::throws_error;

std::vector<float> iota(size_t count) {
  std::vector<float> values(count);
  std::iota(values.begin(), values.end(), 0.0f);
  return values;
}

TEST(Array, DefaultIsEmpty) {
  Array a;
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.size(), 0);
  EXPECT_EQ(a.nbytes(), 0);
  EXPECT_TRUE(a.to_floats().empty());
}

TEST(Array, ZerosHasShapeDtypeAndBytes) {
  const auto a = Array::zeros(DType::bf16, {2, 3, 4});
  EXPECT_EQ(a.dtype(), DType::bf16);
  EXPECT_EQ(a.ndim(), 3);
  EXPECT_EQ(a.dim(-1), 4);
  EXPECT_EQ(a.dim(0), 2);
  EXPECT_EQ(a.size(), 24);
  EXPECT_EQ(a.nbytes(), 48);
  EXPECT_EQ(a.strides(), (Shape{12, 4, 1}));
  for (float v : a.to_floats()) EXPECT_EQ(v, 0.0f);
}

TEST(Array, FromFloatsConvertsPerDtype) {
  const std::vector<float> values{1.0f, 1.0f / 3.0f, -2.5f, 65504.0f};
  EXPECT_EQ(Array::from_floats(values, {4}).to_floats(), values);
  const auto half = Array::from_floats(values, {2, 2}, DType::f16).to_floats();
  EXPECT_EQ(half[1], f16_to_float(float_to_f16(1.0f / 3.0f)));
  const auto brain = Array::from_floats(values, {4}, DType::bf16).to_floats();
  EXPECT_EQ(brain[1], bf16_to_float(float_to_bf16(1.0f / 3.0f)));
  EXPECT_EQ(brain[2], -2.5f);
}

TEST(Array, FromIntsKeepsValues) {
  const std::vector<int32_t> ids{3, -1, 7, 2'000'000'000};
  const auto a = Array::from_ints(ids, {2, 2});
  EXPECT_EQ(a.dtype(), DType::i32);
  EXPECT_EQ(a.to_ints(), ids);
}

TEST(Array, LiveBytesCountStorageAndReturnToZero) {
  const int64_t before = live_bytes();
  {
    const auto a = Array::zeros(DType::f16, {8, 16});
    EXPECT_EQ(live_bytes() - before, 256);
    const Array copy = a;  // a handle copy shares the buffer
    EXPECT_EQ(live_bytes() - before, 256);
  }
  EXPECT_EQ(live_bytes(), before);
}

TEST(Array, SliceIsAViewThatAllocatesNothing) {
  const auto a = Array::from_floats(iota(24), {2, 3, 4});
  const int64_t bytes = live_bytes();
  const int64_t allocations = allocation_count();
  const auto view = a.slice(1, 1, 3).slice(2, 2, 4).slice(0, 1, 2);
  EXPECT_EQ(live_bytes(), bytes);
  EXPECT_EQ(allocation_count(), allocations);
  EXPECT_TRUE(view.shares_storage(a));
  EXPECT_EQ(view.shape(), (Shape{1, 2, 2}));
  EXPECT_FALSE(view.is_contiguous());
  EXPECT_EQ(view.to_floats(), (std::vector<float>{18, 19, 22, 23}));
}

TEST(Array, ViewsSeeWritesThroughSharedStorage) {
  const auto a = Array::zeros(DType::f32, {2, 4});
  const auto right = a.slice(1, 2, 4);
  right.assign(Array::from_floats(std::vector<float>{1, 2, 3, 4}, {2, 2}));
  EXPECT_EQ(a.to_floats(), (std::vector<float>{0, 0, 1, 2, 0, 0, 3, 4}));
}

TEST(Array, ContiguousCopiesIntoANewBuffer) {
  const auto a = Array::from_floats(iota(12), {3, 4});
  const auto view = a.slice(1, 1, 3);
  const int64_t before = live_bytes();
  const auto copy = view.contiguous();
  EXPECT_EQ(live_bytes() - before, copy.nbytes());
  EXPECT_FALSE(copy.shares_storage(a));
  EXPECT_TRUE(copy.is_contiguous());
  EXPECT_EQ(copy.to_floats(), view.to_floats());
  copy.assign(Array::zeros(DType::f32, {3, 2}));  // the copy is independent of the original
  EXPECT_EQ(view.to_floats(), (std::vector<float>{1, 2, 5, 6, 9, 10}));
  EXPECT_FALSE(a.clone().shares_storage(a));
}

TEST(Array, StridedCopyMovesWholeRuns) {
  // [B=1, H=4, K=64, D=32] view of the first 10 tokens of each head: 4 runs of 10*32 elements.
  const auto cache = Array::zeros(DType::f16, {1, 4, 64, 32});
  const auto window = cache.slice(2, 0, 10);
  int64_t calls = detail::strided_copy_calls();
  (void)window.contiguous();
  EXPECT_EQ(detail::strided_copy_calls() - calls, 4);
  // A compact array copies in a single run.
  calls = detail::strided_copy_calls();
  (void)cache.contiguous();
  EXPECT_EQ(detail::strided_copy_calls() - calls, 1);
  // Writing a chunk into the cache's slots is one run per head.
  calls = detail::strided_copy_calls();
  cache.slice(2, 10, 20).assign(Array::zeros(DType::f16, {1, 4, 10, 32}));
  EXPECT_EQ(detail::strided_copy_calls() - calls, 4);
}

// A run of `run` elements of `size` bytes at byte `at` of `destination`, as from `source`, with
// zero bytes just before and after it; zeroes it again.
void expect_run_and_clear(std::vector<unsigned char>& destination, size_t at,
                          const unsigned char* source, size_t bytes) {
  EXPECT_TRUE(std::equal(source, source + bytes, destination.begin() + static_cast<ptrdiff_t>(at)))
      << bytes << " bytes at " << at;
  EXPECT_EQ(destination[at - 1], 0) << at;
  EXPECT_EQ(destination[at + bytes], 0) << at;
  std::fill_n(destination.begin() + static_cast<ptrdiff_t>(at), bytes, 0);
}

TEST(Array, StridedCopyStreamsLongRunsIntoAHistoryLargerThanACache) {
  // Inside a StreamingWrites (a write into a history larger than the last-level cache), two runs
  // a cache apart (a chunk written into two heads) stream: each run starts at every offset from a
  // cache line, for element sizes 1, 2 and 4 and lengths whose byte counts leave every kind of
  // tail, and must land exactly, the bytes around it untouched. (Sanitizer builds copy without
  // streaming stores: the same results, no streamed runs.)
  const int64_t span = detail::strided_copy_stream_span();
  const int64_t apart = std::max<int64_t>(span, int64_t{32} << 20);
  std::vector<unsigned char> source(2 * 4 * 5000);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<unsigned char>(i * 7 + 1);
  std::vector<unsigned char> destination(static_cast<size_t>(apart + 4 * 5000 + 256), 0);
  const auto base = static_cast<size_t>(64 - reinterpret_cast<uintptr_t>(destination.data()) %
                                                 64);  // 64-aligned, room before it
  const auto copy = [&](size_t at, int64_t run, int64_t size) {
    const int64_t shape[] = {2, run}, source_strides[] = {run, 1},
                  destination_strides[] = {apart / size, 1};
    const int64_t streamed = detail::strided_copy_streamed_runs();
    EXPECT_EQ(detail::strided_copy(destination.data() + at, destination_strides, source.data(),
                                   source_strides, shape, 2, size),
              2);
    return detail::strided_copy_streamed_runs() - streamed;
  };
  for (const int64_t size : {1, 2, 4}) {
    for (const int64_t run : {1025, 1088, 4999}) {
      if (run * size <= 1024) continue;
      for (int64_t offset = 0; offset < 64; offset += size) {
        const auto at = base + static_cast<size_t>(offset);
        {
          const detail::StreamingWrites streaming(true);
          EXPECT_EQ(copy(at, run, size), span > 0 ? 2 : 0)
              << run << " elements of " << size << " at +" << offset;
        }
        const auto bytes = static_cast<size_t>(run * size);
        expect_run_and_clear(destination, at, source.data(), bytes);
        expect_run_and_clear(destination, at + static_cast<size_t>(apart / size * size),
                             source.data() + bytes, bytes);
      }
    }
  }
  // Outside one, a copy that small takes the ordinary stores however far apart its runs lie;
  // inside one, so do runs of a kilobyte or less (a token's rows).
  EXPECT_EQ(copy(base, 2000, 1), 0);
  expect_run_and_clear(destination, base, source.data(), 2000);
  expect_run_and_clear(destination, base + static_cast<size_t>(apart), source.data() + 2000, 2000);
  const detail::StreamingWrites streaming(true);
  EXPECT_EQ(copy(base, 1024, 1), 0);
}

TEST(Array, StridedCopyStreamsACopyLargerThanACache) {
  // A copy moving at least the last-level cache's bytes (a growth copy, a large snapshot's) streams
  // its long runs; one a run short of that does not. The bytes land either way.
  const int64_t span = std::max<int64_t>(detail::strided_copy_stream_span(), 1 << 20);
  constexpr int64_t kRun = 4096;
  const int64_t runs = (span + kRun - 1) / kRun;
  std::vector<unsigned char> source(static_cast<size_t>(runs * kRun));
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<unsigned char>(i * 13 + 5);
  std::vector<unsigned char> destination(static_cast<size_t>(runs * (kRun + 64)), 0);
  for (const int64_t count : {runs, runs - 1}) {
    std::fill(destination.begin(), destination.end(), 0);
    const int64_t shape[] = {count, kRun}, source_strides[] = {kRun, 1},
                  destination_strides[] = {kRun + 64, 1};  // padded rows: runs, not one block
    const int64_t streamed = detail::strided_copy_streamed_runs();
    EXPECT_EQ(detail::strided_copy(destination.data(), destination_strides, source.data(),
                                   source_strides, shape, 2, 1),
              count);
    const bool large = detail::strided_copy_stream_span() > 0 && count == runs;
    EXPECT_EQ(detail::strided_copy_streamed_runs() - streamed, large ? count : 0) << count;
    for (int64_t r = 0; r < count; r += 997) {
      EXPECT_TRUE(std::equal(source.begin() + r * kRun, source.begin() + (r + 1) * kRun,
                             destination.begin() + r * (kRun + 64)))
          << "run " << r;
      EXPECT_EQ(destination[static_cast<size_t>(r * (kRun + 64) + kRun)], 0) << "run " << r;
    }
  }
}

TEST(Array, AssignSliceWritesARangeWithoutAllocating) {
  const auto a = Array::zeros(DType::f32, {2, 5});
  const auto part = Array::from_floats(std::vector<float>{1, 2, 3, 4}, {2, 2});
  const int64_t allocations = allocation_count();
  a.assign_slice(1, 3, part);
  EXPECT_EQ(allocation_count(), allocations);
  EXPECT_EQ(a.to_floats(), (std::vector<float>{0, 0, 0, 1, 2, 0, 0, 0, 3, 4}));
  EXPECT_TRUE(
      testing::throws_error([&] { a.assign_slice(1, 4, part); }, {"Array::assign_slice", "at 4"}));
  EXPECT_TRUE(testing::throws_error([&] { a.assign_slice(0, 0, part.astype(DType::f16)); },
                                    {"Array::assign_slice"}));
  // A start near INT64_MAX: start + length overflows, which must not pass the check (it wrote
  // before the buffer).
  const int64_t far = std::numeric_limits<int64_t>::max();
  EXPECT_TRUE(testing::throws_error([&] { a.assign_slice(1, far, part); },
                                    {"Array::assign_slice", "at 9223372036854775807"}));
  EXPECT_TRUE(
      testing::throws_error([&] { a.assign_slice(1, far - 1, part); }, {"Array::assign_slice"}));
  EXPECT_EQ(a.to_floats(), (std::vector<float>{0, 0, 0, 1, 2, 0, 0, 0, 3, 4}));
}

// Floats have no single right rounding to integers: from_floats refuses i32, as astype does
// (NaN or 3e9 converted to int32 was undefined behaviour).
TEST(Array, FromFloatsRefusesI32) {
  const std::vector<float> values{std::nanf(""), 3e9F};
  EXPECT_TRUE(testing::throws_error([&] { (void)Array::from_floats(values, {2}, DType::i32); },
                                    {"Array::from_floats", "i32", "from_ints"}));
}

TEST(Array, OverlappingShiftInsideOneBufferIsExact) {
  // Moving tokens to the front of each head's region (as a window cache does) overlaps within
  // each run; the copy must behave like memmove.
  const auto a = Array::from_floats(iota(2 * 10), {2, 10});
  a.slice(1, 0, 7).assign(a.slice(1, 3, 10));
  EXPECT_EQ(a.slice(1, 0, 7).to_floats(),
            (std::vector<float>{3, 4, 5, 6, 7, 8, 9, 13, 14, 15, 16, 17, 18, 19}));
}

TEST(Array, TransposeAndReshapeAreViews) {
  const auto a = Array::from_floats(iota(6), {2, 3});
  const auto t = a.transpose(0, 1);
  EXPECT_TRUE(t.shares_storage(a));
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_EQ(t.to_floats(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(t.contiguous().to_floats(), t.to_floats());
  const auto r = a.reshape({3, 2});
  EXPECT_TRUE(r.shares_storage(a));
  EXPECT_EQ(r.to_floats(), a.to_floats());
}

TEST(Array, AstypeConvertsStridedViews) {
  const auto a = Array::from_floats(std::vector<float>{0.1f, 0.2f, 0.3f, 0.4f}, {2, 2});
  const auto half = a.slice(1, 1, 2).astype(DType::f16);
  EXPECT_EQ(half.dtype(), DType::f16);
  EXPECT_EQ(half.to_floats(), (std::vector<float>{f16_to_float(float_to_f16(0.2f)),
                                                  f16_to_float(float_to_f16(0.4f))}));
  const auto back = half.astype(DType::f32);
  EXPECT_EQ(back.to_floats(), half.to_floats());
  const auto ints = Array::from_ints(std::vector<int32_t>{1, -7}, {2}).astype(DType::f32);
  EXPECT_EQ(ints.to_floats(), (std::vector<float>{1, -7}));
}

TEST(ArrayErrors, SliceOutOfRangeNamesCallAndValues) {
  const auto a = Array::zeros(DType::f32, {2, 8});
  EXPECT_TRUE(throws_error([&] { (void)a.slice(1, 3, 9); }, {"Array::slice", "[3, 9)", "[2, 8]"}));
  EXPECT_TRUE(throws_error([&] { (void)a.slice(1, 5, 4); }, {"Array::slice", "[5, 4)"}));
  EXPECT_TRUE(throws_error([&] { (void)a.slice(0, -1, 1); }, {"Array::slice"}));
}

TEST(ArrayErrors, AxisOutOfRange) {
  const auto a = Array::zeros(DType::f32, {2, 8});
  EXPECT_TRUE(throws_error([&] { (void)a.dim(2); }, {"Array::dim", "axis 2", "2-d"}));
  EXPECT_TRUE(throws_error([&] { (void)a.dim(-3); }, {"axis -3"}));
  EXPECT_TRUE(throws_error([&] { (void)a.slice(5, 0, 1); }, {"Array::slice", "axis 5"}));
  EXPECT_TRUE(throws_error([&] { (void)a.transpose(0, 2); }, {"Array::transpose"}));
}

TEST(ArrayErrors, ShapeMismatches) {
  const std::vector<float> five(5);
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Array::from_floats(five, {2, 3});
      },
      {"Array::from_floats", "5 values", "[2, 3]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Array::zeros(DType::f32, {1, 1, 1, 1, 1});
      },
      {"Array::zeros", "5 axes"}));
  EXPECT_TRUE(throws_error([&] { (void)Array::zeros(DType::f32, {2, -1}); }, {"negative"}));
  const auto a = Array::zeros(DType::f32, {2, 4});
  EXPECT_TRUE(throws_error(
      [&] {
        a.slice(1, 0, 2).assign(Array::zeros(DType::f32, {2, 3}));
      },
      {"Array::assign", "f32[2, 3]", "f32[2, 2]"}));
  EXPECT_TRUE(throws_error([&] { (void)a.reshape({3, 3}); }, {"Array::reshape", "[3, 3]"}));
  EXPECT_TRUE(throws_error([&] { (void)a.slice(1, 0, 2).reshape({4}); }, {"strided view"}));
}

TEST(ArrayErrors, WrongDtype) {
  const auto a = Array::zeros(DType::f16, {2, 4});
  EXPECT_TRUE(throws_error(
      [&] {
        a.assign(Array::zeros(DType::f32, {2, 4}));
      },
      {"Array::assign", "f32[2, 4]", "f16[2, 4]"}));
  EXPECT_TRUE(throws_error([&] { (void)a.data<float>(); }, {"Array::data", "f16[2, 4]"}));
  EXPECT_TRUE(throws_error([&] { (void)a.to_ints(); }, {"Array::to_ints", "not i32"}));
  EXPECT_TRUE(throws_error([&] { (void)a.astype(DType::i32); }, {"Array::astype"}));
}

TEST(ArrayErrors, FailedCallsLeaveTheArrayUnchanged) {
  const auto a = Array::from_floats(iota(8), {2, 4});
  const auto before = a.to_floats();
  EXPECT_THROW(a.assign(Array::zeros(DType::f32, {4, 2})), Error);
  EXPECT_THROW((void)a.slice(0, 0, 3), Error);
  EXPECT_EQ(a.to_floats(), before);
  EXPECT_EQ(a.shape(), (Shape{2, 4}));
}

}  // namespace
}  // namespace kvsnap
