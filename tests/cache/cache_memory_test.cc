// Caches destroyed or reset while memory runs out: lazy snapshots that outlive their cache get
// its buffers instead of copies, nothing throws from a destructor, and every snapshot still
// restores what it named.
#include <gtest/gtest.h>
#include <kvsnap/kv_cache.h>
#include <kvsnap/paged_kv_cache.h>
#include <kvsnap/recurrent_cache.h>
#include <kvsnap/rotating_kv_cache.h>

#include <memory>
#include <vector>

#include "support/cache_support.h"
#include "support/memory_limit.h"

namespace kvsnap::cache_memory_test {
namespace {

using testing::column_ids;
using testing::id_range;
using testing::kAddressSanitizer;
using testing::lift_memory_limit;
using testing::run_with_headroom;
using testing::TokenKV;
using testing::write;

// Wide tokens (16 heads x 256 f32 keys and values: 32 KiB a token): copying out 128 of them
// takes 4 MiB, far more than the 1 MiB headroom the tests leave.
const TokenKV wide{.heads = 16, .depth = 256};
constexpr int64_t kHeadroom = int64_t(1) << 20;
constexpr const char* kStatus =
    "-1: the process died (std::terminate from a destructor); 1: the snapshot lost tokens; 2: "
    "the limit did not bite (the snapshot was copied out)";

// Whether `cache` holds exactly the keys and values of tokens `ids` (bit for bit).
bool holds(const Attention& cache, const std::vector<int64_t>& ids) {
  const KVHistory history = cache.view(Batch{}).contiguous();
  return history.keys().to_floats() == wide.keys(ids).to_floats() &&
         history.values().to_floats() == wide.values(ids).to_floats();
}

// A KVCache destroyed while it cannot allocate the copy of a lazy snapshot's columns leaves the
// snapshot its buffers: no std::terminate, and the snapshot restores all it named. Its other
// piece (partly copied out by a write, with storage of its own) is completed in that storage.
TEST(CacheMemory, KVCacheDestroyedOutOfMemoryLeavesLazySnapshotsItsBuffers) {
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer ignores RLIMIT_AS";
  auto cache = std::make_unique<KVCache>();
  write(*cache, wide, id_range(0, 256));
  SnapshotPtr s = cache->snapshot(0);
  ASSERT_TRUE(cache->restore(nullptr, 128));
  write(*cache, wide, id_range(1000, 1));  // copies column 128 of `s` out: a piece with storage
  const int status = run_with_headroom(kHeadroom, [&] {
    const int64_t allocations = allocation_count();
    cache.reset();  // [0, 128) of `s`: 4 MiB to copy
    lift_memory_limit();
    if (allocation_count() != allocations) return 2;
    if (s->is_lazy()) return 1;
    KVCache other;
    if (!other.restore(s.get(), 256)) return 1;
    return holds(other, id_range(0, 256)) ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << kStatus;
}

// The same for a reset, which frees the buffers as a destruction does: it succeeds.
TEST(CacheMemory, KVCacheResetOutOfMemorySucceeds) {
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer ignores RLIMIT_AS";
  KVCache cache;
  write(cache, wide, id_range(0, 200));
  SnapshotPtr s = cache.snapshot(0);
  const int status = run_with_headroom(kHeadroom, [&] {
    const int64_t allocations = allocation_count();
    cache.reset();
    lift_memory_limit();
    if (allocation_count() != allocations) return 2;
    if (cache.offset() != 0 || s->is_lazy() || s->size() != 200 * 32 * 1024) return 1;
    KVCache other;
    return other.restore(s.get(), 200) && holds(other, id_range(0, 200)) ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << kStatus;
}

// A RotatingKVCache's window, lazy in its ring, outlives the cache the same way.
TEST(CacheMemory, RotatingKVCacheDestroyedOutOfMemoryLeavesWindowsItsBuffers) {
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer ignores RLIMIT_AS";
  auto cache = std::make_unique<RotatingKVCache>(256);
  write(*cache, wide, id_range(0, 200));
  SnapshotPtr s = cache->snapshot(0);
  const int status = run_with_headroom(kHeadroom, [&] {
    const int64_t allocations = allocation_count();
    cache.reset();
    lift_memory_limit();
    if (allocation_count() != allocations) return 2;
    if (s->is_lazy()) return 1;
    RotatingKVCache other(256);
    return other.restore(s.get(), 200) && holds(other, id_range(0, 200)) ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << kStatus;
}

// A paged snapshot outliving its cache holds the blocks (nothing to copy) and restores them.
// (That releasing blocks allocates nothing at all: allocation_test.)
TEST(CacheMemory, PagedKVCacheDestroyedOutOfMemoryKeepsSnapshotsWhole) {
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer ignores RLIMIT_AS";
  auto cache = std::make_unique<PagedKVCache>(PagedKVCache::Options{.block_tokens = 64});
  write(*cache, wide, id_range(0, 200));
  SnapshotPtr s = cache->snapshot(0);
  const int status = run_with_headroom(kHeadroom, [&] {
    cache.reset();
    lift_memory_limit();
    PagedKVCache other({.block_tokens = 64});
    return other.restore(s.get(), 200) && holds(other, id_range(0, 200)) ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << kStatus;
}

// Recurrent snapshots share the cache's immutable states: destroying the cache copies nothing.
TEST(CacheMemory, RecurrentCacheDestroyedOutOfMemoryKeepsSnapshotsWhole) {
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer ignores RLIMIT_AS";
  const RecurrentCache::Dims dims{.conv_tail = 3,
                                  .conv_dim = 256,
                                  .num_v_heads = 16,
                                  .head_v_dim = 64,
                                  .head_k_dim = 64};  // 256 KiB of delta state
  auto cache = std::make_unique<RecurrentCache>(dims);
  const Batch batch = Batch::uniform(1, 4, 0);
  const RecurrentHistory state = cache->get(batch, DType::f32);
  const auto filled = [](const Array& like, float value) {
    const std::vector<float> values(static_cast<size_t>(like.nbytes() / 4), value);
    return Array::from_floats(values, like.shape());
  };
  const Array conv = filled(state.conv_state(), 2.0f);
  const Array delta = filled(state.delta_state(), 3.0f);
  cache->put(batch, std::vector<Array>{conv}, std::vector<Array>{delta});
  SnapshotPtr s = cache->snapshot(0);
  const int status = run_with_headroom(kHeadroom, [&] {
    cache.reset();
    lift_memory_limit();
    RecurrentCache other(dims);
    if (!other.restore(s.get(), 4)) return 1;
    const std::vector<Array> restored = other.state();
    return restored.size() == 2 && restored[1].to_floats() == delta.to_floats() ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << kStatus;
}

}  // namespace
}  // namespace kvsnap::cache_memory_test
