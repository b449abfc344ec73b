// PagedKVCache: sequences share blocks; snapshots are block references; a write copies only a
// shared block it touches; restores splice references (joining at most one block).
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <optional>
#include <random>

#include "cache/snapshot_record.h"
#include "ops/decode_kernels.h"
#include "support/cache_support.h"
#include "support/test_support.h"

namespace kvsnap::paged_kv_cache_test {
namespace {

using testing::column_ids;
using testing::id_range;
using testing::throws_error;
using testing::TokenKV;

const TokenKV kv;  // 2 heads x 4, f32: 64 bytes a token
constexpr int64_t kToken = 64;
constexpr int64_t kBlock = 8;

std::vector<int64_t> held(const PagedKVCache& cache, SeqId seq) {
  Batch batch = Batch::uniform(1, 1, 0);
  batch.seq_ids = {seq};
  return column_ids(cache.view(batch));
}

// Writes `ids` into sequence `seq` at its offset.
void write(PagedKVCache& cache, SeqId seq, const std::vector<int64_t>& ids) {
  Batch batch = Batch::uniform(1, static_cast<int64_t>(ids.size()), cache.offset(seq));
  batch.seq_ids = {seq};
  (void)cache.update(batch, kv.keys(ids), kv.values(ids));
}

std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A batch of the last `queries` tokens of each of `seqs`, one row each.
Batch last_tokens(const PagedKVCache& cache, const std::vector<SeqId>& seqs, int64_t queries) {
  Batch batch = Batch::uniform(static_cast<int64_t>(seqs.size()), queries, 0);
  batch.seq_ids = seqs;
  for (size_t b = 0; b < seqs.size(); ++b) {
    batch.seq_offsets[b] = static_cast<int32_t>(cache.offset(seqs[b]) - queries);
  }
  return batch;
}

// Each row's sequence holds exactly `expected[row]` (the tokens the test wrote there), and sdpa
// over the batch's paged histories equals each row alone against those tokens in one contiguous
// history.
void expect_rows_as_alone(const PagedKVCache& cache, const Batch& batch, const Array& q,
                          const AttentionMask& mask,
                          const std::vector<std::vector<int64_t>>& expected) {
  ASSERT_EQ(static_cast<int64_t>(expected.size()), batch.batch_size());
  const Array got = sdpa(batch, q, cache.view(batch), mask, 0.4f);
  for (int64_t row = 0; row < batch.batch_size(); ++row) {
    const std::vector<int64_t>& ids = expected[static_cast<size_t>(row)];
    EXPECT_EQ(held(cache, batch.seq_id(row)), ids) << "sequence " << batch.seq_id(row);
    const KVHistory full(kv.keys(ids), kv.values(ids));
    const Array alone = sdpa(batch.row(row), q.slice(0, row, row + 1), full, mask, 0.4f);
    EXPECT_TRUE(testing::all_close(got.slice(0, row, row + 1).contiguous(), alone, 1e-5f))
        << "row " << row << ", mask " << static_cast<int>(mask.kind());
  }
}

class Paged : public ::testing::Test {
 protected:
  PagedKVCache cache{{.block_tokens = kBlock, .blocks_per_chunk = 4}};
};

TEST_F(Paged, ASequenceIsBlocksAndItsHistoryIsPaged) {
  write(cache, 0, id_range(0, 20));
  const KVHistory history = cache.view(Batch::uniform(1, 1, 0));
  ASSERT_TRUE(history.paged());
  EXPECT_EQ(history.paged_columns().table.size(), 3u);
  EXPECT_EQ(history.length(), 20);
  EXPECT_EQ(column_ids(history), id_range(0, 20));
  EXPECT_EQ(cache.pool_stats().blocks_in_use, 3);
  EXPECT_EQ(cache.pool_stats().blocks, 4);  // one chunk
}

TEST_F(Paged, SharingAPrefixWithAnotherSequenceCopiesNothing) {
  write(cache, 0, id_range(0, 40));
  const int64_t bytes = live_bytes();
  SnapshotPtr prefix = cache.snapshot(0, 0);
  EXPECT_EQ(prefix->size(), 0);
  EXPECT_TRUE(prefix->is_lazy());
  ASSERT_TRUE(cache.restore(1, prefix.get(), 40));
  EXPECT_EQ(held(cache, 1), id_range(0, 40));
  EXPECT_EQ(cache.pool_stats().blocks_in_use, 5);
  EXPECT_EQ(cache.pool_stats().live_blocks, 5);  // both sequences use the same five
  EXPECT_EQ(cache.pool_stats().live_bytes, 5 * kBlock * kToken);
  EXPECT_EQ(cache.pool_stats().blocks_copied, 0);
  EXPECT_EQ(live_bytes(), bytes);
  EXPECT_EQ(cache.copy_stats().restored_bytes, 0);
}

TEST_F(Paged, AWriteIntoASharedBlockCopiesThatBlockOnly) {
  write(cache, 0, id_range(0, 40));
  SnapshotPtr prefix = cache.snapshot(0, 0);
  ASSERT_TRUE(cache.restore(1, prefix.get(), 37));  // ends inside block 4
  write(cache, 1, {900, 901});
  EXPECT_EQ(cache.pool_stats().blocks_copied, 1);
  EXPECT_EQ(cache.copy_stats().materialized_bytes, 5 * kToken);  // [32, 37) of block 4
  EXPECT_EQ(held(cache, 1), concat(id_range(0, 37), {900, 901}));
  EXPECT_EQ(held(cache, 0), id_range(0, 40));  // untouched
  write(cache, 1, {902});                      // its own block now: no copy
  EXPECT_EQ(cache.pool_stats().blocks_copied, 1);
}

TEST_F(Paged, RestoringMidBlockJoinsOneBlockAndSplicesTheRest) {
  write(cache, 0, id_range(0, 40));
  SnapshotPtr tail = cache.snapshot(0, 3);  // [3, 40)
  write(cache, 2, id_range(100, 5));        // another sequence, its own first tokens
  ASSERT_TRUE(cache.restore(2, tail.get(), 40));
  EXPECT_EQ(held(cache, 2), concat(id_range(100, 3), id_range(3, 37)));
  EXPECT_EQ(cache.pool_stats().blocks_copied, 1);  // block 0 joined; blocks 1..4 shared
  EXPECT_EQ(cache.copy_stats().restored_bytes, kBlock * kToken);
  // A join that ends inside its block copies (and counts) its tokens, not the block's.
  write(cache, 3, id_range(200, 5));
  ASSERT_TRUE(cache.restore(3, tail.get(), 6));
  EXPECT_EQ(held(cache, 3), concat(id_range(200, 3), id_range(3, 3)));
  EXPECT_EQ(cache.pool_stats().blocks_copied, 2);
  EXPECT_EQ(cache.copy_stats().restored_bytes, (kBlock + 6) * kToken);
}

// Where a restore meets the sequence mid-block, a snapshot block that began as a copy of the
// sequence's own is taken as it is; once the sequence wrote those tokens again, it is joined.
TEST_F(Paged, RestoringMidBlockTakesABlockThatBeganAsACopyOfOurs) {
  write(cache, 0, id_range(0, 12));  // blocks [0, 8) and [8, 12)
  SnapshotPtr prefix = cache.snapshot(0, 0);
  ASSERT_TRUE(cache.restore(1, prefix.get(), 12));
  write(cache, 1, id_range(100, 8));  // block [8, 16) copied from sequence 0's, then [16, 20)
  EXPECT_EQ(cache.pool_stats().blocks_copied, 1);
  SnapshotPtr continued = cache.snapshot(1, 12);  // [12, 20)
  ASSERT_TRUE(cache.restore(0, continued.get(), 20));
  EXPECT_EQ(cache.pool_stats().blocks_copied, 1);  // taken, not joined
  EXPECT_EQ(held(cache, 0), concat(id_range(0, 12), id_range(100, 8)));
  // So does a merge of the two parts.
  SnapshotPtr whole = cache.merge(std::move(prefix), cache.snapshot(1, 12));
  EXPECT_EQ(cache.pool_stats().blocks_copied, 1);
  ASSERT_TRUE(cache.restore(4, whole.get(), 20));
  EXPECT_EQ(held(cache, 4), concat(id_range(0, 12), id_range(100, 8)));
  // Sequence 2 holds [8, 12) in a block of its own, written again after sequence 1 copied it.
  write(cache, 2, id_range(0, 12));
  SnapshotPtr third = cache.snapshot(2, 0);
  ASSERT_TRUE(cache.restore(3, third.get(), 12));
  write(cache, 3, id_range(200, 4));  // copies sequence 2's block [8, 16)
  SnapshotPtr fourth = cache.snapshot(3, 12);
  third.reset();
  ASSERT_TRUE(cache.restore(2, nullptr, 10));
  write(cache, 2, {700, 701});  // its block alone now: written in place
  const int64_t copied = cache.pool_stats().blocks_copied;
  ASSERT_TRUE(cache.restore(2, fourth.get(), 16));
  EXPECT_EQ(cache.pool_stats().blocks_copied, copied + 1);  // joined: its own 700, 701 kept
  EXPECT_EQ(held(cache, 2), concat(id_range(0, 10), concat({700, 701}, id_range(200, 4))));
}

TEST_F(Paged, SnapshotsPayForTheBlocksNoSequenceUses) {
  write(cache, 0, id_range(0, 20));
  SnapshotPtr a = cache.snapshot(0, 0), b = cache.snapshot(0, 8);
  int64_t a_delta = 0, b_delta = 0;
  a->set_materialize_hook([&](int64_t d) { a_delta += d; });
  b->set_materialize_hook([&](int64_t d) { b_delta += d; });
  EXPECT_EQ(cache.pool_stats().live_blocks, 3);
  cache.reset(0);  // the sequence lets go: each block is paid for by exactly one holder
  EXPECT_EQ(cache.pool_stats().live_blocks, 0);
  EXPECT_EQ(cache.pool_stats().blocks_in_use, 3);
  const int64_t block = kBlock * kToken;
  EXPECT_EQ(a->size() + b->size(), 3 * block);
  EXPECT_EQ(a_delta + b_delta, 3 * block);
  EXPECT_FALSE(a->is_lazy());
  a.reset();  // b takes over the blocks it shares with a
  EXPECT_EQ(b->size(), 2 * block);
  EXPECT_EQ(cache.pool_stats().blocks_in_use, 2);
  ASSERT_TRUE(cache.restore(0, b.get(), 20) == false);  // the sequence is at 0 < 8
  write(cache, 0, id_range(0, 8));
  ASSERT_TRUE(cache.restore(0, b.get(), 20));  // live again: b pays for nothing
  EXPECT_EQ(b->size(), 0);
  EXPECT_EQ(held(cache, 0), id_range(0, 20));
}

// A snapshot outlives its cache: destroying the cache hands it the blocks it names, reported
// through its hook (a block at a time) adding up to exactly what size() then says.
TEST(PagedLifetime, SnapshotsOutliveTheirCacheAndPayForTheirBlocks) {
  SnapshotPtr s;
  int64_t delta = 0;
  {
    PagedKVCache cache({.block_tokens = kBlock, .blocks_per_chunk = 4});
    write(cache, 0, id_range(0, 20));  // blocks of 8, 8 and 4 tokens
    s = cache.snapshot(0, 0);
    EXPECT_EQ(s->size(), 0);
    s->set_materialize_hook([&](int64_t bytes) { delta += bytes; });
  }
  EXPECT_EQ(delta, 3 * kBlock * kToken);
  EXPECT_EQ(s->size(), 3 * kBlock * kToken);
  PagedKVCache fresh({.block_tokens = kBlock, .blocks_per_chunk = 4});
  ASSERT_TRUE(fresh.restore(0, s.get(), 20));
  EXPECT_EQ(held(fresh, 0), id_range(0, 20));
}

TEST_F(Paged, SplitSharesTheBoundaryBlockAndMergeRejoinsIt) {
  write(cache, 0, id_range(0, 30));
  SnapshotPtr whole = cache.snapshot(0, 0);
  auto [front, back] = cache.split(std::move(whole), 20);
  EXPECT_EQ(front->to(), 20);
  EXPECT_EQ(back->from(), 20);
  EXPECT_EQ(cache.pool_stats().blocks_copied, 0);
  SnapshotPtr joined = cache.merge(std::move(front), std::move(back));
  EXPECT_EQ(cache.pool_stats().blocks_copied, 0);
  ASSERT_TRUE(cache.restore(3, joined.get(), 30));
  EXPECT_EQ(held(cache, 3), id_range(0, 30));
}

// A restore of another cache's snapshot over a sequence's own tokens reuses the blocks the rewind
// frees: a full pool does not grow for it.
TEST_F(Paged, ARestoreOverTheSequencesOwnBlocksTakesNoNewOnes) {
  KVCache other;
  (void)testing::write(other, kv, id_range(500, 32));
  write(cache, 0, id_range(0, 32));  // the pool's one chunk: 4 blocks of 8, every one in use
  const int64_t blocks = cache.pool_stats().blocks;
  for (const int64_t from : {int64_t{0}, int64_t{12}}) {
    const SnapshotPtr theirs = other.split(other.snapshot(0), from).second;
    ASSERT_TRUE(cache.restore(0, theirs.get(), 32));
    EXPECT_EQ(held(cache, 0), concat(id_range(0, from), id_range(500 + from, 32 - from)));
    EXPECT_EQ(cache.pool_stats().blocks, blocks) << from;
    ASSERT_TRUE(cache.restore(0, nullptr, 0));
    write(cache, 0, id_range(0, 32));
  }
}

// Snapshots not both of this pool (a KVCache's here) merge as an owned copy, counted as copied;
// two of different layouts are refused, naming both.
TEST_F(Paged, MergingAnotherCachesSnapshotCopiesAndCountsIt) {
  KVCache other;
  (void)testing::write(other, kv, id_range(0, 4));
  write(cache, 0, id_range(0, 8));
  const int64_t before = cache.copy_stats().snapshot_bytes;
  SnapshotPtr joined = cache.merge(other.snapshot(0), cache.split(cache.snapshot(0, 0), 4).second);
  EXPECT_EQ(cache.copy_stats().snapshot_bytes - before, 8 * kToken);
  ASSERT_TRUE(cache.restore(5, joined.get(), 8));
  EXPECT_EQ(held(cache, 5), id_range(0, 8));
  KVCache wide;
  (void)testing::write(wide, TokenKV{.heads = 3}, id_range(0, 4));
  EXPECT_TRUE(throws_error(
      [&] { (void)cache.merge(wide.snapshot(0), cache.split(cache.snapshot(0, 0), 4).second); },
      {"PagedKVCache::merge", "H=3", "differs from the child's", "H=2"}));
  EXPECT_EQ(cache.copy_stats().snapshot_bytes - before, 8 * kToken);
}

TEST_F(Paged, RowsOfSeveralSequencesAttendToTheirOwnBlocks) {
  write(cache, 0, id_range(0, 19));
  write(cache, 1, id_range(50, 5));
  Batch batch = Batch::uniform(2, 2, 0);
  batch.seq_ids = {0, 1};
  batch.seq_offsets = {19, 5};
  batch.seq_query_lens = {1, 2};
  Array keys = Array::zeros(DType::f32, {2, 2, 2, 4}), values = keys.clone();
  keys.slice(0, 0, 1).assign(kv.keys(std::vector<int64_t>{19, 0}));
  values.slice(0, 0, 1).assign(kv.values(std::vector<int64_t>{19, 0}));
  keys.slice(0, 1, 2).assign(kv.keys(std::vector<int64_t>{55, 56}));
  values.slice(0, 1, 2).assign(kv.values(std::vector<int64_t>{55, 56}));
  const KVHistory history = cache.update(batch, keys, values);
  std::mt19937 rng(4);
  const Array q = testing::random_array({2, 4, 2, 4}, rng);
  const Array got = sdpa(batch, q, history, AttentionMask::causal(), 0.4f);
  for (int64_t b = 0; b < 2; ++b) {
    const std::vector<int64_t> ids = b == 0 ? id_range(0, 20) : id_range(50, 7);
    const KVHistory full(kv.keys(ids), kv.values(ids));
    const Array expected =
        sdpa(batch.row(b), q.slice(0, b, b + 1), full, AttentionMask::causal(), 0.4f);
    EXPECT_TRUE(testing::all_close(got.slice(0, b, b + 1).contiguous(), expected, 1e-5f)) << b;
  }
}

// A decode step of many sequences: rows that hold the same block (a shared prefix, also one
// that ends inside a block) read it once for all of them; each row still attends to exactly its
// own history, under causal and lookback masks, with two query heads per key/value head.
TEST_F(Paged, DecodeRowsSharingBlocksAttendToTheirOwnHistories) {
  write(cache, 0, id_range(0, 40));
  SnapshotPtr prefix = cache.snapshot(0, 0);
  ASSERT_TRUE(cache.restore(1, prefix.get(), 40));
  write(cache, 1, id_range(200, 5));
  ASSERT_TRUE(cache.restore(2, prefix.get(), 37));  // shares block 4 with sequence 0, in part
  ASSERT_TRUE(cache.restore(3, prefix.get(), 16));  // ends on a block boundary
  write(cache, 3, id_range(300, 3));
  write(cache, 4, id_range(400, 9));  // shares nothing
  const Batch batch = last_tokens(cache, {0, 1, 2, 3, 4}, 1);
  const std::vector<std::vector<int64_t>> expected{
      id_range(0, 40), concat(id_range(0, 40), id_range(200, 5)), id_range(0, 37),
      concat(id_range(0, 16), id_range(300, 3)), id_range(400, 9)};
  std::mt19937 rng(11);
  const Array q = testing::random_array({5, 4, 1, 4}, rng);
  for (const AttentionMask& mask :
       {AttentionMask::causal(), AttentionMask::sliding_window(7), AttentionMask::lookback(12)}) {
    expect_rows_as_alone(cache, batch, q, mask, expected);
  }
}

// Chunks of several queries read runs of blocks in place: consecutive blocks of one chunk as one
// run, a chunk boundary or a spliced block starting the next.
TEST_F(Paged, ChunkRowsReadRunsOfBlocksAcrossChunksAndSplices) {
  write(cache, 0, id_range(0, 40));  // blocks 0-3 in the first chunk, block 4 in the second
  SnapshotPtr prefix = cache.snapshot(0, 0);
  ASSERT_TRUE(cache.restore(1, prefix.get(), 24));
  write(cache, 1, id_range(200, 13));  // its own blocks after three shared ones
  std::mt19937 rng(12);
  expect_rows_as_alone(cache, last_tokens(cache, {0, 1}, 3),
                       testing::random_array({2, 4, 3, 4}, rng), AttentionMask::causal(),
                       {id_range(0, 40), concat(id_range(0, 24), id_range(200, 13))});
}

// Keys f32 and values f16 (each side its own type): blocks are converted one at a time and each
// run is read while its copy lives — two sequences' blocks interleaved, decode and chunk rows.
// Sequences decoding side by side get their new blocks interleaved in memory: each row's own
// tail is many blocks apart, behind a shared prefix that spans a chunk boundary. Decode and
// chunk rows attend to exactly their own histories — with the AVX-512 kernels (one call over a
// row's scattered blocks) and with the BLAS products a CPU without them takes.
TEST_F(Paged, RowsWhoseBlocksInterleaveAttendToTheirOwnHistories) {
  write(cache, 0, id_range(0, 44));  // blocks 0-3 in one chunk, 4-5 in the next
  SnapshotPtr prefix = cache.snapshot(0, 0);
  ASSERT_TRUE(cache.restore(1, prefix.get(), 44));
  ASSERT_TRUE(cache.restore(2, prefix.get(), 35));
  for (int64_t step = 0; step < 30; ++step) {  // a token at a time, round robin
    for (SeqId seq = 0; seq < 3; ++seq) write(cache, seq, {1000 * (seq + 1) + step});
  }
  write(cache, 3, id_range(500, 20));  // shares nothing
  std::vector<std::vector<int64_t>> expected{id_range(0, 44), id_range(0, 44), id_range(0, 35),
                                             id_range(500, 20)};
  for (SeqId seq = 0; seq < 3; ++seq) {
    for (int64_t step = 0; step < 30; ++step) {
      expected[static_cast<size_t>(seq)].push_back(1000 * (seq + 1) + step);
    }
  }
  std::mt19937 rng(14);
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    for (const int64_t queries : {int64_t{1}, int64_t{3}}) {
      const Array q = testing::random_array({4, 4, queries, 4}, rng);
      for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::lookback(20)}) {
        SCOPED_TRACE(::testing::Message()
                     << (kernels ? "kernels" : "BLAS") << ", " << queries << " queries");
        expect_rows_as_alone(cache, last_tokens(cache, {0, 1, 2, 3}, queries), q, mask, expected);
      }
    }
  }
}

TEST(PagedMixedTypes, RunsOfConvertedBlocksAreReadWhileTheyLive) {
  PagedKVCache cache({.block_tokens = kBlock, .blocks_per_chunk = 4});
  const auto write_mixed = [&](SeqId seq, const std::vector<int64_t>& ids) {
    Batch batch = Batch::uniform(1, static_cast<int64_t>(ids.size()), cache.offset(seq));
    batch.seq_ids = {seq};
    (void)cache.update(batch, kv.keys(ids), kv.values(ids).astype(DType::f16));
  };
  for (int64_t i = 0; i < 5; ++i) {  // blocks of the two sequences alternate in memory
    write_mixed(0, id_range(8 * i, 8));
    write_mixed(1, id_range(100 + 8 * i, 8));
  }
  std::mt19937 rng(13);
  for (const int64_t queries : {int64_t{1}, int64_t{3}}) {
    const Batch batch = last_tokens(cache, {0, 1}, queries);
    const Array q = testing::random_array({2, 4, queries, 4}, rng);
    const Array got = sdpa(batch, q, cache.view(batch), AttentionMask::causal(), 0.4f);
    for (int64_t row = 0; row < 2; ++row) {
      const std::vector<int64_t> ids = held(cache, batch.seq_id(row));
      const KVHistory full(kv.keys(ids), kv.values(ids).astype(DType::f16));
      const Array expected =
          sdpa(batch.row(row), q.slice(0, row, row + 1), full, AttentionMask::causal(), 0.4f);
      EXPECT_TRUE(testing::all_close(got.slice(0, row, row + 1).contiguous(), expected, 1e-5f))
          << queries << " queries, row " << row;
    }
  }
}

TEST(PagedErrors, BadOptionsAndForeignSnapshots) {
  EXPECT_TRUE(throws_error([] { PagedKVCache cache({.block_tokens = 0}); },
                           {"PagedKVCache", "block_tokens 0"}));
  PagedKVCache cache;
  write(cache, 0, id_range(0, 4));
  RotatingKVCache window(4);
  testing::write(window, kv, id_range(0, 4));
  SnapshotPtr foreign = window.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(foreign.get(), 4); },
                           {"PagedKVCache::restore", "not a PagedKVCache or KVCache snapshot"}));
  KVCache wide;
  testing::write(wide, TokenKV{.heads = 3}, id_range(0, 4));
  SnapshotPtr other = wide.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(other.get(), 4); }, {"H=3", "H=2"}));
  EXPECT_EQ(held(cache, 0), id_range(0, 4));
}

// Sizes whose pool chunk (one array of block_tokens * blocks_per_chunk tokens) could not exist
// are refused at construction, not by an overflowed shape at the first write.
TEST(PagedErrors, SizesWhoseChunkCannotExistAreRefused) {
  constexpr int64_t kMax = INT64_MAX;
  EXPECT_TRUE(throws_error([] { PagedKVCache cache({.block_tokens = int64_t{1} << 58}); },
                           {"PagedKVCache: block_tokens 288230376151711744 times "
                            "blocks_per_chunk 64 must be at most 2^60 tokens"}));
  EXPECT_TRUE(
      throws_error([] { PagedKVCache cache({.block_tokens = kMax, .blocks_per_chunk = 1}); },
                   {"PagedKVCache", "block_tokens 9223372036854775807", "2^60"}));
  EXPECT_TRUE(
      throws_error([] { PagedKVCache cache({.block_tokens = 1, .blocks_per_chunk = kMax}); },
                   {"PagedKVCache", "blocks_per_chunk 9223372036854775807"}));
  EXPECT_TRUE(
      throws_error([] { PagedKVCache cache({.block_tokens = 1, .blocks_per_chunk = 1LL << 31}); },
                   {"PagedKVCache", "blocks_per_chunk 2147483648", "block ids are int32"}));
  PagedKVCache largest({.block_tokens = int64_t{1} << 54});  // a chunk of exactly 2^60 tokens
  EXPECT_EQ(largest.block_tokens(), int64_t{1} << 54);
}

// A chunk of at most 2^60 tokens whose arrays would still hold more than 2^60 elements (2 heads
// of depth 4): the first write or restore fails, naming the call, before the pool takes a block,
// changing nothing — not the pool's stats, not the layout the next write may bring.
TEST(PagedErrors, AWriteWhoseChunkCannotExistChangesNothing) {
  PagedKVCache cache({.block_tokens = int64_t{1} << 54});
  KVCache contiguous;  // a restore of its snapshot would take the pool's first blocks too
  testing::write(contiguous, kv, id_range(0, 4));
  const SnapshotPtr snapshot = contiguous.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(1, snapshot.get(), 4); },
                           {"PagedKVCache::restore: a chunk of the pool", "H=2"}));
  EXPECT_TRUE(throws_error([&] { write(cache, 0, id_range(0, 4)); },
                           {"PagedKVCache::update: a chunk of the pool, 64 blocks of "
                            "18014398509481984 "
                            "tokens of B=1 H=2 D=4",
                            "more than 2^60 elements"}));
  const PagedKVCache::PoolStats stats = cache.pool_stats();
  EXPECT_EQ(stats.blocks, 0);
  EXPECT_EQ(stats.blocks_in_use, 0);
  EXPECT_EQ(stats.live_blocks, 0);
  EXPECT_EQ(cache.offset(0), 0);
  EXPECT_TRUE(cache.sequences().empty());
  EXPECT_EQ(cache.copy_stats().appended_bytes, 0);
  // Another layout is judged on its own chunk, not refused as differing from the failed one.
  const TokenKV wide{.heads = 3};
  const auto ids = id_range(0, 4);
  EXPECT_TRUE(throws_error(
      [&] { (void)cache.update(Batch::uniform(1, 4, 0), wide.keys(ids), wide.values(ids)); },
      {"PagedKVCache::update: a chunk of the pool", "H=3"}));
}

// A reset cache takes any layout once nothing uses the pool's blocks; while a snapshot holds
// some, the layout stays. The pool keeps its blocks for writes of the same layout (no memory
// allocated again); another layout replaces them. A write of no tokens fixes no layout.
TEST(PagedLayout, AResetCacheTakesAnyLayoutOnceNoBlockIsUsed) {
  PagedKVCache cache({.block_tokens = kBlock});
  const TokenKV wide{.heads = 3};
  const auto ids = id_range(0, 4);
  const auto write_wide = [&] {
    (void)cache.update(Batch::uniform(1, 4, 0), wide.keys(ids), wide.values(ids));
  };
  Batch nothing = Batch::uniform(1, 4, 0);
  nothing.seq_query_lens = {0};  // a row of padding only
  (void)cache.update(nothing, wide.keys(ids), wide.values(ids));
  EXPECT_EQ(cache.pool_stats().blocks, 0);
  write(cache, 0, ids);  // H=2: the padding fixed no layout
  const int64_t blocks = cache.pool_stats().blocks;
  cache.reset();
  (void)cache.update(nothing, wide.keys(ids), wide.values(ids));  // nor drops the kept blocks
  EXPECT_EQ(cache.pool_stats().blocks, blocks);
  write(cache, 0, ids);
  SnapshotPtr kept = cache.snapshot(0);
  cache.reset();
  EXPECT_TRUE(throws_error(write_wide, {"PagedKVCache::update", "H=3", "H=2"}));
  kept.reset();
  cache.reset();
  write(cache, 0, ids);  // the same layout: the kept blocks serve
  EXPECT_EQ(cache.pool_stats().blocks, blocks);
  EXPECT_EQ(cache.pool_stats().blocks_in_use, 1);
  cache.reset();
  write_wide();  // another: it replaces them
  EXPECT_EQ(cache.offset(), 4);
  EXPECT_EQ(cache.pool_stats().blocks_in_use, 1);
  const KVHistory history = cache.view(Batch{}).contiguous();
  EXPECT_EQ(history.keys().dim(1), 3);
  // reset(seq) too, once the last sequence using blocks lets go; a restore as well.
  cache.reset(0);
  write(cache, 0, ids);
  EXPECT_EQ(held(cache, 0), ids);
  KVCache contiguous;
  testing::write(contiguous, wide, ids);
  const SnapshotPtr other = contiguous.snapshot(0);
  cache.reset(0);
  ASSERT_TRUE(cache.restore(1, other.get(), 4));
  EXPECT_EQ(cache.view(Batch::rows({{1, 4, {}}})).contiguous().keys().dim(1), 3);
}

// A snapshot of several batch rows (B=2, as a snapshot file may hold) does not fit a paged
// sequence (one row): refused naming the rows, before the pool takes its layout — a one-row
// write still fits the fresh cache afterwards.
TEST(PagedLayout, ASnapshotOfSeveralRowsIsRefusedAndFixesNoLayout) {
  PagedKVCache cache({.block_tokens = kBlock});
  const auto ids = id_range(0, 4);
  const SnapshotPtr snapshot = detail::make_snapshot(
      {detail::SnapshotRecord::Kind::kv, kv.keys(ids, 2), kv.values(ids, 2), 0, 4}, "test");
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(snapshot.get(), 4); },
                           {"PagedKVCache::restore", "2 batch rows", "B=1"}));
  EXPECT_TRUE(cache.sequences().empty());
  write(cache, 0, ids);
  EXPECT_EQ(held(cache, 0), ids);
}

}  // namespace
}  // namespace kvsnap::paged_kv_cache_test
