// PagedKVCache running out of memory one allocation at a time (oom_test: see
// support/failing_allocation.h).
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <string>
#include <vector>

#include "support/cache_support.h"
#include "support/failing_allocation.h"

namespace kvsnap::paged_oom_test {
namespace {

using testing::armed_call;
using testing::id_range;
using testing::TokenKV;

void write(PagedKVCache& cache, const TokenKV& kv, int32_t seq, const std::vector<int64_t>& ids) {
  Batch batch = Batch::uniform(1, static_cast<int64_t>(ids.size()), cache.offset(seq));
  batch.seq_ids = {seq};
  (void)cache.update(batch, kv.keys(ids), kv.values(ids));
}

std::vector<int64_t> held(const PagedKVCache& cache, SeqId seq) {
  Batch batch = Batch::uniform(1, 1, 0);
  batch.seq_ids = {seq};
  return testing::column_ids(cache.view(batch));
}

// A range of sequence 0 that ends mid-block, then one of sequence 1 (other tokens) from there:
// merged, they meet in a fresh block (BlockPool::meet). A merge that runs out of memory anywhere
// — after that block was taken included — gives every block back: the pool then holds exactly
// what the sequences hold.
TEST(PagedOutOfMemory, AMergeThatRunsOutGivesItsBlocksBack) {
  const TokenKV kv;
  int64_t failures = 0;
  for (int64_t n = 1;; ++n) {
    SCOPED_TRACE("allocation " + std::to_string(n) + " fails");
    PagedKVCache cache({.block_tokens = 4});
    write(cache, kv, 0, id_range(0, 10));
    write(cache, kv, 1, id_range(100, 10));
    const int64_t held = cache.pool_stats().blocks_in_use;
    SnapshotPtr parent = cache.split(cache.snapshot(0, 0), 6).first;
    SnapshotPtr child = cache.snapshot(1, 6);
    const int64_t copied = cache.pool_stats().blocks_copied;
    SnapshotPtr joined;
    testing::start_run(n);
    const bool done =
        armed_call([&] { joined = cache.merge(std::move(parent), std::move(child)); });
    const bool failed = testing::failed_in_run();
    if (!done) {
      ++failures;
      EXPECT_EQ(cache.pool_stats().blocks_in_use, held);
      continue;
    }
    ASSERT_FALSE(failed);  // a merge swallows no failure
    EXPECT_EQ(joined->from(), 0);
    EXPECT_EQ(joined->to(), 10);
    EXPECT_EQ(cache.pool_stats().blocks_copied, copied + 1);  // the fresh block where they meet
    EXPECT_EQ(cache.pool_stats().blocks_in_use, held + 1);
    joined.reset();
    EXPECT_EQ(cache.pool_stats().blocks_in_use, held);
    break;
  }
  EXPECT_GE(failures, 2);
}

// A restore of a KVCache's snapshot writes its tokens into new blocks. When the pool cannot grow
// for them, the sequence keeps every token it held (the blocks are taken before the rewind).
TEST(PagedOutOfMemory, ARestoreOfAnotherCachesSnapshotThatRunsOutLeavesTheSequence) {
  const TokenKV kv;
  KVCache other;
  (void)testing::write(other, kv, id_range(500, 400));
  const SnapshotPtr tail = other.split(other.snapshot(0), 240).second;  // [240, 400)
  int64_t failures = 0;
  for (int64_t n = 1;; ++n) {
    SCOPED_TRACE("allocation " + std::to_string(n) + " fails");
    PagedKVCache cache({.block_tokens = 4});
    write(cache, kv, 0, id_range(0, 256));  // the pool's first chunk, every block of it
    testing::start_run(n);
    const bool done = armed_call([&] { (void)cache.restore(0, tail.get(), 400); });
    if (!done) {
      ++failures;
      ASSERT_EQ(cache.offset(0), 256);
      EXPECT_EQ(held(cache, 0), id_range(0, 256));
      continue;
    }
    EXPECT_EQ(held(cache, 0), testing::concat_ids(id_range(0, 240), id_range(740, 160)));
    break;
  }
  EXPECT_GE(failures, 1);
}

// A reset cache keeps its blocks for the next writes. A write of two rows that needs more, and
// runs out of memory, leaves them kept (of the layout the write brings too): only what it took is
// given back.
TEST(PagedOutOfMemory, AWriteThatRunsOutKeepsTheBlocksAResetKept) {
  const TokenKV kv;
  const std::vector<int64_t> ids = id_range(0, 200);
  int64_t failures = 0;
  for (int64_t n = 1;; ++n) {
    SCOPED_TRACE("allocation " + std::to_string(n) + " fails");
    PagedKVCache cache({.block_tokens = 4});
    write(cache, kv, 0, id_range(0, 256));  // the pool's first chunk, every block of it
    cache.reset();
    const int64_t kept = cache.pool_stats().blocks;
    ASSERT_GT(kept, 0);
    testing::start_run(n);
    const bool done = armed_call(
        [&] { (void)cache.update(Batch::uniform(2, 200, 0), kv.keys(ids, 2), kv.values(ids, 2)); });
    if (!done) {
      ++failures;
      EXPECT_GE(cache.pool_stats().blocks, kept);
      for (const SeqId seq : {0, 1}) {  // a bad_alloc past the blocks may leave a row written
        EXPECT_TRUE(cache.offset(seq) == 0 || held(cache, seq) == ids) << seq;
      }
      continue;
    }
    EXPECT_EQ(held(cache, 1), ids);
    break;
  }
  EXPECT_GE(failures, 1);
}

}  // namespace
}  // namespace kvsnap::paged_oom_test
