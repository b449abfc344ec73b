// The default allocator's pool: large released buffers are reused warm, the pool is bounded
// and trimmed, and live_bytes() counts only live arrays throughout.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "array/sanitizers.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

#if defined(KVSNAP_ADDRESS_SANITIZER)
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

// New limits apply to what the pool holds: a higher bound keeps every buffer (it emptied the
// pool), a shorter idle time returns the buffers idle past it.
TEST_F(Pool, NewLimitsApplyToWhatThePoolHolds) {
  set_pool_options({.max_bytes = 4 << 20, .idle_seconds = 60});
  { const Array a = Array::uninitialized(DType::f32, kMiB); }
  set_pool_options({.max_bytes = 64 << 20, .idle_seconds = 60});
  EXPECT_EQ(pool_bytes(), 1 << 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  { const Array b = Array::uninitialized(DType::f32, Shape{512 << 10}); }  // released just now
  EXPECT_EQ(pool_bytes(), 3 << 20);
  set_pool_options({.max_bytes = 64 << 20, .idle_seconds = 0.1});
  EXPECT_EQ(pool_bytes(), 2 << 20);  // the 1 MiB buffer was idle for 150 ms
}

// A negative or NaN setting is refused, changing nothing; an infinite idle time means never
// (converting it to the clock's ticks overflowed).
TEST_F(Pool, OptionsAreChecked) {
  set_pool_options({.max_bytes = 3 << 20, .idle_seconds = 60});
  for (const PoolOptions& bad : {PoolOptions{.max_bytes = -1}, PoolOptions{.idle_seconds = -1},
                                 PoolOptions{.idle_seconds = std::nan("")}}) {
    EXPECT_TRUE(testing::throws_error([&] { set_pool_options(bad); },
                                      {"set_pool_options", "must be >= 0"}));
  }
  EXPECT_EQ(pool_options().max_bytes, 3 << 20);
  set_pool_options({.max_bytes = 64 << 20, .idle_seconds = HUGE_VAL});
  { const Array a = Array::uninitialized(DType::f32, kMiB); }
  { const Array b = Array::uninitialized(DType::f32, Shape{512 << 10}); }  // trims nothing
  EXPECT_EQ(pool_bytes(), 3 << 20);
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

// The kernel's transparent huge page mode for this process: "always", "madvise", "never", or ""
// where it has none; "never" too when the process may not have them (prctl PR_SET_THP_DISABLE,
// e.g. inherited from a container's runtime).
std::string huge_page_mode() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("THP_enabled:", 0) == 0 && line.find('0') != std::string::npos) return "never";
  }
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(file, line);
  const size_t open = line.find('['), close = line.find(']');
  return open == std::string::npos || close == std::string::npos
             ? ""
             : line.substr(open + 1, close - open - 1);
}

// Kilobytes of the mapping holding `at` that the kernel backs with huge pages (smaps), or -1 when
// no mapping holds it.
int64_t huge_kilobytes_at(const void* at) {
  std::ifstream smaps("/proc/self/smaps");
  const auto address = reinterpret_cast<uintptr_t>(at);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t from = 0, to = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> from >> dash >> to && dash == '-') {
      inside = from <= address && address < to;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      return std::stoll(line.substr(14));
    }
  }
  return -1;
}

// Buffers of kHugePageBytes and more start on a huge page, and where the kernel offers huge pages
// on request the whole huge pages of them are backed by huge pages (fewer TLB misses when a decode
// step streams them); with huge_pages off, a kernel that offers them only on request backs none.
TEST_F(Pool, LargeBuffersAreBackedByHugePagesWhereTheKernelOffersThem) {
  set_pool_options({.max_bytes = 0, .idle_seconds = 60, .huge_pages = true});
  const Array huge = Array::zeros(DType::f32, Shape{kHugePageBytes});  // 4 huge pages
  EXPECT_EQ(reinterpret_cast<uintptr_t>(huge.bytes()) % kHugePageBytes, 0u);
  const std::string mode = huge_page_mode();
  if (mode == "always" || mode == "madvise") {
    EXPECT_GT(huge_kilobytes_at(huge.bytes()), 0) << "THP mode " << mode;
  }
  set_pool_options({.max_bytes = 0, .idle_seconds = 60, .huge_pages = false});
  const Array plain = Array::zeros(DType::f32, Shape{kHugePageBytes});
  if (mode == "madvise") {
    EXPECT_EQ(huge_kilobytes_at(plain.bytes()), 0);
  }
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
  // An empty array's strides are its non-zero extents' products: they are held to 2^60 too.
  EXPECT_TRUE(testing::throws_error(
      [&] {
        (void)Array::zeros(DType::f32, {0, int64_t{1} << 40, int64_t{1} << 40});
      },
      {"Array::zeros", "more than 2^60 elements in its non-zero extents"}));
  const Array empty = Array::zeros(DType::f32, {0, int64_t{1} << 30, int64_t{1} << 30});
  EXPECT_EQ(empty.strides(), (Shape{int64_t{1} << 60, int64_t{1} << 30, 1}));
  EXPECT_EQ(live_bytes(), live);
}

}  // namespace
}  // namespace kvsnap
