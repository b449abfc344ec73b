// The default allocator's pool: large released buffers are reused warm, the pool is bounded
// and trimmed, and live_bytes() counts only live arrays throughout.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <chrono>
#include <thread>

#include "support/test_support.h"

namespace kvsnap {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kPooling = false;
#else
constexpr bool kPooling = true;
#endif

class Pool : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kPooling) GTEST_SKIP() << "AddressSanitizer builds do not pool";
    saved_ = pool_options();
    trim_pool();
  }
  void TearDown() override {
    if (!kPooling) return;
    set_pool_options(saved_);
    trim_pool();
  }
  PoolOptions saved_;
};

const Shape kMiB{256 << 10};  // f32: 1 MiB

TEST_F(Pool, AReleasedLargeBufferIsReusedForTheNextOfItsSize) {
  const int64_t live = live_bytes();
  const void* first = nullptr;
  {
    const Array a = Array::uninitialized(DType::f32, kMiB);
    first = a.bytes();
  }
  EXPECT_EQ(live_bytes(), live);     // pooled bytes are not live
  EXPECT_EQ(pool_bytes(), 1 << 20);  // 1 MiB is a size class of its own
  const Array b = Array::uninitialized(DType::f32, Shape{(256 << 10) - 100});  // same class
  EXPECT_EQ(b.bytes(), first);
  EXPECT_EQ(pool_bytes(), 0);
  EXPECT_EQ(live_bytes(), live + b.nbytes());
}

TEST_F(Pool, SmallBuffersAreNotPooled) {
  { const Array a = Array::zeros(DType::f32, {kPooledBytes / 8}); }
  EXPECT_EQ(pool_bytes(), 0);
}

TEST_F(Pool, ThePoolNeverHoldsMoreThanItsBound) {
  set_pool_options({.max_bytes = 3 << 20, .idle_seconds = 60});
  {
    std::vector<Array> arrays;
    for (int i = 0; i < 8; ++i) arrays.push_back(Array::uninitialized(DType::f32, kMiB));
  }
  EXPECT_EQ(pool_bytes(), 3 << 20);  // the three released last are kept
  set_pool_options({.max_bytes = 0, .idle_seconds = 60});
  EXPECT_EQ(pool_bytes(), 0);  // a lower bound applies at once
  { const Array a = Array::uninitialized(DType::f32, kMiB); }
  EXPECT_EQ(pool_bytes(), 0);  // pooling off
}

TEST_F(Pool, IdleBuffersAreReturnedToTheSystem) {
  set_pool_options({.max_bytes = 64 << 20, .idle_seconds = 0.05});
  { const Array a = Array::uninitialized(DType::f32, kMiB); }
  EXPECT_EQ(pool_bytes(), 1 << 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  {  // any later call trims: the 1 MiB buffer goes back, this 2 MiB one is pooled
    const Array other = Array::uninitialized(DType::f32, Shape{512 << 10});
  }
  EXPECT_EQ(pool_bytes(), 2 << 20);
  trim_pool();
  EXPECT_EQ(pool_bytes(), 0);
}

// Sizes no machine can map fail at once with bad_alloc, and shapes whose byte count would
// overflow are refused with an Error naming them.
TEST_F(Pool, ImpossibleSizesFailInsteadOfHanging) {
  const int64_t live = live_bytes();
  for (const int64_t elements : {int64_t{1} << 58, int64_t{1} << 60}) {
    EXPECT_THROW((void)Array::zeros(DType::f32, {elements}), std::bad_alloc) << elements;
  }
  for (const Shape& shape : {Shape{(int64_t{1} << 60) + 1}, Shape{int64_t{1} << 62, 4},
                             Shape{int64_t{1} << 40, int64_t{1} << 40}}) {
    EXPECT_TRUE(testing::throws_error([&] { (void)Array::zeros(DType::f32, shape); },
                                      {"Array::", "more than 2^60 elements"}));
  }
  EXPECT_NO_THROW((void)Array::zeros(DType::f32, {0, int64_t{1} << 62, int64_t{1} << 62}));
  EXPECT_EQ(live_bytes(), live);
}

}  // namespace
}  // namespace kvsnap
