// Promises of the array layer's headers that no other test checks: buffers are 64-byte aligned
// (allocator.h), a Shape refuses a ninth extent (shape.h), Array::wrap's release runs on the
// thread that drops the last Array naming the memory (array.h), and to_dlpack refuses an empty
// array (dlpack.h).
#include <gtest/gtest.h>
#include <kvsnap/allocator.h>
#include <kvsnap/array.h>
#include <kvsnap/dlpack.h>
#include <kvsnap/shape.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/test_support.h"

namespace kvsnap::array_contract_gaps_test {
namespace {

using testing::throws_error;

bool aligned(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % Allocator::kAlignment == 0;
}

static_assert(Allocator::kAlignment == 64);

// Element counts from a few bytes to past the pooled (64 KiB) and huge-page (2 MiB) sizes.
constexpr int64_t kCounts[] = {1, 3, 17, 33, 1000, 16385, 40000, (int64_t{2} << 20) / 2 + 5};
constexpr DType kDTypes[] = {DType::f32, DType::f16, DType::bf16, DType::i32};

// Every way an Array gets a fresh buffer: zeros, uninitialized, from_floats / from_ints, a compact
// copy of a view (contiguous, clone) and a conversion (astype) — of several sizes and dtypes.
TEST(AllocatorAlignment, EveryArrayBufferIs64ByteAligned) {
  for (const DType dtype : kDTypes) {
    for (const int64_t count : kCounts) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " x " + std::to_string(count));
      const Array zeros = Array::zeros(dtype, {count});
      EXPECT_TRUE(aligned(zeros.bytes()));
      const Array blank = Array::uninitialized(dtype, {1, count});
      EXPECT_TRUE(aligned(blank.bytes()));
      Array filled;
      if (dtype == DType::i32) {
        filled = Array::from_ints(std::vector<int32_t>(static_cast<size_t>(count), 7), {count});
      } else {
        filled = Array::from_floats(std::vector<float>(static_cast<size_t>(count), 0.5f), {count},
                                    dtype);
      }
      EXPECT_TRUE(aligned(filled.bytes()));
      if (count > 1) {  // a view that starts one element in, copied compact
        const Array view = filled.slice(0, 1, count);
        EXPECT_FALSE(aligned(view.bytes()));  // the view itself is not: the copy must be made so
        EXPECT_TRUE(aligned(view.contiguous().bytes()));
        EXPECT_TRUE(aligned(view.clone().bytes()));
      }
      if (dtype != DType::i32) {
        const DType other = dtype == DType::f32 ? DType::f16 : DType::f32;
        EXPECT_TRUE(aligned(filled.astype(other).bytes()));
      }
    }
  }
}

// The allocator itself, for byte counts that are no multiple of anything, fresh and reused (a
// buffer released to the pool and taken again).
TEST(AllocatorAlignment, AllocateReturns64ByteAlignedBytesFreshOrReused) {
  Allocator& allocator = default_allocator();
  for (const int64_t bytes : {int64_t{1}, int64_t{7}, int64_t{63}, int64_t{65}, int64_t{4097},
                              kPooledBytes + 3, kHugePageBytes + 9}) {
    for (int round = 0; round < 2; ++round) {
      void* pointer = allocator.allocate(bytes);
      EXPECT_TRUE(aligned(pointer)) << bytes << " bytes, round " << round;
      allocator.deallocate(pointer, bytes);
    }
  }
}

// push_back, resize, insert and construction past kCapacity (8) extents throw kvsnap::Error; up
// to 8 they fit.
TEST(ShapeCapacity, GrowingAShapePastEightExtentsThrows) {
  Shape shape;
  for (int64_t i = 0; i < 8; ++i) shape.push_back(i + 1);
  EXPECT_EQ(shape.size(), 8U);
  EXPECT_TRUE(throws_error([&] { shape.push_back(9); }, {"Shape", "9 extents", "at most 8"}));
  EXPECT_EQ(shape.size(), 8U);  // unchanged
  EXPECT_EQ(shape.back(), 8);

  Shape resized{1, 2};
  EXPECT_NO_THROW(resized.resize(8));
  EXPECT_TRUE(throws_error([&] { resized.resize(9); }, {"Shape", "at most 8"}));

  Shape inserted{1, 2, 3, 4, 5, 6, 7};
  EXPECT_NO_THROW((void)inserted.insert(inserted.begin(), int64_t{0}));
  EXPECT_TRUE(
      throws_error([&] { (void)inserted.insert(inserted.end(), int64_t{9}); }, {"at most 8"}));

  EXPECT_TRUE(throws_error([] { const Shape nine{1, 2, 3, 4, 5, 6, 7, 8, 9}; }, {"at most 8"}));
  const std::vector<int64_t> ten(10, 1);
  EXPECT_TRUE(throws_error([&] { const Shape from_vector(ten); }, {"at most 8"}));
  EXPECT_TRUE(throws_error([] { const Shape counted(9, 1); }, {"at most 8"}));
}

// The last Array naming wrapped memory (here a view of it) is dropped on another thread: the
// release runs there, once — not on the thread that wrapped it, nor on one that dropped an
// earlier copy.
TEST(ArrayWrap, ReleaseRunsOnTheThreadThatDropsTheLastArray) {
  std::vector<float> memory(12, 1.0f);
  std::atomic<int> releases{0};
  std::thread::id released_on;
  Array wrapped = Array::wrap(memory.data(), DType::f32, {3, 4}, {}, [&] {
    released_on = std::this_thread::get_id();
    ++releases;
  });
  Array view = wrapped.slice(0, 1, 3);
  wrapped = Array();  // the creating thread drops its handle: a view still names the memory
  EXPECT_EQ(releases.load(), 0);
  std::thread::id dropper;
  std::thread worker([&, last = std::move(view)]() mutable {
    dropper = std::this_thread::get_id();
    EXPECT_EQ(last.to_floats().size(), 8U);
    last = Array();  // the last Array goes here
    EXPECT_EQ(releases.load(), 1);
  });
  worker.join();
  EXPECT_EQ(releases.load(), 1);
  EXPECT_EQ(released_on, dropper);
  EXPECT_NE(released_on, std::this_thread::get_id());
}

// Copies on two threads: whichever drops the last one runs the release, on itself.
TEST(ArrayWrap, ReleaseRunsOnWhicheverThreadDropsLast) {
  std::vector<float> memory(4, 2.0f);
  std::atomic<int> releases{0};
  std::thread::id released_on;
  Array wrapped = Array::wrap(memory.data(), DType::f32, {4}, {}, [&] {
    released_on = std::this_thread::get_id();
    ++releases;
  });
  std::thread::id worker_id;
  std::thread worker([&, copy = wrapped]() mutable {
    worker_id = std::this_thread::get_id();
    copy = Array();  // not the last: the main thread still holds one
  });
  worker.join();
  EXPECT_EQ(releases.load(), 0);
  wrapped = Array();  // the last, on this thread
  EXPECT_EQ(releases.load(), 1);
  EXPECT_EQ(released_on, std::this_thread::get_id());
  EXPECT_NE(released_on, worker_id);
}

TEST(DLPackExport, ToDlpackThrowsForAnEmptyArray) {
  const Array empty;
  ASSERT_TRUE(empty.empty());
  EXPECT_TRUE(throws_error([&] { (void)to_dlpack(empty); }, {"to_dlpack", "empty"}));
}

}  // namespace
}  // namespace kvsnap::array_contract_gaps_test
