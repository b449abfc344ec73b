#include <gtest/gtest.h>
#include <kvsnap/attention.h>
#include <kvsnap/batch.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::throws_error;

TEST(Batch, SingleRowHoldsTokensAndOffset) {
  const auto batch = Batch::single(std::vector<int32_t>{5, 6, 7}, 10);
  EXPECT_EQ(batch.batch_size(), 1);
  EXPECT_EQ(batch.length(), 3);
  EXPECT_EQ(batch.seq_offsets, (std::vector<int32_t>{10}));
  EXPECT_EQ(batch.seq_query_lens, (std::vector<int32_t>{3}));
  EXPECT_EQ(batch.input_ids.to_ints(), (std::vector<int32_t>{5, 6, 7}));
  EXPECT_NO_THROW(batch.validate("test"));
}

TEST(Batch, LengthWithoutInputIdsIsTheLongestQuery) {
  Batch batch;
  batch.seq_offsets = {0, 4};
  batch.seq_query_lens = {2, 5};
  EXPECT_EQ(batch.length(), 5);
  EXPECT_NO_THROW(batch.validate("test"));
}

TEST(Batch, ValidateRejectsInconsistentRows) {
  Batch batch = Batch::uniform(2, 4, 0);
  batch.seq_query_lens.pop_back();
  EXPECT_TRUE(throws_error([&] { batch.validate("KVCache::update"); },
                           {"KVCache::update", "2 seq_offsets", "1 seq_query_lens"}));
  batch = Batch::uniform(2, 4, 0);
  batch.seq_query_lens[1] = 5;
  EXPECT_TRUE(throws_error([&] { batch.validate("f"); }, {"row 1", "query length 5", "<= 4"}));
  batch = Batch::uniform(2, 4, 0);
  batch.seq_offsets[0] = -1;
  EXPECT_TRUE(throws_error([&] { batch.validate("f"); }, {"row 0", "offset -1"}));
  batch = Batch::uniform(2, 4, 0);
  batch.input_ids = Array::zeros(DType::f32, {2, 4});
  EXPECT_TRUE(throws_error([&] { batch.validate("f"); }, {"input_ids", "i32[B, L]"}));
  EXPECT_TRUE(throws_error([&] { Batch{}.validate("f"); }, {"no rows"}));
}

TEST(Batch, FactoriesRefuseOffsetsAndLengthsOutsideInt32) {
  const int64_t too_far = (int64_t{1} << 32) + 5;  // was cast to offset 5
  EXPECT_TRUE(throws_error([&] { (void)Batch::single(std::vector<int32_t>{1}, too_far); },
                           {"Batch::single", "offset 4294967301", "does not fit in int32"}));
  EXPECT_TRUE(throws_error([&] { (void)Batch::uniform(1, 2, -too_far); },
                           {"Batch::uniform", "offset -4294967301", "int32"}));
  EXPECT_TRUE(throws_error([&] { (void)Batch::uniform(1, too_far, 0); },
                           {"Batch::uniform", "length 4294967301", "int32"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Batch::rows({{0, 4, {1}}, {1, too_far, {2}}});
      },
      {"Batch::rows", "row 1 offset 4294967301", "does not fit in int32"}));
  const int32_t last = std::numeric_limits<int32_t>::max();
  EXPECT_EQ(Batch::single(std::vector<int32_t>{1}, last).seq_offsets, (std::vector<int32_t>{last}));
  EXPECT_EQ(Batch::rows({{3, last, {1, 2}}}).seq_offsets, (std::vector<int32_t>{last}));
  // Rows are sequences 0..rows-1 (int32 ids) and no length is negative.
  EXPECT_TRUE(throws_error([&] { (void)Batch::uniform(int64_t{1} << 31, 0, 0); },
                           {"Batch::uniform", "2147483648 rows", "2^31 - 1"}));
  EXPECT_TRUE(throws_error([&] { (void)Batch::uniform(-1, 1, 0); }, {"Batch::uniform", "-1 rows"}));
  EXPECT_TRUE(
      throws_error([&] { (void)Batch::uniform(2, -3, 0); }, {"Batch::uniform", "length -3"}));
  EXPECT_EQ(Batch::uniform(0, 4, 0).batch_size(), 0);
}

// A row outside the batch (or a ragged history) is refused, whether or not input_ids are set.
TEST(Batch, RowsOutsideTheBatchOrHistoryAreRefused) {
  Batch ids = Batch::rows({{3, 0, {1, 2}}, {5, 4, {7}}});
  Batch bare = ids;
  bare.input_ids = Array();
  for (const Batch* b : {&ids, &bare}) {
    EXPECT_TRUE(throws_error([&] { (void)b->row(2); }, {"Batch::row", "row 2 of a batch of 2"}));
    EXPECT_TRUE(throws_error([&] { (void)b->row(-1); }, {"Batch::row", "row -1"}));
    EXPECT_TRUE(throws_error([&] { (void)b->seq_id(2); }, {"Batch::seq_id", "row 2"}));
    EXPECT_EQ(b->row(1).seq_ids, (std::vector<int32_t>{5}));
  }
  Batch short_lengths = bare;  // one length for two rows: not read past
  short_lengths.seq_query_lens.pop_back();
  EXPECT_TRUE(throws_error([&] { (void)short_lengths.row(0); },
                           {"Batch::row", "2 seq_offsets but 1 seq_query_lens"}));
  const Batch plain = Batch::uniform(2, 1, 0);  // no seq_ids: row b is sequence b
  EXPECT_EQ(plain.seq_id(1), 1);
  EXPECT_TRUE(throws_error([&] { (void)plain.seq_id(2); }, {"Batch::seq_id", "row 2"}));

  const Array kv = Array::zeros(DType::f32, {1, 1, 2, 2});
  const KVHistory ragged = KVHistory::of_rows({KVHistory(kv, kv), KVHistory(kv, kv)});
  EXPECT_EQ(ragged.row(1).length(), 2);
  EXPECT_TRUE(
      throws_error([&] { (void)ragged.row(2); }, {"KVHistory::row", "row 2 of a history of 2"}));
  EXPECT_TRUE(throws_error([&] { (void)ragged.row(-1); }, {"KVHistory::row", "row -1"}));
  const KVHistory one(kv, kv);
  EXPECT_EQ(&one.row(3), &one);  // not ragged: every row reads this history
  const RecurrentHistory states = RecurrentHistory::of_rows({RecurrentHistory(kv, kv)});
  EXPECT_TRUE(throws_error([&] { (void)states.row(1); },
                           {"RecurrentHistory::row", "row 1 of a history of 1"}));
}

// Every column's position, first_position + k, fits in int64 (the masks compute the last one);
// a paged history names its heads and depth through at least one chunk.
TEST(Batch, HistoriesWhosePositionsOverflowOrThatHaveNoChunksAreRefused) {
  constexpr int64_t kMost = std::numeric_limits<int64_t>::max();
  const Array kv = Array::zeros(DType::f32, {1, 1, 4, 2});
  EXPECT_TRUE(throws_error(
      [&] { (void)KVHistory(kv, kv, kMost - 2); },
      {"KVHistory", "first position 9223372036854775805 and 4 columns", "fit in int64"}));
  EXPECT_NO_THROW((void)KVHistory(kv, kv, kMost - 3));  // the last column at INT64_MAX
  const Array none = Array::zeros(DType::f32, {1, 1, 0, 2});
  EXPECT_NO_THROW((void)KVHistory(none, none, kMost));
  const Array chunk = Array::zeros(DType::f32, {1, 1, 4, 2});
  const PagedColumns paged{{chunk}, {chunk}, 1, 4, {0}, 3};
  EXPECT_TRUE(throws_error([&] { (void)KVHistory(paged, kMost - 1); },
                           {"KVHistory", "and 3 columns", "fit in int64"}));
  EXPECT_NO_THROW((void)KVHistory(paged, kMost - 2));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)KVHistory(PagedColumns{{}, {}, 1, 16, {}, 0});
      },
      {"KVHistory: a paged history of 0 columns", "at least one chunk"}));
}

}  // namespace
}  // namespace kvsnap
