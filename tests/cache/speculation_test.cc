// Speculation rounds over every cache kind: after a verify forward of 1 + k tokens, accepting
// any a in 0..k leaves every layer exactly where recomputing the accepted sequence from scratch
// would, with no state copied; errors leave everything unchanged.
#include <gtest/gtest.h>
#include <kvsnap/speculation.h>

#include <tuple>

#include "cache/snapshot_record.h"
#include "support/hybrid_stack.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::StackOptions;
using Tokens = std::vector<int32_t>;

using testing::concat;
using testing::range;

// (paged attention, window size): a window of 6 has evicted tokens (captures), 64 has not
// (rewinds).
class RollbackToEveryLength : public ::testing::TestWithParam<std::tuple<bool, int64_t>> {};

TEST_P(RollbackToEveryLength, EqualsRecomputation) {
  const auto [paged, window] = GetParam();
  constexpr int64_t k = 4;
  for (int64_t accepted = 0; accepted <= k; ++accepted) {
    SCOPED_TRACE(::testing::Message() << "accepted " << accepted);
    HybridStack stack(StackOptions{.window = window, .paged = paged});
    Tokens sequence = range(1, 20);
    ASSERT_TRUE(stack.forward_and_check(sequence, sequence));  // a chunk
    for (int32_t t : {30, 31}) {                               // decode steps: a rotated ring
      sequence.push_back(t);
      ASSERT_TRUE(stack.forward_and_check(Tokens{t}, sequence));
    }
    const CopyStats before_window = stack.window.copy_stats();
    Speculation round(stack.layers());
    round.begin(k);
    EXPECT_EQ(round.capturing_layers(), window < 30 ? 2 : 1);  // recurrent (+ evicted window)
    const Tokens verify = {40, 41, 42, 43, 44};                // the last token, then k drafts
    ASSERT_TRUE(stack.forward_and_check(verify, concat(sequence, verify)));
    round.accept(accepted);
    EXPECT_FALSE(round.open());
    EXPECT_EQ(round.capturing_layers(), 0);
    // Every layer stands at start + accepted + 1, holding exactly the accepted tokens.
    for (Cache* layer : stack.layers()) {
      if (layer != nullptr) {
        EXPECT_EQ(layer->offset(), 22 + accepted + 1);
      }
    }
    sequence = concat(sequence, Tokens(verify.begin(), verify.begin() + accepted + 1));
    // Nothing was copied back: a rewind or the cache's own lazy / shared state.
    EXPECT_EQ(stack.window.copy_stats().restored_bytes, before_window.restored_bytes);
    EXPECT_EQ(stack.recurrent.copy_stats().restored_bytes, 0);
    // The next tokens, decode and chunk, see exactly the accepted history.
    const Tokens next = {50};
    sequence = concat(sequence, next);
    ASSERT_TRUE(stack.forward_and_check(next, sequence));
    const Tokens chunk = {51, 52, 53};
    sequence = concat(sequence, chunk);
    ASSERT_TRUE(stack.forward_and_check(chunk, sequence));
    EXPECT_EQ(round.stats().accepted, accepted);
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, RollbackToEveryLength,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(6, 64)));

TEST(Speculation, ConsecutiveRoundsEqualRecomputation) {
  HybridStack stack(StackOptions{.window = 5});
  Tokens sequence = range(1, 9);
  ASSERT_TRUE(stack.forward_and_check(sequence, sequence));
  Speculation round(stack.layers());
  int32_t next = 100;
  for (int64_t r = 0; r < 12; ++r) {
    const int64_t k = r % 4;  // 0..3 drafts
    const int64_t accepted = (r * 7) % (k + 1);
    Tokens verify;
    for (int64_t i = 0; i <= k; ++i) verify.push_back(next++);
    round.begin(k);
    ASSERT_TRUE(stack.forward_and_check(verify, concat(sequence, verify)));
    round.accept(accepted);
    sequence.insert(sequence.end(), verify.begin(), verify.begin() + accepted + 1);
  }
  const Tokens tail = {7, 8};
  ASSERT_TRUE(stack.forward_and_check(tail, concat(sequence, tail)));
  EXPECT_EQ(round.stats().rounds, 12);
}

TEST(Speculation, CapturesAreReleasedWhenTheRoundEnds) {
  HybridStack stack(StackOptions{.window = 4});
  const Tokens prompt = range(1, 10);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  Speculation round(stack.layers());
  round.begin(3);
  // The schedule belongs to the round: nobody else can schedule now.
  EXPECT_THROW(stack.recurrent.prepare_snapshots(std::vector<int64_t>{12}), Error);
  const Tokens verify = {20, 21, 22, 23};
  ASSERT_TRUE(stack.forward_and_check(verify, concat(prompt, verify)));
  round.accept(1);
  // Released: a new schedule is accepted, and nothing was left for the caches to hold.
  stack.recurrent.prepare_snapshots(std::vector<int64_t>{12});
  EXPECT_EQ(stack.recurrent.take_snapshots().size(), 1u);
}

// A round ends where a batch can still place its tokens: one whose verify forward would pass
// position 2^31 - 1 is refused (here a layer restored near the end of the positions).
TEST(Speculation, ARoundPastTheLastPositionIsRefused) {
  const testing::RecurrentLayer layer;
  RecurrentCache cache = layer.make_cache();
  layer.forward(cache, testing::id_range(0, 3));
  const SnapshotPtr at_three = cache.snapshot(0);
  detail::SnapshotRecord record = *detail::snapshot_record(*at_three);
  const int64_t late = INT32_MAX - 10;
  record.from = record.to = late;
  const SnapshotPtr late_snapshot = detail::make_snapshot(record, "test");
  ASSERT_TRUE(cache.restore(late_snapshot.get(), late));
  Speculation round({&cache});
  EXPECT_TRUE(testing::throws_error(
      [&] { round.begin(10); },
      {"Speculation::begin: 10 drafts from offset 2147483637 would end at 2147483648"}));
  EXPECT_FALSE(round.open());
  round.begin(9);  // its verify forward ends at 2^31 - 1
  EXPECT_TRUE(round.open());
}

TEST(Speculation, MisuseThrowsAndChangesNothing) {
  HybridStack stack(StackOptions{.window = 4});
  const Tokens prompt = range(1, 10);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  Speculation round(stack.layers());
  EXPECT_THROW(round.begin(-1), Error);
  EXPECT_TRUE(
      testing::throws_error([&] { round.begin(Speculation::kMaxDrafts + 1); },
                            {"Speculation::begin: drafts 1048577 must be in [0, 1048576]"}));
  EXPECT_TRUE(
      testing::throws_error([&] { round.begin(INT64_MAX); }, {"drafts 9223372036854775807"}));
  EXPECT_FALSE(round.open());
  EXPECT_THROW(round.accept(0), Error);  // no round
  round.begin(2);
  EXPECT_THROW(round.begin(2), Error);  // one at a time
  // Before the verify forward the layers are not at start + 3.
  try {
    round.accept(1);
    ADD_FAILURE() << "accept before the verify forward";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("leaves every layer at 13"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(round.open());
  const Tokens verify = {20, 21, 22};
  ASSERT_TRUE(stack.forward_and_check(verify, concat(prompt, verify)));
  EXPECT_THROW(round.accept(3), Error);  // more than the drafts
  EXPECT_THROW(round.accept(-1), Error);
  EXPECT_EQ(stack.offset(), 13);  // unchanged by the refused calls
  round.accept(2);                // every draft confirmed: nothing moves
  EXPECT_EQ(stack.offset(), 13);
  const Tokens tail = {5};
  ASSERT_TRUE(stack.forward_and_check(tail, concat(concat(prompt, verify), tail)));
}

TEST(Speculation, LayersAtDifferentOffsetsAreRefused) {
  HybridStack stack(StackOptions{.window = 4});
  const Tokens prompt = range(1, 10);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  ASSERT_TRUE(stack.attention().restore(nullptr, 8));
  Speculation round(stack.layers());
  EXPECT_THROW(round.begin(2), Error);
  EXPECT_FALSE(round.open());
  // Nothing was scheduled on any layer.
  stack.recurrent.prepare_snapshots(std::vector<int64_t>{10});
  EXPECT_EQ(stack.recurrent.take_snapshots().size(), 1u);
}

TEST(Speculation, CancelLeavesTheLayersWhereTheyAre) {
  HybridStack stack(StackOptions{.window = 4});
  const Tokens prompt = range(1, 10);
  ASSERT_TRUE(stack.forward_and_check(prompt, prompt));
  {
    Speculation round(stack.layers());
    round.begin(2);
  }  // the destructor cancels
  stack.recurrent.prepare_snapshots(std::vector<int64_t>{10});
  EXPECT_EQ(stack.recurrent.take_snapshots().size(), 1u);
  EXPECT_EQ(stack.offset(), 10);
}

int64_t copied(const std::vector<Cache*>& layers) {
  int64_t bytes = 0;
  for (Cache* layer : layers) {
    const CopyStats s = layer->copy_stats();
    bytes += s.growth_bytes + s.materialized_bytes + s.restored_bytes + s.snapshot_bytes;
  }
  return bytes;
}

// Rollback is a cursor move whatever the context: begin and accept copy no byte of state, at
// 64 tokens as at 8192, for every accepted length.
TEST(Speculation, RollbackCopiesNothingWhateverTheContext) {
  const testing::TokenKV kv{.heads = 2, .depth = 8};
  for (int64_t context : {64, 8192}) {
    KVCache attention;
    RotatingKVCache window(16);
    RecurrentCache recurrent(3, 8, 2, 4, 4);
    const std::vector<Cache*> layers = {&attention, &window, &recurrent};
    testing::write(attention, kv, testing::id_range(0, context));
    testing::write(window, kv, testing::id_range(0, context));
    const Batch all = Batch::uniform(1, context, 0);
    (void)recurrent.get(all, DType::f32);
    const Array conv = Array::zeros(DType::f32, {1, 3, 8});
    const Array delta = Array::zeros(DType::f32, {1, 2, 4, 4});
    recurrent.put(all, std::span(&conv, 1), std::span(&delta, 1));
    Speculation round(layers);
    constexpr int64_t k = 4;
    const std::vector<Array> convs(k + 1, conv), deltas(k + 1, delta);
    for (int64_t accepted = 0; accepted <= k; ++accepted) {
      const int64_t start = attention.offset();
      round.begin(k);
      const std::vector<int64_t> ids = testing::id_range(start, k + 1);
      Batch batch = Batch::uniform(1, k + 1, start);
      (void)attention.update(batch, kv.keys(ids), kv.values(ids));
      (void)window.update(batch, kv.keys(ids), kv.values(ids));
      (void)recurrent.get(batch, DType::f32);
      recurrent.put(batch, convs, deltas);
      const int64_t before = copied(layers);
      round.accept(accepted);
      EXPECT_EQ(copied(layers), before) << "context " << context << ", accepted " << accepted;
      EXPECT_EQ(recurrent.offset(), start + accepted + 1);
      EXPECT_EQ(window.offset(), start + accepted + 1);
    }
    EXPECT_EQ(round.stats().restores, 2 * k);  // window and recurrent, all but a == k
  }
}

}  // namespace
}  // namespace kvsnap
