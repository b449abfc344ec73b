#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include "support/cache_support.h"
#include "support/test_support.h"

namespace kvsnap::rotating_kv_cache_test {
namespace {

using testing::id_range;
using testing::position_ids;
using testing::throws_error;
using testing::TokenKV;
using testing::write;

const TokenKV kv;
using Held = std::vector<std::pair<int64_t, int64_t>>;

// Token ids are 1000 + position, so the expected content of a window is positions only.
Held window(int64_t first, int64_t last) {  // positions [first, last)
  Held out;
  for (int64_t p = first; p < last; ++p) out.emplace_back(p, 1000 + p);
  return out;
}
Held held(const RotatingKVCache& cache) { return position_ids(cache.view(Batch{})); }

void write_positions(RotatingKVCache& cache, int64_t count) {
  write(cache, kv, id_range(1000 + cache.offset(), count));
}
void decode(RotatingKVCache& cache, int64_t steps) {
  for (int64_t i = 0; i < steps; ++i) write_positions(cache, 1);
}

TEST(RotatingKVCache, DecodeWrapsAndHoldsTheLastMaxSizePositions) {
  RotatingKVCache cache(4);
  for (int64_t n = 1; n <= 11; ++n) {
    write_positions(cache, 1);
    EXPECT_EQ(held(cache), window(std::max<int64_t>(0, n - 4), n)) << n;
  }
  const KVHistory history = cache.view(Batch{});
  EXPECT_EQ(history.length(), 4);
  EXPECT_EQ(history.window(), 4);
  EXPECT_EQ(history.oldest_column(), 3);  // ring order: 11 writes, slot of position 7 is 3
}

TEST(RotatingKVCache, RingDecodeAllocatesNoArrayStorage) {
  RotatingKVCache cache(16);
  decode(cache, 40);  // a wrapped ring
  const auto k = kv.keys(id_range(5000, 1)), v = kv.values(id_range(5000, 1));
  Batch batch = Batch::uniform(1, 1, 0);
  const int64_t allocations = allocation_count();
  for (int i = 0; i < 100; ++i) {
    batch.seq_offsets[0] = static_cast<int32_t>(cache.offset());
    (void)cache.update(batch, k, v);
  }
  EXPECT_EQ(allocation_count(), allocations);
}

TEST(RotatingKVCache, RepeatedChunksMoveAtMostTheWindowPerRelinearization) {
  // Chunked writes keep the window by moving `start` inside a roomy buffer; old tokens are
  // copied only when the buffer is rebuilt, and then at most max_size-1 of them.
  RotatingKVCache cache(64);
  for (int i = 0; i < 50; ++i) write_positions(cache, 32);
  const CopyStats stats = cache.copy_stats();
  EXPECT_LE(stats.growth_bytes, stats.appended_bytes);
}

// A chunk takes room for the tokens the window then holds and as many again (at most a window
// more), in steps of 256 columns: a short prompt in a long window — here 2^40 tokens, no limit in
// practice — holds 256 columns, not the window, and the buffer grows with the tokens, copying
// each at most about twice (was: a whole window's buffer at the first chunk, 128 MiB a layer for
// a 2^20-token window of 8 heads of 128 in f16; this window could not be written at all).
TEST(RotatingKVCache, AChunkTakesRoomForItsTokensNotTheWindow) {
  RotatingKVCache cache(int64_t{1} << 40);
  const int64_t column = 2 * kv.heads * kv.depth * 4;  // a token's keys and values, f32
  const int64_t before = live_bytes();
  write_positions(cache, 10);
  EXPECT_EQ(live_bytes() - before, 256 * column);
  for (int i = 0; i < 40; ++i) {
    write_positions(cache, 100);
    EXPECT_LE(live_bytes() - before, (2 * cache.offset() + 256) * column) << cache.offset();
  }
  decode(cache, 300);
  EXPECT_LE(live_bytes() - before, (2 * cache.offset() + 256) * column);
  EXPECT_EQ(held(cache), window(0, 4310));
  const CopyStats stats = cache.copy_stats();
  EXPECT_LE(stats.growth_bytes, 2 * stats.appended_bytes);
}

// A window still filling grows its buffer in place: the windows captured before stay lazy (the
// columns they name do not move), as they did when the first chunk took the whole window.
TEST(RotatingKVCache, AWindowFillingInChunksGrowsWithoutCopyingOutItsSnapshots) {
  RotatingKVCache cache(4096);
  write_positions(cache, 100);  // 256 columns
  SnapshotPtr early = cache.snapshot(0);
  ASSERT_TRUE(early->is_lazy());
  for (int i = 0; i < 6; ++i) {
    write_positions(cache, 300);  // past 256, 512, 1024 and 2048 columns: grown in place
    EXPECT_EQ(early->size(), 0) << cache.offset();
  }
  EXPECT_EQ(held(cache), window(0, 1900));
  RotatingKVCache other(4096);
  ASSERT_TRUE(other.restore(early.get(), 100));
  EXPECT_EQ(held(other), window(0, 100));
}

TEST(RotatingKVCache, DecodeStopsGrowingAtMaxSize) {
  RotatingKVCache cache(300);
  decode(cache, 700);
  EXPECT_EQ(cache.view(Batch{}).length(), 300);
  EXPECT_EQ(held(cache), window(400, 700));
}

TEST(RotatingKVCache, ChunkedWriteKeepsMaxSizeMinusOneOldTokens) {
  RotatingKVCache cache(4);
  write_positions(cache, 6);  // a chunk longer than the window: every query needs its window
  EXPECT_EQ(held(cache), window(0, 6));
  write_positions(cache, 5);  // keeps positions 3..5, appends 6..10
  EXPECT_EQ(held(cache), window(3, 11));
  const KVHistory history = cache.view(Batch{});
  EXPECT_EQ(history.first_position(), 3);
  EXPECT_EQ(history.oldest_column(), 0);  // linear after a chunk
}

TEST(RotatingKVCache, ChunkedWriteMidRotationLinearizesTheRing) {
  RotatingKVCache cache(4);
  decode(cache, 6);  // ring wrapped: positions 2..5
  EXPECT_NE(cache.view(Batch{}).oldest_column(), 0);
  write_positions(cache, 3);
  EXPECT_EQ(held(cache), window(3, 9));
  decode(cache, 2);  // back to a ring of the last 4
  EXPECT_EQ(held(cache), window(7, 11));
}

TEST(RotatingKVCache, RepeatedChunksKeepTheWindow) {
  RotatingKVCache cache(8);
  for (int64_t i = 0; i < 30; ++i) {
    write_positions(cache, 5);
    const int64_t end = cache.offset();
    EXPECT_EQ(held(cache), window(std::max<int64_t>(0, end - 5 - 7), end)) << i;
  }
}

TEST(RotatingKVCache, LiveRewindOnlyWhileNothingWasEvicted) {
  RotatingKVCache cache(8);
  write_positions(cache, 5);
  ASSERT_TRUE(cache.restore(nullptr, 3));
  EXPECT_EQ(held(cache), window(0, 3));
  write_positions(cache, 5);  // offset 8 == max_size: still exact
  ASSERT_TRUE(cache.restore(nullptr, 6));
  EXPECT_EQ(held(cache), window(0, 6));
  write_positions(cache, 3);  // offset 9 > max_size: position 0 is gone
  EXPECT_FALSE(cache.restore(nullptr, 8));
  EXPECT_EQ(cache.offset(), 9);
  EXPECT_EQ(held(cache), window(0, 9));
}

TEST(RotatingKVCache, SnapshotAfterAChunkedWriteIsLazy) {
  RotatingKVCache cache(4);
  write_positions(cache, 10);
  const int64_t bytes = live_bytes();
  SnapshotPtr s = cache.snapshot(0);
  EXPECT_EQ(live_bytes(), bytes);
  EXPECT_TRUE(s->is_lazy());
  EXPECT_EQ(s->size(), 0);
  EXPECT_EQ(s->from(), 10);
  EXPECT_EQ(s->to(), 10);
}

TEST(RotatingKVCache, SnapshotOfAWrappedRingIsLazyInTwoRuns) {
  RotatingKVCache cache(4);
  decode(cache, 10);
  SnapshotPtr s = cache.snapshot(10);  // positions 7, 8 | 9 in ring columns 3 | 0, 1
  EXPECT_TRUE(s->is_lazy());
  EXPECT_EQ(s->size(), 0);
  EXPECT_EQ(cache.copy_stats().snapshot_bytes, 0);
  decode(cache, 2);  // columns 2 (position 6: not its) and 3 (position 7: copied out)
  EXPECT_EQ(cache.copy_stats().materialized_bytes, 2 * 4 * 4 * 2);
  RotatingKVCache fresh(4);
  ASSERT_TRUE(fresh.restore(s.get(), 10));
  EXPECT_EQ(held(fresh), window(7, 10));
  write_positions(fresh, 1);
  EXPECT_EQ(held(fresh), window(7, 11));
}

TEST(RotatingKVCache, LazySnapshotsMaterializeOnlyWhenTheirColumnsAreReused) {
  RotatingKVCache cache(4);
  write_positions(cache, 10);         // linear buffer: positions 0..9 in columns 0..9
  SnapshotPtr s = cache.snapshot(0);  // window 7..9 = columns 7..9
  int fired = 0;
  int64_t delta = 0;
  s->set_materialize_hook([&](int64_t d) {
    ++fired;
    delta = d;
  });
  decode(cache, 3);  // the ring moves to columns 0..3; columns 7..9 are untouched
  EXPECT_TRUE(s->is_lazy());
  EXPECT_EQ(fired, 0);
  write_positions(cache, 2);  // relinearizing the ring drops the old buffer
  EXPECT_EQ(fired, 1);
  EXPECT_EQ(delta, 3 * 2 * 4 * 4 * 2);
  EXPECT_EQ(s->size(), delta);
  decode(cache, 1);
  EXPECT_EQ(fired, 1);
  RotatingKVCache fresh(4);
  ASSERT_TRUE(fresh.restore(s.get(), 10));
  EXPECT_EQ(held(fresh), window(7, 10));
}

TEST(RotatingKVCache, ScheduledCapturesInsideAChunkHoldTheirWindows) {
  RotatingKVCache cache(4);
  const std::vector<int64_t> offsets{0, 2, 4, 5, 9, 12};
  cache.prepare_snapshots(offsets);
  write_positions(cache, 12);
  auto captures = cache.take_snapshots();
  ASSERT_EQ(captures.size(), 6u);
  EXPECT_EQ(captures[0], nullptr);  // the empty state at offset 0
  for (size_t i = 1; i < captures.size(); ++i) {
    const int64_t end = offsets[i];
    ASSERT_NE(captures[i], nullptr);
    EXPECT_TRUE(captures[i]->is_lazy());
    EXPECT_EQ(captures[i]->to(), end);
    RotatingKVCache fresh(4);
    ASSERT_TRUE(fresh.restore(captures[i].get(), end));
    EXPECT_EQ(held(fresh), window(end <= 4 ? 0 : end - 3, end)) << end;
    write_positions(fresh, 2);  // continues like the original: the window before it, then 2
    EXPECT_EQ(held(fresh), window(std::max<int64_t>(0, end - 3), end + 2)) << end;
  }
}

TEST(RotatingKVCache, RestoreOwnLazySnapshotCopiesNothing) {
  RotatingKVCache cache(4);
  const std::vector<int64_t> offsets{6};
  cache.prepare_snapshots(offsets);
  write_positions(cache, 10);
  auto captures = cache.take_snapshots();
  const CopyStats before = cache.copy_stats();
  const int64_t allocations = allocation_count();
  ASSERT_TRUE(cache.restore(captures[0].get(), 6));
  EXPECT_EQ(cache.copy_stats().restored_bytes, before.restored_bytes);
  EXPECT_EQ(allocation_count(), allocations);
  EXPECT_EQ(cache.offset(), 6);
  EXPECT_EQ(held(cache), window(3, 6));
  write_positions(cache, 2);
  EXPECT_EQ(held(cache), window(3, 8));
}

TEST(RotatingKVCache, WrappedWindowsRestoreOnlyAtTheirEnd) {
  RotatingKVCache cache(4);
  write_positions(cache, 10);
  SnapshotPtr s = cache.snapshot(0);
  RotatingKVCache fresh(4);
  EXPECT_FALSE(fresh.restore(s.get(), 9));
  EXPECT_FALSE(fresh.restore(s.get(), 11));
  EXPECT_EQ(fresh.offset(), 0);
  EXPECT_TRUE(fresh.restore(s.get(), 10));
}

TEST(RotatingKVCache, UnwrappedWindowsRestoreToAnyEarlierOffset) {
  RotatingKVCache cache(8);
  write_positions(cache, 6);
  SnapshotPtr s = cache.snapshot(0);
  decode(cache, 5);  // wraps: s materializes
  RotatingKVCache fresh(8);
  ASSERT_TRUE(fresh.restore(s.get(), 4));
  EXPECT_EQ(held(fresh), window(0, 4));
  ASSERT_TRUE(cache.restore(s.get(), 2));  // into the cache it came from, now wrapped
  EXPECT_EQ(held(cache), window(0, 2));
}

TEST(RotatingKVCache, MergeKeepsTheChildAndSplitKeepsTheWhole) {
  RotatingKVCache cache(4);
  write_positions(cache, 3);
  SnapshotPtr parent = cache.snapshot(0);
  write_positions(cache, 3);
  SnapshotPtr child = cache.snapshot(0);
  Snapshot* raw = child.get();
  SnapshotPtr merged = cache.merge(std::move(parent), std::move(child));
  EXPECT_EQ(merged.get(), raw);
  auto [before, after] = cache.split(std::move(merged), 4);
  EXPECT_EQ(before, nullptr);
  EXPECT_EQ(after.get(), raw);
  EXPECT_EQ(cache.merge(cache.snapshot(0), nullptr), nullptr);
}

TEST(RotatingKVCache, SnapshotsOutliveTheirCache) {
  SnapshotPtr s;
  int64_t delta = 0, token_bytes = 0;
  {
    RotatingKVCache cache(4);
    write_positions(cache, 7);
    const KVHistory history = cache.view(Batch{});  // the chunk of 7 just written
    token_bytes = (history.keys().nbytes() + history.values().nbytes()) / 7;
    s = cache.snapshot(0);
    EXPECT_EQ(s->size(), 0);
    s->set_materialize_hook([&](int64_t bytes) { delta += bytes; });
  }
  EXPECT_FALSE(s->is_lazy());
  // The last max_size - 1 tokens (what a restore at 7 needs), reported by the hook and by
  // size() alike.
  EXPECT_EQ(delta, 3 * token_bytes);
  EXPECT_EQ(s->size(), 3 * token_bytes);
  RotatingKVCache fresh(4);
  ASSERT_TRUE(fresh.restore(s.get(), 7));
  EXPECT_EQ(held(fresh), window(4, 7));
}

TEST(RotatingKVCache, ResetMaterializesAndEmpties) {
  RotatingKVCache cache(4);
  write_positions(cache, 5);
  SnapshotPtr s = cache.snapshot(0);
  cache.reset();
  EXPECT_FALSE(s->is_lazy());
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_TRUE(cache.state().empty());
}

TEST(RotatingKVCache, WindowOfOne) {
  RotatingKVCache cache(1);
  decode(cache, 3);
  EXPECT_EQ(held(cache), window(2, 3));
  write_positions(cache, 3);
  EXPECT_EQ(held(cache), window(3, 6));
  decode(cache, 1);
  EXPECT_EQ(held(cache), window(6, 7));
}

TEST(RotatingKVCache, RingDecodeCopiesALazyWindowOneOverwrittenTokenAtATime) {
  RotatingKVCache cache(4);
  decode(cache, 8);  // a full ring, its oldest in column 0: positions 4..7 in columns 0..3
  SnapshotPtr s = cache.snapshot(0);  // the window at 8: positions 5..7, columns 1..3, lazy
  ASSERT_EQ(s->size(), 0);
  const int64_t token = 2 * (2 * 4 * 4);
  decode(cache, 1);  // overwrites column 0 (position 4): not the snapshot's
  EXPECT_EQ(cache.copy_stats().materialized_bytes, 0);
  decode(cache, 1);  // column 1: position 5 is copied out, positions 6, 7 stay lazy
  EXPECT_EQ(cache.copy_stats().materialized_bytes, token);
  EXPECT_TRUE(s->is_lazy());
  decode(cache, 2);  // columns 2, 3
  EXPECT_EQ(cache.copy_stats().materialized_bytes, 3 * token);
  EXPECT_FALSE(s->is_lazy());
  EXPECT_EQ(s->size(), 3 * token);
  RotatingKVCache other(4);
  ASSERT_TRUE(other.restore(s.get(), 8));
  EXPECT_EQ(held(other), window(5, 8));
}

TEST(RotatingKVCache, AWindowOfOneCapturesAnEmptyRestorePoint) {
  // The next query of a window of 1 needs no old token: the snapshot is empty but real, so a
  // planner can tell "restorable here" from "no snapshot".
  RotatingKVCache cache(1);
  write_positions(cache, 5);
  SnapshotPtr s = cache.snapshot(0);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->size(), 0);
  EXPECT_EQ(s->to(), 5);
  decode(cache, 3);
  ASSERT_TRUE(cache.restore(s.get(), 5));
  EXPECT_EQ(cache.offset(), 5);
  decode(cache, 1);
  EXPECT_EQ(held(cache), window(5, 6));
  RotatingKVCache empty(1);
  EXPECT_EQ(empty.snapshot(0), nullptr);  // only offset 0 has nothing to hold
}

TEST(RotatingKVCacheErrors, AWindowRestoresOnlyIntoACacheOfTheSameWindow) {
  RotatingKVCache small(4);
  write_positions(small, 10);
  SnapshotPtr s = small.snapshot(0);
  RotatingKVCache big(16);
  EXPECT_TRUE(throws_error([&] { (void)big.restore(s.get(), 10); },
                           {"RotatingKVCache::restore", "window 4", "window 16"}));
  EXPECT_EQ(big.offset(), 0);
  EXPECT_TRUE(big.state().empty());
  // The same from a file: the window travels with the snapshot.
  const LoadedSnapshots loaded =
      decode_snapshots(encode_snapshots(10, std::vector<const Snapshot*>{s.get()}), "window.st");
  EXPECT_TRUE(throws_error([&] { (void)big.restore(loaded.snapshots[0].get(), 10); },
                           {"RotatingKVCache::restore", "window 4", "window 16"}));
  RotatingKVCache same(4);
  ASSERT_TRUE(same.restore(loaded.snapshots[0].get(), 10));
  EXPECT_EQ(held(same), window(7, 10));
  // Nor does merge take it (a window's merge keeps the child, which must fit).
  write_positions(big, 12);
  EXPECT_TRUE(throws_error([&] { (void)big.merge(big.snapshot(0), small.snapshot(0)); },
                           {"RotatingKVCache::merge", "window of 4 tokens", "window is 16"}));
  EXPECT_TRUE(throws_error([&] { (void)small.merge(big.snapshot(0), small.snapshot(0)); },
                           {"RotatingKVCache::merge", "window of 16 tokens", "window is 4"}));
  const testing::TokenKV wide{.heads = 4};
  RotatingKVCache other(4);
  (void)testing::write(other, wide, id_range(0, 3));
  EXPECT_TRUE(throws_error([&] { (void)small.merge(small.snapshot(0), other.snapshot(0)); },
                           {"RotatingKVCache::merge", "layouts differ"}));
}

TEST(RotatingKVCacheErrors, ASnapshotOfAnotherLayoutIsRefusedWhateverTheTarget) {
  RotatingKVCache cache(8);
  write_positions(cache, 3);
  RotatingKVCache other(8);
  const TokenKV three_heads{.heads = 3};
  write(other, three_heads, id_range(0, 2));
  SnapshotPtr s = other.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(s.get(), 1); },
                           {"RotatingKVCache::restore", "H=3", "H=2"}));
  EXPECT_EQ(held(cache), window(0, 3));
}

TEST(RotatingKVCacheErrors, MisuseThrowsAndChangesNothing) {
  EXPECT_TRUE(throws_error([] { RotatingKVCache cache(0); }, {"RotatingKVCache", "max_size 0"}));
  // A window no array could hold (its rounded size would overflow): refused at construction.
  EXPECT_TRUE(throws_error([] { RotatingKVCache cache(INT64_MAX); },
                           {"RotatingKVCache: max_size 9223372036854775807 must be in [1, 2^60]"}));
  EXPECT_TRUE(throws_error([] { RotatingKVCache cache((int64_t{1} << 60) + 1); },
                           {"RotatingKVCache", "max_size 1152921504606846977"}));
  EXPECT_EQ(RotatingKVCache(int64_t{1} << 60).max_size(), int64_t{1} << 60);
  RotatingKVCache cache(4);
  write_positions(cache, 5);
  KVCache plain;
  write(plain, kv, id_range(0, 5));
  SnapshotPtr foreign = plain.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(foreign.get(), 5); },
                           {"RotatingKVCache::restore", "not a RotatingKVCache snapshot"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.merge(std::move(foreign), nullptr); },
                           {"RotatingKVCache::merge"}));
  const auto ids = id_range(5, 2);
  EXPECT_TRUE(throws_error(
      [&] { cache.update(Batch::uniform(1, 2, 4), kv.keys(ids), kv.values(ids)); },
      {"RotatingKVCache::update", "row 0 starts at 4", "its sequence 0 is at offset 5"}));
  const std::vector<int64_t> passed{3};
  EXPECT_TRUE(throws_error([&] { cache.prepare_snapshots(passed); },
                           {"RotatingKVCache::prepare_snapshots", "already passed"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.snapshot(6); }, {"RotatingKVCache::snapshot"}));
  EXPECT_EQ(held(cache), window(0, 5));
}

}  // namespace
}  // namespace kvsnap::rotating_kv_cache_test
