#include <gtest/gtest.h>
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
}

}  // namespace
}  // namespace kvsnap
