#include <gtest/gtest.h>
#include <kvsnap/kv_cache.h>
#include <kvsnap/paged_kv_cache.h>
#include <kvsnap/rotating_kv_cache.h>

#include <functional>
#include <new>

#include "array/strided_copy.h"
#include "cache/snapshot_record.h"
#include "support/cache_support.h"
#include "support/memory_limit.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::column_ids;
using testing::id_range;
using testing::kAddressSanitizer;
using testing::run_with_headroom;
using testing::throws_error;
using testing::TokenKV;
using testing::write;

const TokenKV kv;
// Keys and values of one token: 2 heads x 4 f32 each.
constexpr int64_t kTokenBytes = 2 * (2 * 4 * 4);

// Ids of every token the cache holds, in position order.
std::vector<int64_t> held(const KVCache& cache) { return column_ids(cache.view(Batch{})); }

std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(KVCache, UpdateAppendsAndReturnsTheWholeHistory) {
  KVCache cache;
  auto history = write(cache, kv, id_range(100, 5));
  EXPECT_EQ(cache.offset(), 5);
  EXPECT_EQ(column_ids(history), id_range(100, 5));
  history = write(cache, kv, id_range(200, 3));
  EXPECT_EQ(cache.offset(), 8);
  EXPECT_EQ(column_ids(history), concat(id_range(100, 5), id_range(200, 3)));
  EXPECT_EQ(history.first_position(), 0);
  EXPECT_EQ(history.window(), 0);
  EXPECT_TRUE(testing::all_close(
      history.values(),
      [&] {
        Array v = Array::zeros(DType::f32, {1, 2, 8, 4});
        v.slice(2, 0, 5).assign(kv.values(id_range(100, 5)));
        v.slice(2, 5, 8).assign(kv.values(id_range(200, 3)));
        return v;
      }(),
      0.0f));
}

TEST(KVCache, HistoryIsAViewOfTheLiveBuffer) {
  KVCache cache;
  write(cache, kv, id_range(0, 4));
  const int64_t allocations = allocation_count();
  const auto history = cache.view(Batch{});
  EXPECT_EQ(allocation_count(), allocations);
  EXPECT_TRUE(history.keys().shares_storage(cache.state()[0]));
}

TEST(KVCache, PaddingColumnsAreNotStored) {
  KVCache cache;
  Batch batch = Batch::uniform(1, 4, 0);
  batch.seq_query_lens[0] = 2;
  cache.update(batch, kv.keys(id_range(0, 4)), kv.values(id_range(0, 4)));
  EXPECT_EQ(cache.offset(), 2);
  EXPECT_EQ(held(cache), id_range(0, 2));
}

TEST(KVCache, CapacityGrowsInStepsOfAtLeast256) {
  KVCache cache;
  write(cache, kv, id_range(0, 1));
  EXPECT_EQ(cache.capacity(), 256);
  write(cache, kv, id_range(1, 255));
  EXPECT_EQ(cache.capacity(), 256);
  write(cache, kv, id_range(256, 1));
  EXPECT_EQ(cache.capacity(), 512);
  write(cache, kv, id_range(257, 700));
  EXPECT_EQ(cache.capacity(), 1024);
  EXPECT_EQ(held(cache), id_range(0, 957));
}

TEST(KVCache, LongPrefillCopiesEachByteAtMostTwice) {
  // 128k tokens in 512-token chunks: growth is geometric, so bytes moved by growth never exceed
  // the bytes written, and copied / written <= 2.0.
  const TokenKV small{.heads = 1, .depth = 2};
  KVCache cache;
  const auto chunk_keys = small.keys(id_range(0, 512));
  const auto chunk_values = small.values(id_range(0, 512));
  for (int64_t i = 0; i < 256; ++i) {
    cache.update(Batch::uniform(1, 512, cache.offset()), chunk_keys, chunk_values);
  }
  const CopyStats stats = cache.copy_stats();
  EXPECT_EQ(stats.appended_bytes, 131072 * 16);
  const double ratio =
      static_cast<double>(stats.appended_bytes + stats.growth_bytes) / stats.appended_bytes;
  EXPECT_LE(ratio, 2.0);
  EXPECT_GT(ratio, 1.0);  // growth did happen: the bound is not vacuous
}

// Writes into a history larger than the last-level cache bypass it (streaming stores): attention
// reads such a history from its first column on, pushing the new columns out of the cache before
// it reaches them. Into a smaller history they are ordinary stores. Either way they land.
TEST(KVCache, WritesIntoAHistoryPastTheLastLevelCacheStream) {
  const int64_t span = detail::strided_copy_stream_span();
  if (span == 0) GTEST_SKIP() << "this build never streams (a sanitizer's, or no SSE2)";
  const TokenKV layer{.heads = 2, .depth = 256};  // 4 KiB a token
  const int64_t past = span / 4096, chunk = 16;   // runs of 16 KiB a head
  KVCache cache;
  cache.reserve(past + chunk);  // no growth copy below
  const Array zeros = Array::zeros(DType::f32, {1, 2, past - chunk, 256});
  cache.update(Batch::uniform(1, past - chunk, 0), zeros, zeros);  // less than the cache: ordinary
  const auto streamed_by = [&](int64_t from) {
    (void)cache.restore(nullptr, from);
    const int64_t before = detail::strided_copy_streamed_runs();
    const std::vector<int64_t> ids = id_range(from, chunk);
    cache.update(Batch::uniform(1, chunk, from), layer.keys(ids), layer.values(ids));
    const std::vector<int64_t> all = held(cache);
    EXPECT_EQ(std::vector<int64_t>(all.end() - chunk, all.end()), ids);
    return detail::strided_copy_streamed_runs() - before;
  };
  EXPECT_EQ(streamed_by(past - chunk), 0);  // the history before it: a chunk short of the cache
  EXPECT_EQ(streamed_by(past), 4);          // keys and values, a run per head
}

TEST(KVCache, GrowthStaysLinearForAnyLength) {
  // Whatever the final length, geometric growth keeps copies below 3x the bytes written.
  for (int64_t chunks : {3, 17, 130, 333}) {
    KVCache cache;
    const TokenKV small{.heads = 1, .depth = 2};
    const auto k = small.keys(id_range(0, 100)), v = small.values(id_range(0, 100));
    for (int64_t i = 0; i < chunks; ++i) cache.update(Batch::uniform(1, 100, cache.offset()), k, v);
    const CopyStats stats = cache.copy_stats();
    EXPECT_LT(stats.growth_bytes, 2 * stats.appended_bytes) << chunks;
  }
}

TEST(KVCache, ReserveAvoidsGrowthCopies) {
  KVCache cache;
  cache.reserve(10000);
  for (int64_t i = 0; i < 20; ++i) write(cache, kv, id_range(i * 500, 500));
  EXPECT_EQ(cache.copy_stats().growth_bytes, 0);
  EXPECT_GE(cache.capacity(), 10000);
}

TEST(KVCache, SnapshotIsLazyAndAllocatesNothing) {
  KVCache cache;
  write(cache, kv, id_range(0, 10));
  const int64_t bytes = live_bytes();
  const int64_t allocations = allocation_count();
  SnapshotPtr s = cache.snapshot(3);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->size(), 0);
  EXPECT_TRUE(s->is_lazy());
  EXPECT_EQ(s->from(), 3);
  EXPECT_EQ(s->to(), 10);
  EXPECT_EQ(live_bytes(), bytes);
  EXPECT_EQ(allocation_count(), allocations);
}

TEST(KVCache, DecodeAppendAllocatesNoArrayStorage) {
  KVCache cache;
  write(cache, kv, id_range(0, 10));
  const auto k = kv.keys(id_range(10, 1)), v = kv.values(id_range(10, 1));
  Batch batch = Batch::uniform(1, 1, 0);
  const int64_t allocations = allocation_count();
  for (int i = 0; i < 100; ++i) {
    batch.seq_offsets[0] = static_cast<int32_t>(cache.offset());
    (void)cache.update(batch, k, v);
  }
  EXPECT_EQ(allocation_count(), allocations);  // within capacity: no buffer is allocated
  EXPECT_EQ(cache.copy_stats().growth_bytes, 0);
}

TEST(KVCache, SnapshotAtTheCurrentOffsetIsNull) {
  KVCache cache;
  EXPECT_EQ(cache.snapshot(0), nullptr);
  write(cache, kv, id_range(0, 4));
  EXPECT_EQ(cache.snapshot(4), nullptr);
}

TEST(KVCache, DataSurvivesSnapshotAndRestore) {
  KVCache cache;
  write(cache, kv, id_range(0, 6));
  SnapshotPtr s = cache.snapshot(0);
  ASSERT_TRUE(cache.restore(nullptr, 2));
  write(cache, kv, id_range(50, 7));  // overwrites slots 2..8: slots 2..5 are copied out first
  EXPECT_TRUE(s->is_lazy());          // slots 0, 1 are still its, in place
  EXPECT_EQ(cache.copy_stats().materialized_bytes, 4 * kTokenBytes);
  ASSERT_TRUE(cache.restore(s.get(), 6));
  EXPECT_EQ(cache.offset(), 6);
  EXPECT_EQ(held(cache), id_range(0, 6));
}

TEST(KVCache, AppendAfterRewindCopiesExactlyTheOverwrittenSlots) {
  KVCache cache;
  write(cache, kv, id_range(0, 8));
  SnapshotPtr s = cache.snapshot(4);  // [4, 8)
  int fired = 0;
  int64_t delta = 0;
  s->set_materialize_hook([&](int64_t d) {
    ++fired;
    delta = d;
  });
  ASSERT_TRUE(cache.restore(nullptr, 6));
  const int64_t bytes = live_bytes();
  write(cache, kv, id_range(90, 1));  // slot 6 lies in [4, 8): slot 6 alone is copied
  // [4, 6) stays lazy; storage is taken for [6, 8), the run the appends are overwriting.
  EXPECT_EQ(cache.copy_stats().materialized_bytes, kTokenBytes);
  EXPECT_TRUE(s->is_lazy());
  EXPECT_EQ(fired, 1);
  EXPECT_EQ(delta, 2 * kTokenBytes);
  EXPECT_EQ(s->size(), 2 * kTokenBytes);
  EXPECT_EQ(live_bytes() - bytes, 2 * kTokenBytes);
  write(cache, kv, id_range(91, 1));  // slot 7 goes into that storage: no new bytes, no hook
  EXPECT_EQ(cache.copy_stats().materialized_bytes, 2 * kTokenBytes);
  EXPECT_EQ(fired, 1);
  // It holds the bytes of [4, 8) as they were.
  KVCache other;
  write(other, kv, id_range(0, 4));
  ASSERT_TRUE(other.restore(s.get(), 8));
  EXPECT_EQ(held(other), id_range(0, 8));
}

TEST(KVCache, AppendAfterRewindLeavesDisjointSnapshotsLazy) {
  KVCache cache;
  write(cache, kv, id_range(0, 8));
  SnapshotPtr early = cache.snapshot(0);  // [0, 8) covers slot 7
  ASSERT_TRUE(cache.restore(nullptr, 8));
  write(cache, kv, id_range(8, 4));
  SnapshotPtr late = cache.snapshot(8);  // [8, 12)
  ASSERT_TRUE(cache.restore(nullptr, 8));
  SnapshotPtr first_half = cache.snapshot(0);  // [0, 8) again
  write(cache, kv, id_range(70, 2));           // slots 8, 9: only `late` overlaps
  EXPECT_EQ(early->size(), 0);
  EXPECT_EQ(first_half->size(), 0);
  EXPECT_EQ(late->size(), 4 * kTokenBytes);  // storage for [8, 12), slots 8, 9 copied
  EXPECT_EQ(cache.copy_stats().materialized_bytes, 2 * kTokenBytes);
}

TEST(KVCache, ResetMaterializesOutstandingSnapshots) {
  KVCache cache;
  write(cache, kv, id_range(0, 5));
  SnapshotPtr s = cache.snapshot(1);
  int fired = 0;
  s->set_materialize_hook([&](int64_t) { ++fired; });
  cache.reset();
  EXPECT_EQ(fired, 1);
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_FALSE(s->is_lazy());
  write(cache, kv, id_range(0, 1));
  ASSERT_TRUE(cache.restore(s.get(), 5));
  EXPECT_EQ(held(cache), id_range(0, 5));
}

TEST(KVCache, SnapshotsOutliveTheirCache) {
  SnapshotPtr s;
  int fired = 0;
  int64_t delta = 0;
  {
    KVCache cache;
    write(cache, kv, id_range(10, 6));
    s = cache.snapshot(0);
    EXPECT_EQ(s->size(), 0);
    s->set_materialize_hook([&](int64_t bytes) {
      ++fired;
      delta += bytes;
    });
  }
  // Once, with exactly the bytes it now owns, which size() reports: what a prefix cache's
  // budget counts.
  EXPECT_EQ(fired, 1);
  EXPECT_EQ(delta, 6 * kTokenBytes);
  EXPECT_EQ(s->size(), 6 * kTokenBytes);
  KVCache fresh;
  ASSERT_TRUE(fresh.restore(s.get(), 6));
  EXPECT_EQ(held(fresh), id_range(10, 6));
}

TEST(KVCache, DestroyingASnapshotDetachesIt) {
  KVCache cache;
  write(cache, kv, id_range(0, 6));
  SnapshotPtr s = cache.snapshot(0);
  s.reset();
  ASSERT_TRUE(cache.restore(nullptr, 0));
  write(cache, kv, id_range(40, 6));
  EXPECT_EQ(cache.copy_stats().materialized_bytes, 0);
}

TEST(KVCache, RestoreOwnLazySnapshotCopiesNothing) {
  KVCache cache;
  write(cache, kv, id_range(0, 10));
  SnapshotPtr s = cache.snapshot(4);
  ASSERT_TRUE(cache.restore(nullptr, 5));
  const CopyStats before = cache.copy_stats();
  const int64_t allocations = allocation_count();
  ASSERT_TRUE(cache.restore(s.get(), 10));
  EXPECT_EQ(cache.offset(), 10);
  EXPECT_EQ(cache.copy_stats().restored_bytes, before.restored_bytes);
  EXPECT_EQ(allocation_count(), allocations);
  EXPECT_TRUE(s->is_lazy());
  EXPECT_EQ(held(cache), id_range(0, 10));
}

TEST(KVCache, RestoreOwnedSnapshotRewindsToItsStartAndWrites) {
  KVCache source;
  write(source, kv, id_range(0, 3));
  write(source, kv, id_range(100, 4));
  SnapshotPtr s = source.snapshot(3);  // [3, 7) = ids 100..103
  KVCache cache;
  write(cache, kv, id_range(0, 5));  // same prefix [0, 3), then 2 other tokens
  ASSERT_TRUE(cache.restore(s.get(), 7));
  EXPECT_EQ(held(cache), concat(id_range(0, 3), id_range(100, 4)));
  EXPECT_EQ(cache.copy_stats().restored_bytes, 4 * 2 * 4 * 4 * 2);
}

TEST(KVCache, RestoreClampsToTheTarget) {
  KVCache cache;
  write(cache, kv, id_range(0, 8));
  SnapshotPtr s = cache.snapshot(2);
  KVCache other;
  write(other, kv, id_range(0, 2));
  ASSERT_TRUE(other.restore(s.get(), 5));  // writes only [2, 5)
  EXPECT_EQ(held(other), id_range(0, 5));
  EXPECT_EQ(other.copy_stats().restored_bytes, 3 * 2 * 4 * 4 * 2);
  ASSERT_TRUE(other.restore(s.get(), 1));  // before its start: a plain rewind
  EXPECT_EQ(held(other), id_range(0, 1));
}

TEST(KVCache, UnreachableTargetsReturnFalseAndChangeNothing) {
  KVCache cache;
  write(cache, kv, id_range(0, 8));
  SnapshotPtr s = cache.snapshot(4);  // [4, 8)
  ASSERT_TRUE(cache.restore(nullptr, 3));
  const auto ids = held(cache);
  EXPECT_FALSE(cache.restore(s.get(), 6));  // offset 3 < snapshot start 4: a gap
  EXPECT_FALSE(cache.restore(nullptr, 4));  // a live rewind cannot go forward
  EXPECT_FALSE(cache.restore(nullptr, -1));
  write(cache, kv, id_range(3, 1));
  EXPECT_FALSE(cache.restore(s.get(), 9));  // past the snapshot's end
  EXPECT_FALSE(cache.restore(s.get(), -1));
  EXPECT_EQ(cache.offset(), 4);
  EXPECT_EQ(held(cache), concat(ids, id_range(3, 1)));
}

TEST(KVCache, MergeOfLazySnapshotsIsArithmetic) {
  KVCache cache;
  write(cache, kv, id_range(0, 9));
  SnapshotPtr a = cache.snapshot(0);
  write(cache, kv, id_range(9, 3));
  SnapshotPtr b = cache.snapshot(9);  // [0, 9) + [9, 12), both lazy
  const int64_t bytes = live_bytes();
  const CopyStats before = cache.copy_stats();
  SnapshotPtr merged = cache.merge(std::move(a), std::move(b));
  EXPECT_EQ(live_bytes(), bytes);
  EXPECT_EQ(cache.copy_stats().snapshot_bytes, before.snapshot_bytes);
  ASSERT_NE(merged, nullptr);
  EXPECT_TRUE(merged->is_lazy());
  EXPECT_EQ(merged->from(), 0);
  EXPECT_EQ(merged->to(), 12);
  (void)cache.restore(nullptr, 0);
  write(cache, kv, id_range(70, 1));  // the merged range still copies what is overwritten
  EXPECT_EQ(cache.copy_stats().materialized_bytes, before.materialized_bytes + kTokenBytes);
  EXPECT_TRUE(merged->is_lazy());
  KVCache other;
  ASSERT_TRUE(other.restore(merged.get(), 12));
  EXPECT_EQ(held(other), id_range(0, 12));
}

TEST(KVCache, MergeOfOwnedSnapshotsMakesOneOwnedRange) {
  SnapshotPtr a, b;
  {
    KVCache cache;
    write(cache, kv, id_range(0, 3));
    a = cache.snapshot(0);
    write(cache, kv, id_range(3, 4));
    b = cache.snapshot(3);
  }  // both materialized
  KVCache cache;
  SnapshotPtr merged = cache.merge(std::move(a), std::move(b));
  ASSERT_NE(merged, nullptr);
  EXPECT_FALSE(merged->is_lazy());
  EXPECT_EQ(merged->size(), 7 * 2 * 4 * 4 * 2);
  ASSERT_TRUE(cache.restore(merged.get(), 7));
  EXPECT_EQ(held(cache), id_range(0, 7));
}

TEST(KVCache, MergeMixesLazyAndOwned) {
  KVCache cache;
  write(cache, kv, id_range(0, 4));
  SnapshotPtr a = cache.snapshot(0);
  (void)cache.restore(nullptr, 0);
  write(cache, kv, id_range(0, 4));  // materializes a (same data)
  write(cache, kv, id_range(4, 4));
  SnapshotPtr b = cache.snapshot(4);  // lazy
  const CopyStats before = cache.copy_stats();
  SnapshotPtr merged = cache.merge(std::move(a), std::move(b));
  EXPECT_TRUE(merged->is_lazy());              // [0, 4) owned, [4, 8) still lazy
  EXPECT_EQ(merged->size(), 4 * kTokenBytes);  // nothing was copied to join them
  EXPECT_EQ(cache.copy_stats().snapshot_bytes, before.snapshot_bytes);
  KVCache other;
  ASSERT_TRUE(other.restore(merged.get(), 8));
  EXPECT_EQ(held(other), id_range(0, 8));
}

TEST(KVCache, MergeWithNullGivesNull) {
  KVCache cache;
  write(cache, kv, id_range(0, 4));
  EXPECT_EQ(cache.merge(nullptr, cache.snapshot(0)), nullptr);
  EXPECT_EQ(cache.merge(cache.snapshot(0), nullptr), nullptr);
  EXPECT_EQ(cache.merge(nullptr, nullptr), nullptr);
}

TEST(KVCache, SplitOfALazySnapshotIsArithmetic) {
  KVCache cache;
  write(cache, kv, id_range(0, 10));
  const int64_t bytes = live_bytes();
  auto [before, after] = cache.split(cache.snapshot(2), 6);
  EXPECT_EQ(live_bytes(), bytes);
  EXPECT_TRUE(before->is_lazy());
  EXPECT_TRUE(after->is_lazy());
  EXPECT_EQ(before->from(), 2);
  EXPECT_EQ(before->to(), 6);
  EXPECT_EQ(after->from(), 6);
  EXPECT_EQ(after->to(), 10);
}

TEST(KVCache, SplitAtTheEdgesKeepsTheWhole) {
  KVCache cache;
  write(cache, kv, id_range(0, 10));
  auto [none_before, whole] = cache.split(cache.snapshot(2), 2);
  EXPECT_EQ(none_before, nullptr);
  EXPECT_EQ(whole->from(), 2);
  auto [whole_again, none_after] = cache.split(std::move(whole), 10);
  EXPECT_EQ(none_after, nullptr);
  EXPECT_EQ(whole_again->to(), 10);
  EXPECT_EQ(cache.split(nullptr, 3).first, nullptr);
}

// A range splits only at an offset in [from, to]: any other is refused, not clamped to the
// nearer end (the caller asked for a cut the range cannot have).
TEST(KVCache, SplitOutsideTheRangeIsRefused) {
  KVCache cache;
  write(cache, kv, id_range(0, 10));
  EXPECT_TRUE(throws_error([&] { (void)cache.split(cache.snapshot(2), 12); },
                           {"KVCache::split", "at 12", "[2, 10)"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.split(cache.snapshot(2), 1); },
                           {"KVCache::split", "at 1", "[2, 10)"}));
  PagedKVCache paged({.block_tokens = 4});
  write(paged, kv, id_range(0, 10));
  EXPECT_TRUE(throws_error([&] { (void)paged.split(paged.snapshot(2), 11); },
                           {"PagedKVCache::split", "at 11", "[2, 10)"}));
  EXPECT_TRUE(throws_error([&] { (void)paged.split(cache.snapshot(2), 0); },
                           {"PagedKVCache::split", "at 0", "[2, 10)"}));
  EXPECT_EQ(cache.offset(), 10);
  EXPECT_EQ(paged.offset(), 10);
}

TEST(KVCache, SplitThenMergeRoundTripsTheData) {
  for (bool owned : {false, true}) {
    KVCache cache;
    write(cache, kv, id_range(0, 3));
    write(cache, kv, id_range(30, 9));
    SnapshotPtr s = cache.snapshot(3);  // [3, 12)
    if (owned) {
      (void)cache.restore(nullptr, 3);
      write(cache, kv, id_range(99, 9));  // materializes s
      ASSERT_FALSE(s->is_lazy());
    }
    auto [a, b] = cache.split(std::move(s), 7);
    ASSERT_EQ(a->is_lazy(), !owned);
    SnapshotPtr merged = cache.merge(std::move(a), std::move(b));
    KVCache other;
    write(other, kv, id_range(0, 3));
    ASSERT_TRUE(other.restore(merged.get(), 12));
    EXPECT_EQ(held(other), concat(id_range(0, 3), id_range(30, 9))) << owned;
  }
}

TEST(KVCache, ScheduledCapturesInsideOneWriteRestoreEveryPrefix) {
  KVCache cache;
  std::vector<int64_t> offsets = id_range(1, 12);  // 1..12: per-token edges
  cache.prepare_snapshots(offsets);
  write(cache, kv, id_range(500, 12));  // one batched write
  std::vector<SnapshotPtr> captures = cache.take_snapshots();
  ASSERT_EQ(captures.size(), 12u);
  for (int64_t i = 0; i < 12; ++i) {
    ASSERT_NE(captures[i], nullptr);
    EXPECT_EQ(captures[i]->from(), i);  // edge-local [previous offset, offset)
    EXPECT_EQ(captures[i]->to(), i + 1);
    EXPECT_TRUE(captures[i]->is_lazy());
  }
  // Every prefix restores exactly, edge by edge, into a fresh cache.
  for (int64_t prefix = 1; prefix <= 12; ++prefix) {
    KVCache other;
    for (int64_t i = 0; i < prefix; ++i) ASSERT_TRUE(other.restore(captures[i].get(), i + 1));
    EXPECT_EQ(held(other), id_range(500, prefix));
  }
}

TEST(KVCache, ScheduledCaptureAtTheCurrentOffsetIsAZeroWidthNull) {
  KVCache cache;
  write(cache, kv, id_range(0, 4));
  const std::vector<int64_t> offsets{4, 6, 9};
  cache.prepare_snapshots(offsets);
  write(cache, kv, id_range(4, 3));
  write(cache, kv, id_range(7, 3));
  auto captures = cache.take_snapshots();
  ASSERT_EQ(captures.size(), 3u);
  EXPECT_EQ(captures[0], nullptr);
  EXPECT_EQ(captures[1]->from(), 4);
  EXPECT_EQ(captures[1]->to(), 6);
  EXPECT_EQ(captures[2]->from(), 6);
  EXPECT_EQ(captures[2]->to(), 9);
  EXPECT_TRUE(cache.take_snapshots().empty());  // the schedule was cleared
}

TEST(KVCache, ScheduledCapturesAllocateNoArrayBytes) {
  KVCache cache;
  cache.reserve(1024);
  write(cache, kv, id_range(0, 1));
  const std::vector<int64_t> offsets{10, 100, 500};
  const auto keys = kv.keys(id_range(1, 600)), values = kv.values(id_range(1, 600));
  const int64_t bytes = live_bytes();
  cache.prepare_snapshots(offsets);
  cache.update(Batch::uniform(1, 600, 1), keys, values);
  auto captures = cache.take_snapshots();
  EXPECT_EQ(live_bytes(), bytes);
  for (const auto& c : captures) EXPECT_EQ(c->size(), 0);
}

TEST(KVCacheErrors, BadSchedulesThrowAndChangeNothing) {
  KVCache cache;
  write(cache, kv, id_range(0, 5));
  const std::vector<int64_t> unsorted{8, 7}, duplicate{6, 6}, passed{4, 9};
  EXPECT_TRUE(throws_error([&] { cache.prepare_snapshots(unsorted); },
                           {"KVCache::prepare_snapshots", "[8, 7]", "ascending"}));
  EXPECT_TRUE(throws_error([&] { cache.prepare_snapshots(duplicate); }, {"unique"}));
  EXPECT_TRUE(throws_error([&] { cache.prepare_snapshots(passed); },
                           {"offset 4", "already passed", "cache offset 5"}));
  const std::vector<int64_t> good{7};
  cache.prepare_snapshots(good);
  EXPECT_TRUE(throws_error([&] { cache.prepare_snapshots(good); }, {"not taken"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.take_snapshots(); }, {"offset 7 not reached"}));
  EXPECT_TRUE(
      throws_error([&] { (void)cache.restore(nullptr, 2); }, {"KVCache::restore", "scheduled"}));
  EXPECT_EQ(cache.offset(), 5);
  write(cache, kv, id_range(5, 2));
  EXPECT_EQ(cache.take_snapshots().size(), 1u);  // the schedule survived the failed calls
}

TEST(KVCacheErrors, BadUpdatesThrowAndChangeNothing) {
  KVCache cache;
  write(cache, kv, id_range(0, 5));
  const auto ids = id_range(5, 2);
  // Batch offset disagrees with the cache.
  EXPECT_TRUE(
      throws_error([&] { cache.update(Batch::uniform(1, 2, 3), kv.keys(ids), kv.values(ids)); },
                   {"KVCache::update", "row 0 starts at 3", "its sequence 0 is at offset 5"}));
  // A second row whose sequence (1, empty) is not at the row's offset: nothing is written, not
  // even the first row's tokens (every row is checked before any is written).
  EXPECT_TRUE(throws_error(
      [&] { cache.update(Batch::uniform(2, 2, 5), kv.keys(ids, 2), kv.values(ids, 2)); },
      {"KVCache::update", "row 1 starts at 5", "its sequence 1 is at offset 0"}));
  EXPECT_EQ(cache.offset(1), 0);
  EXPECT_EQ(cache.sequences(), std::vector<SeqId>{0});
  // Dtype change mid-sequence.
  const TokenKV half{.dtype = DType::f16};
  EXPECT_TRUE(
      throws_error([&] { cache.update(Batch::uniform(1, 2, 5), half.keys(ids), half.values(ids)); },
                   {"keys f16", "keys f32"}));
  // Wrong shapes.
  EXPECT_TRUE(
      throws_error([&] { cache.update(Batch::uniform(1, 3, 5), kv.keys(ids), kv.values(ids)); },
                   {"do not fit a batch of 1 rows x 3 tokens"}));
  EXPECT_TRUE(throws_error(
      [&] {
        cache.update(Batch::uniform(1, 2, 5), kv.keys(ids).reshape({2, 2, 4}), kv.values(ids));
      },
      {"4-d"}));
  EXPECT_TRUE(throws_error(
      [&] {
        cache.update(Batch::uniform(1, 2, 5), Array::zeros(DType::i32, {1, 2, 2, 4}),
                     kv.values(ids));
      },
      {"float"}));
  EXPECT_EQ(cache.offset(), 5);
  EXPECT_EQ(held(cache), id_range(0, 5));
}

// Keys and values without a head or a depth hold nothing a query can attend to: refused by a
// write and by a snapshot made from a record (a file's), not adopted as a cache's layout.
TEST(KVCacheErrors, ZeroHeadsOrDepthsAreRefused) {
  const Shape shapes[] = {{1, 0, 2, 4}, {1, 2, 2, 0}};
  for (const Shape& shape : shapes) {
    KVCache cache;
    PagedKVCache paged;
    const Array keys = Array::zeros(DType::f32, shape);
    const Array values = Array::zeros(DType::f32, {1, shape[1], 2, 4});
    for (Attention* layer : std::initializer_list<Attention*>{&cache, &paged}) {
      EXPECT_TRUE(throws_error([&] { (void)layer->update(Batch::uniform(1, 2, 0), keys, values); },
                               {"::update", "heads and depths must be >= 1"}));
      EXPECT_TRUE(layer->sequences().empty());
    }
    EXPECT_TRUE(throws_error(
        [&] {
          (void)detail::make_snapshot({detail::SnapshotRecord::Kind::kv, keys, values, 0, 2},
                                      "load");
        },
        {"load", "B, H, D and Dv must be >= 1"}));
  }
}

// A record's range from an untrusted file: `to` far below `from` (to - from overflowed) is refused.
TEST(KVCacheErrors, ARecordWhoseRangeRunsBackwardsIsRefused) {
  const Array keys = kv.keys(id_range(0, 2)), values = kv.values(id_range(0, 2));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)detail::make_snapshot({detail::SnapshotRecord::Kind::kv, keys, values, 1,
                                     std::numeric_limits<int64_t>::min()},
                                    "load");
      },
      {"load", "does not hold 2 tokens"}));
}

// lazy_bytes of an empty or backwards range is 0, not a negative count.
TEST(KVCacheErrors, LazyBytesOfABackwardsRangeIsZero) {
  KVCache cache;
  write(cache, kv, id_range(0, 6));
  const SnapshotPtr s = cache.snapshot(0);
  EXPECT_GT(cache.lazy_bytes(0, 6), 0);
  EXPECT_EQ(cache.lazy_bytes(5, 1), 0);
}

TEST(KVCacheErrors, MisusedSnapshotsThrow) {
  KVCache cache;
  write(cache, kv, id_range(0, 6));
  EXPECT_TRUE(throws_error([&] { (void)cache.snapshot(7); },
                           {"KVCache::snapshot", "from_offset 7", "[0, 6]"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.snapshot(-1); }, {"from_offset -1"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.merge(cache.snapshot(0), cache.snapshot(2)); },
                           {"KVCache::merge", "[0, 6)", "[2, 6)", "not adjacent"}));
  RotatingKVCache rotating(4);
  write(rotating, kv, id_range(0, 3));
  SnapshotPtr foreign = rotating.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(foreign.get(), 3); },
                           {"KVCache::restore", "not a KVCache snapshot"}));
  // A snapshot of a different layout.
  KVCache wide;
  const TokenKV three_heads{.heads = 3};
  write(wide, three_heads, id_range(0, 2));
  SnapshotPtr other_layout = wide.snapshot(0);
  (void)cache.restore(nullptr, 0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(other_layout.get(), 2); },
                           {"KVCache::restore", "H=3", "H=2"}));
  EXPECT_EQ(cache.offset(), 0);
}

TEST(KVCacheErrors, ASnapshotOfAnotherLayoutIsRefusedEvenForAnOffsetMove) {
  // Restoring to the snapshot's start writes nothing, but the snapshot still does not fit.
  KVCache cache;
  write(cache, kv, id_range(0, 6));
  // A snapshot of two rows (as an older file could hold): every sequence here has one.
  SnapshotPtr s = detail::make_kv_snapshot(Array::zeros(DType::f32, {2, 2, 2, 4}),
                                           Array::zeros(DType::f32, {2, 2, 2, 4}), 2);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(s.get(), 2); },
                           {"KVCache::restore", "holds 2 batch rows", "B=1"}));
  EXPECT_EQ(cache.offset(), 6);
  const TokenKV half{.dtype = DType::f16};
  KVCache f16;
  write(f16, half, id_range(0, 4));
  SnapshotPtr h = f16.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(h.get(), 0); }, {"f16", "f32"}));
  EXPECT_EQ(cache.offset(), 6);
}

TEST(KVCache, ResetAllowsANewLayout) {
  KVCache cache;
  write(cache, kv, id_range(0, 3));
  cache.reset();
  const TokenKV other{.heads = 1, .depth = 8, .dtype = DType::bf16};
  write(cache, other, id_range(0, 2));
  EXPECT_EQ(cache.state()[0].shape(), (Shape{1, 1, 2, 8}));
  EXPECT_EQ(cache.state()[0].dtype(), DType::bf16);
}

TEST(KVCache, RowsOfABatchAreSequencesWithTheirOwnOffsets) {
  KVCache cache;
  write(cache, kv, id_range(0, 5));  // sequence 0: 5 tokens
  // One batch: sequence 0 decodes a token at 5, sequence 3 prefills 3 tokens at 0 (padded).
  Batch batch = Batch::uniform(2, 3, 0);
  batch.seq_ids = {0, 3};
  batch.seq_offsets = {5, 0};
  batch.seq_query_lens = {1, 3};
  Array keys = Array::zeros(DType::f32, {2, 2, 3, 4}), values = keys.clone();
  keys.slice(0, 0, 1).assign(kv.keys(std::vector<int64_t>{70, 0, 0}));
  keys.slice(0, 1, 2).assign(kv.keys(std::vector<int64_t>{80, 81, 82}));
  values.slice(0, 0, 1).assign(kv.values(std::vector<int64_t>{70, 0, 0}));
  values.slice(0, 1, 2).assign(kv.values(std::vector<int64_t>{80, 81, 82}));
  const KVHistory history = cache.update(batch, keys, values);
  ASSERT_TRUE(history.ragged());
  EXPECT_EQ(column_ids(history.row(0)), (std::vector<int64_t>{0, 1, 2, 3, 4, 70}));
  EXPECT_EQ(column_ids(history.row(1)), (std::vector<int64_t>{80, 81, 82}));
  EXPECT_EQ(cache.offset(0), 6);
  EXPECT_EQ(cache.offset(3), 3);
  EXPECT_EQ(cache.sequences(), (std::vector<SeqId>{0, 3}));
  // Snapshots, restores and resets address one sequence.
  SnapshotPtr s = cache.snapshot(3, 1);
  EXPECT_EQ(s->from(), 1);
  EXPECT_EQ(s->to(), 3);
  cache.reset(0);
  EXPECT_EQ(cache.offset(0), 0);
  EXPECT_EQ(cache.offset(3), 3);
  ASSERT_TRUE(cache.restore(3, nullptr, 2));
  EXPECT_EQ(cache.offset(3), 2);
  // A lazy snapshot of sequence 3 restores into sequence 0 by copying.
  write(cache, kv, id_range(90, 1));
  ASSERT_TRUE(cache.restore(0, s.get(), 3));
  EXPECT_EQ(column_ids(cache.view(Batch::uniform(1, 1, 0))), (std::vector<int64_t>{90, 81, 82}));
}

// A ragged batch built without input ids (as Python's Batch leaves them) is as wide as its
// longest row: each row's update sees all L columns of its keys, in every attention kind.
TEST(KVCache, RowsOfABatchWithoutIdsKeepTheBatchsColumns) {
  Batch batch;
  batch.seq_offsets = {0, 0};
  batch.seq_query_lens = {2, 1};
  batch.seq_ids = {0, 1};
  EXPECT_EQ(batch.row(1).length(), 2);
  EXPECT_EQ(batch.row(0).length(), 2);
  Array keys = Array::zeros(DType::f32, {2, 2, 2, 4}), values = keys.clone();
  keys.slice(0, 0, 1).assign(kv.keys(std::vector<int64_t>{10, 11}));
  keys.slice(0, 1, 2).assign(kv.keys(std::vector<int64_t>{20, 0}));
  values.slice(0, 0, 1).assign(kv.values(std::vector<int64_t>{10, 11}));
  values.slice(0, 1, 2).assign(kv.values(std::vector<int64_t>{20, 0}));
  KVCache contiguous;
  PagedKVCache paged(PagedKVCache::Options{.block_tokens = 4});
  RotatingKVCache rotating(8);
  for (Attention* cache : std::initializer_list<Attention*>{&contiguous, &paged, &rotating}) {
    const KVHistory history = cache->update(batch, keys, values);
    ASSERT_TRUE(history.ragged());
    EXPECT_EQ(column_ids(history.row(0)), (std::vector<int64_t>{10, 11}));
    EXPECT_EQ(column_ids(history.row(1)), (std::vector<int64_t>{20}));
  }
}

// ---- running out of memory ----------------------------------------------------------------

// Wide tokens (16 heads x 256 f32 keys and values: 32 KiB a token), so growing a sequence or a
// pool maps megabytes while the rest of a test's allocations fit in far less.
const TokenKV wide{.heads = 16, .depth = 256};

// A reservation past the positions a batch can address is refused (rounding it up for growth
// overflowed). One that fails to grow a sequence (std::bad_alloc: 2^31 tokens of 32 KiB is a
// size no machine maps) raises nothing: later sequences' first updates are not held to it.
TEST(KVCacheMemory, FailedReserveRaisesNothing) {
  KVCache cache;
  write(cache, wide, id_range(0, 3));
  EXPECT_TRUE(throws_error([&] { cache.reserve(std::numeric_limits<int64_t>::max()); },
                           {"KVCache::reserve", "must be in [0, 2147483647]"}));
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer aborts on the impossible size";
  EXPECT_THROW(cache.reserve(std::numeric_limits<int32_t>::max()), std::bad_alloc);
  EXPECT_EQ(cache.capacity(), KVCache::kStep);
  EXPECT_EQ(held(cache), id_range(0, 3));
  const auto ids = id_range(10, 2);
  EXPECT_NO_THROW(
      (void)cache.update(Batch::rows({{1, 0, {1, 1}}}), wide.keys(ids), wide.values(ids)));
  EXPECT_EQ(cache.offset(1), 2);
  cache.reserve(600);  // a reservation that fits still holds, at once and for new sequences
  EXPECT_EQ(cache.capacity(), 768);
  (void)cache.update(Batch::rows({{2, 0, {1, 1}}}), wide.keys(ids), wide.values(ids));
  (void)cache.restore(2, nullptr, 0);
  EXPECT_EQ(cache.sequences(), (std::vector<SeqId>{0, 1, 2}));
}

// A two-row update whose second row cannot get its memory writes neither row: every row's
// room (buffer growth, lazy data the write overwrites) is allocated before any row is written.
TEST(KVCacheMemory, MultiRowUpdateThatRunsOutOfMemoryWritesNoRow) {
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer ignores RLIMIT_AS";
  KVCache cache;
  write(cache, wide, id_range(0, 3));  // sequence 0
  (void)cache.update(Batch::rows({{1, 0, {1, 1, 1}}}), wide.keys(id_range(100, 3)),
                     wide.values(id_range(100, 3)));  // sequence 1
  SnapshotPtr s = cache.snapshot(0);
  ASSERT_TRUE(cache.restore(nullptr, 1));  // row 0's write copies part of `s` out first
  // Row 0: 2 tokens of sequence 0 (no growth). Row 1: 254 tokens of sequence 1, past its 256
  // columns: growth to 512 columns, 16 MiB, more than the child may map.
  const int64_t length = 254;
  std::vector<int64_t> ids = id_range(50, length);
  Array keys = Array::zeros(DType::f32, {2, wide.heads, length, wide.depth});
  Array values = Array::zeros(DType::f32, {2, wide.heads, length, wide.depth});
  keys.assign_slice(0, 0, wide.keys(ids));
  values.assign_slice(0, 0, wide.values(ids));
  keys.assign_slice(0, 1, wide.keys(ids));
  values.assign_slice(0, 1, wide.values(ids));
  std::vector<int32_t> two(2, 1), many(static_cast<size_t>(length), 1);
  const Batch batch = Batch::rows({{0, 1, two}, {1, 3, many}});
  const int status = run_with_headroom(int64_t(4) << 20, [&] {
    try {
      (void)cache.update(batch, keys, values);
      return 2;  // the limit did not bite
    } catch (const std::bad_alloc&) {
    }
    const bool unchanged =
        cache.offset(0) == 1 && cache.offset(1) == 3 && held(cache) == id_range(0, 1) &&
        cache.sequences() == std::vector<SeqId>{0, 1} && s->from() == 0 && s->to() == 3;
    return unchanged ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << "1: a row was written; 2: no std::bad_alloc; 3: another exception";
}

// The same for a paged cache: the pool holds every block the rows take before any is written.
TEST(KVCacheMemory, PagedMultiRowUpdateThatRunsOutOfMemoryWritesNoRow) {
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer ignores RLIMIT_AS";
  // Chunks of 64 blocks of 4 tokens: 8 MiB a chunk.
  PagedKVCache cache({.block_tokens = 4, .blocks_per_chunk = 64});
  write(cache, wide, id_range(0, 3));  // sequence 0: one block, partly written
  const int64_t length = 63 * 4;       // sequence 1: the chunk's 63 other blocks
  std::vector<int32_t> many(static_cast<size_t>(length), 1);
  (void)cache.update(Batch::rows({{1, 0, many}}), wide.keys(id_range(100, length)),
                     wide.values(id_range(100, length)));
  ASSERT_EQ(cache.pool_stats().blocks, 64);
  ASSERT_EQ(cache.pool_stats().blocks_in_use, 64);
  // Row 0 fits in sequence 0's block; row 1 needs a new block: a new chunk.
  const auto ids = id_range(50, 1);
  const Batch batch = Batch::rows({{0, 3, {1}}, {1, length, {1}}});
  const Array keys = wide.keys(ids, 2), values = wide.values(ids, 2);
  const int status = run_with_headroom(int64_t(2) << 20, [&] {
    try {
      (void)cache.update(batch, keys, values);
      return 2;
    } catch (const std::bad_alloc&) {
    }
    const bool unchanged =
        cache.offset(0) == 3 && cache.offset(1) == length && cache.pool_stats().blocks == 64 &&
        column_ids(cache.view(Batch::rows({{0, 3, {}}})).contiguous()) == id_range(0, 3);
    return unchanged ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << "1: a row was written; 2: no std::bad_alloc; 3: another exception";
}

// A one-row update (and so a restore that copies tokens in) takes every block it writes before
// writing any: running out of memory midway leaves the sequence's blocks as they were, not a
// block past its offset that exposed_bytes and the next write would take for its tail.
TEST(KVCacheMemory, PagedOneRowUpdateThatRunsOutOfMemoryTakesNoBlock) {
  if (kAddressSanitizer || testing::kThreadSanitizer) {
    GTEST_SKIP() << "the sanitizer's own allocations ignore or fail under RLIMIT_AS";
  }
  // A chunk of one block of 64 tokens: 2 MiB.
  PagedKVCache cache({.block_tokens = 64, .blocks_per_chunk = 1});
  write(cache, wide, id_range(0, 3));
  const int64_t length = 3 * 64;  // the rest of block 0, then three new blocks
  const auto ids = id_range(100, length);
  const Array keys = wide.keys(ids), values = wide.values(ids);
  const int status = run_with_headroom(int64_t(3) << 20, [&] {
    try {
      (void)cache.update(Batch::uniform(1, length, 3), keys, values);
      return 2;
    } catch (const std::bad_alloc&) {
    }
    testing::lift_memory_limit();
    const PagedKVCache::PoolStats stats = cache.pool_stats();
    const bool unchanged = cache.offset() == 3 && stats.live_blocks == 1 &&
                           stats.blocks_in_use == 1 && cache.exposed_bytes(0) == 0 &&
                           column_ids(cache.view(Batch{}).contiguous()) == id_range(0, 3);
    if (!unchanged) return 1;
    write(cache, wide, id_range(3, 70));  // and it goes on as if nothing had happened
    return column_ids(cache.view(Batch{}).contiguous()) == id_range(0, 73) ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << "1: a block was taken or a token written; 2: no std::bad_alloc; 3: "
                          "another exception";
}

// Two rows for sequences `first` and `second` at offset 0: `small` tokens and `large` tokens of
// `kv` (the same ids in both rows; row 0 padded).
struct TwoRows {
  Batch batch;
  Array keys, values;
};
TwoRows two_rows(const TokenKV& kv, SeqId first, SeqId second, int64_t small, int64_t large) {
  const std::vector<int64_t> ids = id_range(0, large);
  return {Batch::rows({{first, 0, std::vector<int32_t>(static_cast<size_t>(small), 1)},
                       {second, 0, std::vector<int32_t>(static_cast<size_t>(large), 1)}}),
          kv.keys(ids, 2), kv.values(ids, 2)};
}

// Runs `cache.update(rows)` in a child whose address space may grow by `headroom` bytes: 2 when
// that does not throw std::bad_alloc, else what `after` returns with no limit from there on (0:
// the cache is as expected, 1: not); 3 for another exception.
int update_out_of_memory(Attention& cache, const TwoRows& rows, int64_t headroom,
                         const std::function<int()>& after) {
  return run_with_headroom(headroom, [&] {
    try {
      (void)cache.update(rows.batch, rows.keys, rows.values);
      return 2;
    } catch (const std::bad_alloc&) {
    }
    testing::lift_memory_limit();
    return after();
  });
}
constexpr const char* kOutOfMemoryStatus =
    "1: a row was written or the layout fixed; 2: no std::bad_alloc; 3: another exception";

// A KVCache's first write, of two new sequences, that runs out of memory on the second row's
// buffer (16 MiB; the first's takes 512 KiB) creates no sequence and fixes no layout: the
// staged sequences' buffers are all allocated before either row is written.
TEST(KVCacheMemory, MultiRowFirstWriteThatRunsOutOfMemoryCreatesNoSequence) {
  if (kAddressSanitizer || testing::kThreadSanitizer) {
    GTEST_SKIP() << "the sanitizer's own allocations ignore or fail under RLIMIT_AS";
  }
  const TokenKV kv{.heads = 4, .depth = 64};  // 2 KiB a token
  const TokenKV other{.heads = 4, .depth = 64, .dtype = DType::f16};
  KVCache cache;
  const int status =
      update_out_of_memory(cache, two_rows(kv, 0, 1, 2, 8192), int64_t(4) << 20, [&] {
        if (!cache.sequences().empty() || cache.offset(0) != 0) return 1;
        write(cache, other, id_range(0, 3));  // another layout: none was fixed
        return cache.offset(0) == 3 ? 0 : 1;
      });
  EXPECT_EQ(status, 0) << kOutOfMemoryStatus;
}

// The same for a sequence that exists without a layout (a schedule made it): it keeps no layout
// and its schedule, and a later write of another layout is accepted.
TEST(KVCacheMemory, MultiRowUpdateThatRunsOutOfMemoryLeavesALayoutlessSequenceSo) {
  if (kAddressSanitizer || testing::kThreadSanitizer) {
    GTEST_SKIP() << "the sanitizer's own allocations ignore or fail under RLIMIT_AS";
  }
  const TokenKV kv{.heads = 4, .depth = 64};
  const TokenKV other{.heads = 4, .depth = 64, .dtype = DType::f16};
  KVCache cache;
  cache.prepare_snapshots(0, std::vector<int64_t>{1});
  const int status =
      update_out_of_memory(cache, two_rows(kv, 0, 1, 2, 8192), int64_t(4) << 20, [&] {
        if (cache.sequences() != std::vector<SeqId>{0} || cache.offset(0) != 0 ||
            !cache.schedule_state(0).pending) {
          return 1;
        }
        write(cache, other, id_range(0, 3));
        return cache.offset(0) == 3 && cache.take_snapshots(0).size() == 1 ? 0 : 1;
      });
  EXPECT_EQ(status, 0) << kOutOfMemoryStatus;
}

// A paged cache's first write, of two new sequences, whose blocks run out of memory: no
// sequence is created and no block is in use (the first row's block was reserved with the
// second's, not written first); the cache writes once memory is there.
TEST(KVCacheMemory, PagedMultiRowFirstWriteThatRunsOutOfMemoryCreatesNoSequence) {
  if (kAddressSanitizer || testing::kThreadSanitizer) {
    GTEST_SKIP() << "the sanitizer's own allocations ignore or fail under RLIMIT_AS";
  }
  // Chunks of 64 blocks of 4 tokens: 8 MiB a chunk. Row 0 takes a block, row 1 192 (3 chunks).
  PagedKVCache cache({.block_tokens = 4, .blocks_per_chunk = 64});
  const TwoRows rows = two_rows(wide, 0, 1, 1, 192 * 4);
  const int status = update_out_of_memory(cache, rows, int64_t(12) << 20, [&] {
    if (!cache.sequences().empty() || cache.pool_stats().blocks_in_use != 0) return 1;
    (void)cache.update(rows.batch, rows.keys, rows.values);
    return cache.offset(0) == 1 && cache.offset(1) == 192 * 4 ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << kOutOfMemoryStatus;
}

}  // namespace
}  // namespace kvsnap
