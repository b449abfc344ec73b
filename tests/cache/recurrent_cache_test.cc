#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include "cache/snapshot_record.h"
#include "support/cache_support.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::all_close;
using testing::id_range;
using testing::RecurrentLayer;
using testing::throws_error;

const RecurrentLayer layer;

std::span<const int64_t> part(const std::vector<int64_t>& ids, size_t from, size_t to) {
  return std::span<const int64_t>(ids).subspan(from, to - from);
}

TEST(RecurrentCache, GetZeroInitializesOnFirstUse) {
  RecurrentCache cache = layer.make_cache();
  EXPECT_TRUE(cache.state().empty());
  const RecurrentHistory history = cache.get(Batch::uniform(1, 5, 0), DType::bf16);
  EXPECT_EQ(history.conv_state().shape(), (Shape{1, 3, 6}));
  EXPECT_EQ(history.conv_state().dtype(), DType::bf16);
  EXPECT_EQ(history.delta_state().shape(), (Shape{1, 2, 3, 4}));
  EXPECT_EQ(history.delta_state().dtype(), DType::f32);  // delta state is always f32
  for (float v : history.delta_state().to_floats()) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(cache.offset(), 0);
  // Two rows: two sequences, one state each.
  const RecurrentHistory rows = cache.get(Batch::uniform(2, 5, 0), DType::bf16);
  ASSERT_EQ(rows.rows(), 2);
  EXPECT_EQ(rows.row(1).conv_state().shape(), (Shape{1, 3, 6}));
  EXPECT_TRUE(rows.row(0).conv_state().shares_storage(history.conv_state()));
  EXPECT_FALSE(rows.row(1).conv_state().shares_storage(history.conv_state()));
}

TEST(RecurrentCache, PutAdvancesAndTheEndStateBecomesLive) {
  RecurrentCache cache = layer.make_cache();
  const auto ids = id_range(10, 7);
  layer.forward(cache, ids);
  EXPECT_EQ(cache.offset(), 7);
  std::pair<Array, Array> expected;
  layer.reference(ids, &expected);
  EXPECT_TRUE(all_close(cache.state()[0], expected.first, 0.0f));
  EXPECT_TRUE(all_close(cache.state()[1], expected.second, 0.0f));
}

TEST(RecurrentCache, ChunkedForwardsEqualOneForward) {
  RecurrentCache cache = layer.make_cache();
  const auto ids = id_range(0, 20);
  const auto whole = layer.reference(ids);
  size_t start = 0;
  for (size_t stop : {1, 4, 5, 13, 20}) {
    const auto out = layer.forward(cache, part(ids, start, stop));
    EXPECT_TRUE(all_close(out.delta, whole.delta.slice(1, start, stop), 1e-5f));
    EXPECT_TRUE(all_close(out.conv, whole.conv.slice(1, start, stop), 1e-5f));
    start = stop;
  }
}

TEST(RecurrentCache, SnapshotSplitsAreTheScheduledInteriorPoints) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 2));
  EXPECT_TRUE(cache.snapshot_splits(10).empty());
  const std::vector<int64_t> offsets{2, 5, 7, 12};
  cache.prepare_snapshots(offsets);
  EXPECT_EQ(cache.snapshot_splits(10), (std::vector<int64_t>{3, 5}));  // 5 and 7, relative to 2
  EXPECT_EQ(cache.snapshot_splits(5), (std::vector<int64_t>{3}));      // 7 is the end: not interior
  EXPECT_EQ(cache.snapshot_splits(3), (std::vector<int64_t>{}));
}

TEST(RecurrentCache, SegmentedCaptureEqualsTheUnsegmentedState) {
  RecurrentCache cache = layer.make_cache();
  const auto ids = id_range(100, 11);
  const std::vector<int64_t> offsets{0, 3, 4, 9, 11};
  cache.prepare_snapshots(offsets);
  layer.forward(cache, ids);  // one batched forward, stopping at 3, 4 and 9
  auto captures = cache.take_snapshots();
  ASSERT_EQ(captures.size(), offsets.size());
  EXPECT_EQ(captures[0], nullptr);  // the empty state at offset 0
  for (size_t i = 1; i < offsets.size(); ++i) {
    const int64_t at = offsets[i];
    ASSERT_NE(captures[i], nullptr);
    EXPECT_EQ(captures[i]->to(), at);
    std::pair<Array, Array> expected;
    layer.reference(part(ids, 0, at), &expected);
    RecurrentCache fresh = layer.make_cache();
    ASSERT_TRUE(fresh.restore(captures[i].get(), at));
    EXPECT_TRUE(all_close(fresh.state()[0], expected.first, 1e-5f)) << at;
    EXPECT_TRUE(all_close(fresh.state()[1], expected.second, 1e-5f)) << at;
    // Continuing from the capture equals the whole sequence computed at once.
    const auto more = id_range(500, 4);
    std::vector<int64_t> all(ids.begin(), ids.begin() + at);
    all.insert(all.end(), more.begin(), more.end());
    const auto out = layer.forward(fresh, more);
    EXPECT_TRUE(all_close(out.delta, layer.reference(all).delta.slice(1, at, at + 4), 1e-5f));
  }
}

TEST(RecurrentCache, CaptureAtTheCurrentOffsetHoldsTheLiveState) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 5));
  const std::vector<int64_t> offsets{5};
  cache.prepare_snapshots(offsets);
  auto captures = cache.take_snapshots();
  ASSERT_NE(captures[0], nullptr);
  layer.forward(cache, id_range(5, 3));
  ASSERT_TRUE(cache.restore(captures[0].get(), 5));
  std::pair<Array, Array> expected;
  layer.reference(id_range(0, 5), &expected);
  EXPECT_TRUE(all_close(cache.state()[1], expected.second, 0.0f));
}

TEST(RecurrentCache, SnapshotAndRestoreCopyNothing) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 5));
  const int64_t bytes = live_bytes();
  const int64_t allocations = allocation_count();
  SnapshotPtr s = cache.snapshot(0);
  EXPECT_EQ(live_bytes(), bytes);
  EXPECT_EQ(allocation_count(), allocations);
  EXPECT_EQ(s->size(), 3 * 6 * 4 + 2 * 3 * 4 * 4);
  EXPECT_FALSE(s->is_lazy());
  layer.forward(cache, id_range(5, 2));
  const int64_t before = live_bytes();
  const int64_t allocations_before_restore = allocation_count();
  ASSERT_TRUE(cache.restore(s.get(), 5));
  EXPECT_LE(live_bytes(), before);  // the replaced state is released, nothing new is held
  EXPECT_EQ(allocation_count(), allocations_before_restore);  // and nothing was copied
  EXPECT_EQ(cache.offset(), 5);
}

TEST(RecurrentCache, RestoresOnlyToTheExactOffset) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 6));
  SnapshotPtr s = cache.snapshot(0);
  layer.forward(cache, id_range(6, 2));
  EXPECT_FALSE(cache.restore(s.get(), 5));
  EXPECT_FALSE(cache.restore(s.get(), 7));
  EXPECT_FALSE(cache.restore(nullptr, 7));  // a recurrent state cannot be rewound
  EXPECT_TRUE(cache.restore(nullptr, 8));   // ... except to where it is
  EXPECT_EQ(cache.offset(), 8);
  EXPECT_TRUE(cache.restore(s.get(), 6));
  EXPECT_EQ(cache.offset(), 6);
}

TEST(RecurrentCache, SnapshotAtOffsetZeroIsNull) {
  RecurrentCache cache = layer.make_cache();
  EXPECT_EQ(cache.snapshot(0), nullptr);
  (void)cache.get(Batch::uniform(1, 1, 0), DType::f32);
  EXPECT_EQ(cache.snapshot(0), nullptr);
}

TEST(RecurrentCache, MergeKeepsTheChildAndSplitKeepsTheWhole) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 3));
  SnapshotPtr parent = cache.snapshot(0);
  layer.forward(cache, id_range(3, 3));
  SnapshotPtr child = cache.snapshot(0);
  Snapshot* raw = child.get();
  SnapshotPtr merged = cache.merge(std::move(parent), std::move(child));
  EXPECT_EQ(merged.get(), raw);
  auto [before, after] = cache.split(std::move(merged), 4);
  EXPECT_EQ(before, nullptr);
  EXPECT_EQ(after.get(), raw);
}

// merge refuses what restore would: another kind, another cache's shapes, or two activations.
TEST(RecurrentCacheErrors, MergeRefusesSnapshotsOfOtherShapes) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 3));
  const RecurrentLayer wider{.conv_dim = 8};
  RecurrentCache other = wider.make_cache();
  wider.forward(other, id_range(0, 3));
  EXPECT_TRUE(throws_error([&] { (void)cache.merge(cache.snapshot(0), other.snapshot(0)); },
                           {"RecurrentCache::merge", "does not fit this cache"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.merge(other.snapshot(0), cache.snapshot(0)); },
                           {"RecurrentCache::merge", "does not fit this cache"}));
  const RecurrentLayer half{.activation = DType::bf16};
  RecurrentCache bf16 = half.make_cache();
  half.forward(bf16, id_range(0, 3));
  EXPECT_TRUE(throws_error([&] { (void)cache.merge(cache.snapshot(0), bf16.snapshot(0)); },
                           {"RecurrentCache::merge", "activations differ", "f32", "bf16"}));
  EXPECT_NE(cache.merge(nullptr, cache.snapshot(0)), nullptr);
}

TEST(RecurrentCache, OnePutServesRowsOfDifferentSequences) {
  RecurrentCache cache = layer.make_cache(), alone0 = layer.make_cache(),
                 alone5 = layer.make_cache();
  layer.forward(cache, id_range(0, 3));
  layer.forward(alone0, id_range(0, 3));
  // Sequence 0 decodes two tokens at 3; sequence 5 prefills four at 0, captured at 2.
  const std::vector<int64_t> capture_at{2};
  cache.prepare_snapshots(5, capture_at);
  Batch batch = Batch::uniform(2, 4, 0);
  batch.seq_ids = {0, 5};
  batch.seq_offsets = {3, 0};
  batch.seq_query_lens = {2, 4};
  const RecurrentHistory history = cache.get(batch, DType::f32);
  ASSERT_EQ(history.rows(), 2);
  const std::vector<std::vector<int64_t>> ids{id_range(10, 2), id_range(20, 4)};
  std::vector<RecurrentStates> rows;
  for (int64_t b = 0; b < 2; ++b) {
    const std::vector<int64_t> splits = cache.snapshot_splits(batch.seq_id(b), ids[b].size());
    Conv1dResult conv;
    GatedDeltaResult delta;
    layer.run(ids[b], history.row(b).conv_state(), history.row(b).delta_state(), splits, &conv,
              &delta);
    rows.push_back({conv.tails, delta.states});
  }
  EXPECT_EQ(rows[1].conv.size(), 2u);  // the split at 2, then the end
  cache.put(batch, rows);
  layer.forward(alone0, ids[0]);
  layer.forward(alone5, id_range(20, 2));
  std::vector<SnapshotPtr> captured = cache.take_snapshots(5);
  ASSERT_EQ(captured.size(), 1u);
  RecurrentCache at2 = layer.make_cache();
  ASSERT_TRUE(at2.restore(captured[0].get(), 2));
  EXPECT_TRUE(all_close(at2.state()[1], alone5.state()[1], 0.0f));
  layer.forward(alone5, id_range(22, 2));
  EXPECT_EQ(cache.offset(0), 5);
  EXPECT_EQ(cache.offset(5), 4);
  EXPECT_TRUE(all_close(cache.state(0)[1], alone0.state()[1], 0.0f));
  EXPECT_TRUE(all_close(cache.state(5)[1], alone5.state()[1], 0.0f));
  // Rows are checked before any state changes: a bad second row changes neither sequence.
  Batch next = Batch::uniform(2, 1, 0);
  next.seq_ids = {0, 5};
  next.seq_offsets = {5, 4};
  const std::vector<RecurrentStates> bad{rows[0], RecurrentStates{}};
  EXPECT_TRUE(throws_error([&] { cache.put(next, bad); }, {"RecurrentCache::put", "row 1"}));
  EXPECT_EQ(cache.offset(0), 5);
}

// A row of no tokens leaves its sequence as it is: the states given for it are checked, not
// taken (the state at an offset is the one its tokens made), and a fresh sequence stays empty.
TEST(RecurrentCache, ARowOfNoTokensLeavesItsSequenceAsItIs) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 3));
  const std::vector<Array> before = cache.state(0);
  Batch batch = Batch::uniform(2, 1, 0);
  batch.seq_ids = {0, 7};
  batch.seq_offsets = {3, 0};
  batch.seq_query_lens = {0, 0};
  const std::vector<Array> conv{
      Array::from_floats(std::vector<float>(layer.conv_tail * layer.conv_dim, 9.0f),
                         {1, layer.conv_tail, layer.conv_dim})};
  const std::vector<Array> delta{Array::from_floats(
      std::vector<float>(layer.value_heads * layer.value_depth * layer.key_depth, 9.0f),
      {1, layer.value_heads, layer.value_depth, layer.key_depth})};
  cache.put(batch, std::vector<RecurrentStates>(2, RecurrentStates{conv, delta}));
  EXPECT_EQ(cache.offset(0), 3);
  EXPECT_TRUE(all_close(cache.state(0)[0], before[0], 0.0f));
  EXPECT_TRUE(all_close(cache.state(0)[1], before[1], 0.0f));
  EXPECT_EQ(cache.sequences(), std::vector<SeqId>{0});  // no sequence 7 made
  EXPECT_EQ(cache.offset(7), 0);
  EXPECT_EQ(cache.state_dtype(7), std::nullopt);
  EXPECT_EQ(cache.snapshot(7, 0), nullptr);
  // Still checked: states of another shape are refused for a row of no tokens too.
  const std::vector<RecurrentStates> bad(2, RecurrentStates{delta, conv});
  EXPECT_TRUE(throws_error([&] { cache.put(batch, bad); }, {"RecurrentCache::put"}));
}

TEST(RecurrentCache, ResetAllowsANewDtype) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 3));
  cache.reset();
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_TRUE(cache.state().empty());
  EXPECT_EQ(cache.get(Batch::uniform(1, 1, 0), DType::f16).conv_state().dtype(), DType::f16);
}

TEST(RecurrentCacheErrors, RowsAtTheWrongOffsetOrDtypeChangesAreRefused) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 3));
  // Row 1 is sequence 1, which is at offset 0.
  EXPECT_TRUE(throws_error([&] { (void)cache.get(Batch::uniform(2, 1, 3), DType::f32); },
                           {"RecurrentCache::get", "row 1 starts at 3", "sequence 1"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.get(Batch::uniform(1, 1, 3), DType::bf16); },
                           {"RecurrentCache::get", "bf16", "f32"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.get(Batch::uniform(1, 1, 2), DType::f32); },
                           {"RecurrentCache::get", "starts at 2", "offset 3"}));
  EXPECT_EQ(cache.offset(), 3);
  EXPECT_TRUE(cache.state(1).empty());
}

TEST(RecurrentCacheErrors, MismatchedStateCountsAndShapes) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 3));
  const auto before = cache.state();
  const std::vector<int64_t> offsets{5};
  cache.prepare_snapshots(offsets);  // one interior split in a 4-token forward
  const Batch batch = Batch::uniform(1, 4, 3);
  const auto h = cache.get(batch, DType::f32);
  const std::vector<Array> one_conv{h.conv_state()}, one_delta{h.delta_state()};
  EXPECT_TRUE(throws_error(
      [&] { cache.put(batch, one_conv, one_delta); },
      {"RecurrentCache::put", "got 1 conv and 1 delta", "expected 2", "1 scheduled split"}));
  const std::vector<Array> bad_conv{Array::zeros(DType::f32, {1, 2, 6}), h.conv_state()};
  const std::vector<Array> two_delta{h.delta_state(), h.delta_state()};
  EXPECT_TRUE(throws_error([&] { cache.put(batch, bad_conv, two_delta); },
                           {"conv state f32[1, 2, 6]", "f32[1, 3, 6]"}));
  const std::vector<Array> two_conv{h.conv_state(), h.conv_state()};
  const std::vector<Array> bad_delta{h.delta_state(), Array::zeros(DType::bf16, {1, 2, 3, 4})};
  EXPECT_TRUE(throws_error([&] { cache.put(batch, two_conv, bad_delta); },
                           {"delta state bf16[1, 2, 3, 4]", "f32[1, 2, 3, 4]"}));
  EXPECT_EQ(cache.offset(), 3);
  EXPECT_TRUE(cache.state()[1].shares_storage(before[1]));
  EXPECT_TRUE(throws_error([&] { (void)cache.take_snapshots(); }, {"offset 5 not reached"}));
}

TEST(RecurrentCacheErrors, AStateOfAnotherRowCountOrDtypeIsRefused) {
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, id_range(0, 2));
  const auto state = cache.state();
  // A state of two rows, as an older file could hold it: a sequence holds one.
  const Array conv = Array::zeros(DType::f32, {2, layer.conv_tail, layer.conv_dim});
  const Array delta =
      Array::zeros(DType::f32, {2, layer.value_heads, layer.value_depth, layer.key_depth});
  SnapshotPtr s = detail::make_recurrent_snapshot(conv, delta, 1);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(s.get(), 1); },
                           {"RecurrentCache::restore", "f32[2, 3, 6]", "[1, 3, 6]"}));
  EXPECT_EQ(cache.offset(), 2);
  EXPECT_TRUE(cache.state()[1].shares_storage(state[1]));
  // Another activation dtype.
  RecurrentCache half = layer.make_cache();
  const Batch one = Batch::uniform(1, 1, 0);
  (void)half.get(one, DType::f16);
  half.put(one, std::vector<Array>{Array::zeros(DType::f16, {1, layer.conv_tail, layer.conv_dim})},
           std::vector<Array>{delta.slice(0, 0, 1).contiguous()});
  SnapshotPtr h = half.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(h.get(), 1); }, {"f16", "f32"}));
  EXPECT_EQ(cache.offset(), 2);
}

TEST(RecurrentCacheErrors, ForeignSnapshotsAndBadConstruction) {
  EXPECT_TRUE(
      throws_error([] { RecurrentCache cache(3, 0, 1, 1, 1); }, {"RecurrentCache", "conv_dim 0"}));
  RecurrentCache cache = layer.make_cache();
  KVCache kv;
  testing::write(kv, testing::TokenKV{}, id_range(0, 2));
  SnapshotPtr foreign = kv.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(foreign.get(), 2); },
                           {"RecurrentCache::restore", "not a RecurrentCache snapshot"}));
  RecurrentCache other(2, 6, 2, 3, 4);  // a different conv tail
  layer.forward(cache, id_range(0, 2));
  SnapshotPtr s = cache.snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)other.restore(s.get(), 2); },
                           {"RecurrentCache::restore", "f32[1, 3, 6]", "[1, 2, 6]"}));
}

}  // namespace
}  // namespace kvsnap
