// Lazy snapshots outstanding while their cache goes on: buffer growth leaves them lazy (it moves
// the columns they name along with the history), a write costs the same however many of them
// there are, and lazy ranges of two sequences merge into one snapshot that holds both.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <vector>

#include "support/cache_support.h"
#include "support/test_support.h"

namespace kvsnap::outstanding_snapshots_test {
namespace {

using testing::column_ids;
using testing::concat_ids;
using testing::id_range;
using testing::position_ids;
using testing::TokenKV;
using testing::write;
using Ids = std::vector<int64_t>;

const TokenKV kv;
// Keys and values of one token: 2 heads x 4 f32 each.
constexpr int64_t kTokenBytes = 2 * (2 * 4 * 4);

// Ids of every token sequence `seq` holds, in position order.
Ids held(const Attention& cache, SeqId seq = 0) {
  if (cache.offset(seq) == 0) return {};
  return column_ids(cache.view(Batch::rows({{seq, cache.offset(seq), {}}})));
}

// Writes `ids` into sequence `seq` at its offset.
void write_seq(Attention& cache, SeqId seq, const Ids& ids) {
  Batch batch = Batch::uniform(1, static_cast<int64_t>(ids.size()), cache.offset(seq));
  batch.seq_ids = {seq};
  (void)cache.update(batch, kv.keys(ids), kv.values(ids));
}

// Appends the tokens `ids` one decode step at a time.
void decode(Attention& cache, const Ids& ids) {
  for (const int64_t id : ids) write(cache, kv, Ids{id});
}

// `s` still lazy and owning nothing: nothing copied out of the live buffer, nor into a snapshot.
void expect_untouched(const Snapshot& s, const CopyStats& now, const CopyStats& before) {
  EXPECT_TRUE(s.is_lazy());
  EXPECT_EQ(s.size(), 0);
  EXPECT_EQ(now.materialized_bytes, before.materialized_bytes);
  EXPECT_EQ(now.snapshot_bytes, before.snapshot_bytes);
}

// KVCache: capacity grows in steps; growth keeps the columns a lazy snapshot names in place (the
// new buffer takes them with the history), so across several growths — decode steps and chunks,
// to 1000 tokens — the snapshot stays lazy, owns nothing, nothing is copied out of it, and it
// still restores its tokens (into another cache, and into its own as an offset move).
TEST(OutstandingSnapshots, KVCacheGrowthLeavesALazySnapshotLazy) {
  KVCache cache;
  write(cache, kv, id_range(0, 200));
  const SnapshotPtr s = cache.snapshot(50);  // lazy [50, 200)
  const CopyStats before = cache.copy_stats();
  decode(cache, id_range(200, 100));  // past 256, a token at a time
  for (int64_t at = 300; at < 1000; at += 100) write(cache, kv, id_range(at, 100));
  EXPECT_EQ(cache.capacity(), 1024);
  EXPECT_GT(cache.copy_stats().growth_bytes, before.growth_bytes);  // it did grow
  expect_untouched(*s, cache.copy_stats(), before);
  KVCache other;
  write(other, kv, id_range(5000, 50));
  ASSERT_TRUE(other.restore(s.get(), 200));
  EXPECT_EQ(held(other), concat_ids(id_range(5000, 50), id_range(50, 150)));
  ASSERT_TRUE(cache.restore(s.get(), 200));
  EXPECT_EQ(held(cache), id_range(0, 200));
  EXPECT_EQ(cache.copy_stats().restored_bytes, before.restored_bytes);  // an offset move
  expect_untouched(*s, cache.copy_stats(), before);
}

// Growth copies only what would otherwise be lost: after a rewind, the columns past the offset
// that a lazy snapshot still names move with the buffer — a reserve() that grows it copies
// nothing out of the snapshot, which then restores its tokens in place.
TEST(OutstandingSnapshots, KVCacheGrowthAfterARewindKeepsTheNamedColumnsPastTheOffset) {
  KVCache cache;
  write(cache, kv, id_range(0, 200));
  const SnapshotPtr s = cache.snapshot(0);  // lazy [0, 200)
  ASSERT_TRUE(cache.restore(nullptr, 50));
  const CopyStats before = cache.copy_stats();
  cache.reserve(1000);
  EXPECT_EQ(cache.capacity(), 1024);
  expect_untouched(*s, cache.copy_stats(), before);
  ASSERT_TRUE(cache.restore(s.get(), 200));  // an offset move over the kept columns
  EXPECT_EQ(held(cache), id_range(0, 200));
  EXPECT_EQ(cache.copy_stats().restored_bytes, before.restored_bytes);
  expect_untouched(*s, cache.copy_stats(), before);
}

// The same where a restore grows the buffer: a snapshot whose front is lazy in this cache (past
// the rewound offset) and whose back is another cache's tokens writes only the back; the front's
// columns move with the grown buffer and are neither copied out nor written again.
TEST(OutstandingSnapshots, KVCacheRestoreThatGrowsTheBufferLeavesItsOwnLazyPartInPlace) {
  KVCache cache, other;
  write(cache, kv, id_range(0, 200));
  write(other, kv, id_range(1000, 600));
  SnapshotPtr joined = cache.merge(cache.snapshot(0), other.snapshot(200));  // [0, 600)
  ASSERT_TRUE(cache.restore(nullptr, 50));
  const CopyStats before = cache.copy_stats();
  ASSERT_TRUE(cache.restore(joined.get(), 600));
  EXPECT_EQ(held(cache), concat_ids(id_range(0, 200), id_range(1200, 400)));
  EXPECT_EQ(cache.copy_stats().materialized_bytes, before.materialized_bytes);
  EXPECT_EQ(cache.copy_stats().restored_bytes, before.restored_bytes + 400 * kTokenBytes);
  EXPECT_TRUE(joined->is_lazy());                // [0, 200) still names this cache's columns
  EXPECT_EQ(joined->size(), 400 * kTokenBytes);  // only the other cache's part is owned
}

// RotatingKVCache with a window larger than the growth step: the filling ring grows in steps
// too, keeping its columns in place, so a window captured on the way stays lazy across growths
// (to 700 tokens) and still restores its tokens.
TEST(OutstandingSnapshots, RotatingKVCacheGrowthLeavesALazyWindowLazy) {
  RotatingKVCache cache(1000);
  decode(cache, id_range(0, 200));
  const SnapshotPtr s = cache.snapshot(0);  // the window [0, 200), lazy
  const CopyStats before = cache.copy_stats();
  decode(cache, id_range(200, 500));  // grows at 256 and 512
  EXPECT_GT(cache.copy_stats().growth_bytes, before.growth_bytes);
  expect_untouched(*s, cache.copy_stats(), before);
  RotatingKVCache other(1000);
  ASSERT_TRUE(other.restore(s.get(), 200));
  EXPECT_EQ(held(other), id_range(0, 200));
  ASSERT_TRUE(cache.restore(s.get(), 200));  // nothing evicted yet: a live rewind
  EXPECT_EQ(held(cache), id_range(0, 200));
  EXPECT_EQ(position_ids(cache.view(Batch{})).back().first, 199);
  expect_untouched(*s, cache.copy_stats(), before);
}

// What one write allocated (arrays of the default allocator) and copied, by reason.
struct Cost {
  int64_t allocations = 0, appended = 0, growth = 0, materialized = 0, restored = 0, snapshots = 0;
  bool operator==(const Cost&) const = default;
};

// The cost of each of `steps` decode steps from the cache's offset (tokens 7000, 7001, ...).
std::vector<Cost> decode_costs(Attention& cache, int64_t steps) {
  std::vector<std::pair<Array, Array>> tokens;  // made before: making them allocates
  for (int64_t i = 0; i < steps; ++i) {
    const Ids id{7000 + i};
    tokens.emplace_back(kv.keys(id), kv.values(id));
  }
  std::vector<Cost> costs;
  for (const auto& [keys, values] : tokens) {
    const Batch batch = Batch::uniform(1, 1, cache.offset());
    const int64_t allocations = allocation_count();
    const CopyStats before = cache.copy_stats();
    (void)cache.update(batch, keys, values);
    const CopyStats after = cache.copy_stats();
    costs.push_back({allocation_count() - allocations, after.appended_bytes - before.appended_bytes,
                     after.growth_bytes - before.growth_bytes,
                     after.materialized_bytes - before.materialized_bytes,
                     after.restored_bytes - before.restored_bytes,
                     after.snapshot_bytes - before.snapshot_bytes});
  }
  return costs;
}

// DESIGN.md (Serving): a write costs the same however many snapshots are outstanding. Two caches
// hold the same 250 tokens; one has 1000 lazy snapshots of its history outstanding. Each of 20
// decode steps — the one that grows the buffer past 256 included — allocates and copies exactly
// what the same step of the other does, and the snapshots stay lazy.
TEST(OutstandingSnapshots, AWriteCostsTheSameHoweverManySnapshotsAreOutstanding) {
  KVCache bare, watched;
  write(bare, kv, id_range(0, 250));
  write(watched, kv, id_range(0, 250));
  std::vector<SnapshotPtr> snapshots;
  for (int64_t i = 0; i < 1000; ++i) snapshots.push_back(watched.snapshot(i % 250));
  const std::vector<Cost> alone = decode_costs(bare, 20);
  const std::vector<Cost> with_snapshots = decode_costs(watched, 20);
  ASSERT_EQ(alone.size(), with_snapshots.size());
  for (size_t step = 0; step < alone.size(); ++step) {
    EXPECT_EQ(with_snapshots[step], alone[step]) << "step " << step;
  }
  EXPECT_GT(alone[6].allocations, 0);  // step 6 grew the buffer: the comparison covers growth
  EXPECT_GT(alone[6].growth, 0);
  for (const SnapshotPtr& s : snapshots) EXPECT_EQ(s->size(), 0);
  EXPECT_EQ(held(watched), concat_ids(id_range(0, 250), id_range(7000, 20)));
}

// The same for the kinds whose writes must copy what a snapshot shares (a paged sequence's
// tail block, a window's ring slot): one snapshot or a thousand of the same state, each decode
// step allocates and copies alike — the copy is made once, for all of them.
template <class Kind, class Options>
void expect_the_same_cost_for_one_or_a_thousand(const Options& options) {
  Kind one(options), many(options);
  write(one, kv, id_range(0, 250));
  write(many, kv, id_range(0, 250));
  std::vector<SnapshotPtr> snapshots;
  snapshots.push_back(one.snapshot(0));
  for (int64_t i = 0; i < 1000; ++i) snapshots.push_back(many.snapshot(0));
  const std::vector<Cost> alone = decode_costs(one, 20);
  const std::vector<Cost> with_many = decode_costs(many, 20);
  for (size_t step = 0; step < alone.size(); ++step) {
    EXPECT_EQ(with_many[step], alone[step]) << "step " << step;
  }
  // The first step copies what the snapshots share (the tail block; the ring moved aside): the
  // comparison covers that copy.
  EXPECT_GT(alone[0].materialized + alone[0].growth, 0);
  EXPECT_EQ(held(many), held(one));
}

TEST(OutstandingSnapshots, APagedOrWindowWriteCostsTheSameForOneSnapshotOrAThousand) {
  {
    SCOPED_TRACE("paged");
    expect_the_same_cost_for_one_or_a_thousand<PagedKVCache>(
        PagedKVCache::Options{.block_tokens = 16, .blocks_per_chunk = 8});
  }
  {
    SCOPED_TRACE("window");
    expect_the_same_cost_for_one_or_a_thousand<RotatingKVCache>(int64_t{64});
  }
}

// KVCache::merge of lazy ranges of two sequences (two buffers): one snapshot names one buffer,
// so the child's range is copied out of its sequence first. The joined snapshot holds sequence
// 0's [0, 4) then sequence 1's [4, 8): it restores them into a third sequence and into a fresh
// cache, and still does after both sequences were rewound and overwritten.
TEST(OutstandingSnapshots, LazyRangesOfTwoSequencesMergeIntoOneSnapshotOfBoth) {
  KVCache cache;
  write_seq(cache, 0, id_range(0, 4));
  SnapshotPtr front = cache.snapshot(0, 0);  // [0, 4) of sequence 0
  write_seq(cache, 0, id_range(4, 4));
  write_seq(cache, 1, id_range(100, 8));
  SnapshotPtr back = cache.snapshot(1, 4);  // [4, 8) of sequence 1
  const CopyStats before = cache.copy_stats();
  const SnapshotPtr joined = cache.merge(std::move(front), std::move(back));
  ASSERT_NE(joined, nullptr);
  EXPECT_EQ(joined->from(), 0);
  EXPECT_EQ(joined->to(), 8);
  EXPECT_TRUE(joined->is_lazy());              // the front still names sequence 0's columns
  EXPECT_EQ(joined->size(), 4 * kTokenBytes);  // the back was copied out
  EXPECT_EQ(cache.copy_stats().materialized_bytes, before.materialized_bytes + 4 * kTokenBytes);
  const Ids expected = concat_ids(id_range(0, 4), id_range(104, 4));
  const auto restores_everywhere = [&](SeqId spare) {
    ASSERT_TRUE(cache.restore(spare, joined.get(), 8));
    EXPECT_EQ(held(cache, spare), expected);
    KVCache fresh;
    ASSERT_TRUE(fresh.restore(joined.get(), 8));
    EXPECT_EQ(held(fresh), expected);
  };
  restores_everywhere(2);
  // Both sequences written over from 0: what the snapshot names is copied out first.
  ASSERT_TRUE(cache.restore(0, nullptr, 0));
  write_seq(cache, 0, id_range(500, 8));
  ASSERT_TRUE(cache.restore(1, nullptr, 0));
  write_seq(cache, 1, id_range(600, 8));
  EXPECT_EQ(held(cache, 0), id_range(500, 8));
  EXPECT_EQ(held(cache, 1), id_range(600, 8));
  EXPECT_EQ(held(cache, 2), expected);
  EXPECT_FALSE(joined->is_lazy());
  EXPECT_EQ(joined->size(), 8 * kTokenBytes);
  restores_everywhere(3);
}

}  // namespace
}  // namespace kvsnap::outstanding_snapshots_test
