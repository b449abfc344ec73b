// Contracts of batches, histories and masks (include/kvsnap/batch.h, attention.h) that no other
// test pinned: refusals with their messages, and the contents of masked and ragged outputs.
#include <gtest/gtest.h>
#include <kvsnap/attention.h>
#include <kvsnap/batch.h>
#include <kvsnap/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace kvsnap::attention_contracts_test {
namespace {

using testing::all_close;
using testing::random_array;
using testing::throws_error;

constexpr float kH = -std::numeric_limits<float>::infinity();  // a hidden entry of a mask

// A contiguous history of `keys` zero columns from `first_position` (masks read only positions).
KVHistory zeros_history(int64_t keys, int64_t first_position = 0, int64_t window = 0,
                        int64_t rows = 1) {
  return KVHistory(Array::zeros(DType::f32, {rows, 1, keys, 2}),
                   Array::zeros(DType::f32, {rows, 1, keys, 2}), first_position, 0, window);
}

// The one array of a physical mask as floats; fails the test when the mask is none().
std::vector<float> mask_values(const AttentionMask& physical) {
  EXPECT_EQ(physical.arrays().size(), 1u);
  return physical.arrays().empty() ? std::vector<float>{} : physical.arrays().front().to_floats();
}

// A paged history's layout: one chunk of 4 blocks of 2 tokens, 5 columns in blocks 2, 0, 3
// (out of order, the last block half used).
constexpr int64_t kPerChunk = 4, kTokens = 2, kColumns = 5;
const std::vector<int32_t> kTable{2, 0, 3};

PagedColumns paged_columns(const Array& key_chunk, const Array& value_chunk) {
  return PagedColumns{{key_chunk}, {value_chunk}, kPerChunk, kTokens, kTable, kColumns};
}

// Column c of the paged layout, read from its chunk by hand: [1, H, kColumns, D].
Array gathered(const Array& chunk) {
  Array out = Array::zeros(DType::f32, {1, chunk.dim(1), kColumns, chunk.dim(3)});
  for (int64_t c = 0; c < kColumns; ++c) {
    const int64_t at = kTable[static_cast<size_t>(c / kTokens)] * kTokens + c % kTokens;
    out.slice(2, c, c + 1).assign(chunk.slice(2, at, at + 1));
  }
  return out;
}

// --- 1, 2, 3: ragged histories -----------------------------------------------------------------

TEST(AttentionContractErrors, OfRowsTakesOnlyOneRowMembers) {
  const KVHistory ragged = KVHistory::of_rows({zeros_history(2), zeros_history(3)});
  EXPECT_TRUE(throws_error(
      [&] {
        (void)KVHistory::of_rows({zeros_history(2), ragged});
      },
      {"KVHistory::of_rows: row 1 is a ragged history of 2 rows",
       "each row needs a one-row history"}));
  EXPECT_TRUE(throws_error(
      [&] { (void)KVHistory::of_rows({zeros_history(4, 0, 0, /*rows=*/2)}); },
      {"KVHistory::of_rows: row 0 is a history of 2 rows", "each row needs a one-row history"}));
  // One-row members of either form are taken.
  const Array chunk = Array::zeros(DType::f32, {1, 1, kPerChunk * kTokens, 2});
  const KVHistory rows =
      KVHistory::of_rows({zeros_history(3), KVHistory(paged_columns(chunk, chunk))});
  EXPECT_TRUE(rows.ragged());
  EXPECT_EQ(rows.rows(), 2);
  EXPECT_EQ(rows.length(), kColumns);
}

TEST(AttentionContractErrors, ContiguousRefusesARaggedHistory) {
  const KVHistory ragged = KVHistory::of_rows({zeros_history(2), zeros_history(3)});
  EXPECT_TRUE(throws_error([&] { (void)ragged.contiguous(); },
                           {"KVHistory::contiguous: a ragged history of 2 rows; take its rows"}));
  // A paged one is copied in table order, its first position and window kept.
  std::mt19937 rng(3);
  const Array keys = random_array({1, 2, kPerChunk * kTokens, 4}, rng);
  const Array values = random_array({1, 2, kPerChunk * kTokens, 3}, rng);
  const KVHistory copy = KVHistory(paged_columns(keys, values), 6, 2).contiguous();
  EXPECT_FALSE(copy.paged());
  EXPECT_EQ(copy.first_position(), 6);
  EXPECT_EQ(copy.window(), 2);
  EXPECT_EQ(copy.keys().to_floats(), gathered(keys).to_floats());
  EXPECT_EQ(copy.values().to_floats(), gathered(values).to_floats());
}

TEST(AttentionContractErrors, SdpaRefusesARaggedHistoryOfOtherRowsThanQ) {
  std::mt19937 rng(4);
  const auto row = [&] {
    return KVHistory(random_array({1, 2, 4, 8}, rng), random_array({1, 2, 4, 8}, rng));
  };
  const KVHistory three = KVHistory::of_rows({row(), row(), row()});
  const KVHistory one = KVHistory::of_rows({row()});
  for (const int64_t queries : {int64_t{1}, int64_t{2}}) {  // decode and prefill
    const Array q = random_array({2, 2, queries, 8}, rng);
    const Batch batch = Batch::uniform(2, queries, 4 - queries);
    const std::string shape = q.describe();
    EXPECT_TRUE(
        throws_error([&] { (void)sdpa(batch, q, three, AttentionMask::causal(), 0.5f); },
                     {"sdpa: a history of 3 rows for q", shape.c_str(), "need one per q row"}))
        << queries;
    EXPECT_TRUE(throws_error([&] { (void)sdpa(batch, q, one, AttentionMask::causal(), 0.5f); },
                             {"sdpa: a history of 1 rows for q", shape.c_str()}))
        << queries;
    EXPECT_EQ(
        sdpa(batch, q, KVHistory::of_rows({row(), row()}), AttentionMask::causal(), 0.5f).shape(),
        (Shape{2, 2, queries, 8}));
  }
}

// --- 4, 8: batches ------------------------------------------------------------------------------

TEST(BatchContracts, ValidateRefusesNegativeDuplicateAndMiscountedIds) {
  Batch batch = Batch::rows({{0, 0, {1}}, {4, 2, {2}}, {7, 5, {3}}});
  EXPECT_NO_THROW(batch.validate("f"));
  batch.seq_ids[1] = -3;
  EXPECT_TRUE(
      throws_error([&] { batch.validate("f"); }, {"f: row 1 has sequence id -3; ids are >= 0"}));
  batch.seq_ids = {7, 4, 7};
  EXPECT_TRUE(throws_error([&] { batch.validate("f"); },
                           {"f: rows 0 and 2 are both sequence 7 (a sequence has one row"}));
  batch.seq_ids = {0, 4};
  EXPECT_TRUE(throws_error([&] { batch.validate("f"); },
                           {"f: batch has 2 seq_ids for 3 rows (one per row, or none)"}));
  batch.seq_ids = {0, 4, 7, 9};
  EXPECT_TRUE(throws_error([&] { batch.validate("f"); }, {"f: batch has 4 seq_ids for 3 rows"}));
  batch.seq_ids.clear();  // none: row b is sequence b
  EXPECT_NO_THROW(batch.validate("f"));
  // The factory leaves the check to validate: duplicate chunks make a batch validate refuses.
  const Batch twice = Batch::rows({{2, 0, {1}}, {2, 9, {1}}});
  EXPECT_TRUE(throws_error([&] { twice.validate("g"); }, {"g: rows 0 and 1 are both sequence 2"}));
}

TEST(BatchContracts, RowsPadToTheLongestChunkWithZeros) {
  const Batch batch = Batch::rows({{3, 40, {9, 8, 7, 6}}, {5, 900, {4}}, {1, 0, {2, 3}}});
  EXPECT_EQ(batch.input_ids.shape(), (Shape{3, 4}));
  EXPECT_EQ(batch.input_ids.to_ints(), (std::vector<int32_t>{9, 8, 7, 6,  //
                                                             4, 0, 0, 0,  //
                                                             2, 3, 0, 0}));
  EXPECT_EQ(batch.seq_ids, (std::vector<int32_t>{3, 5, 1}));
  EXPECT_EQ(batch.seq_offsets, (std::vector<int32_t>{40, 900, 0}));
  EXPECT_EQ(batch.seq_query_lens, (std::vector<int32_t>{4, 1, 2}));
  EXPECT_EQ(batch.length(), 4);
  EXPECT_NO_THROW(batch.validate("f"));
  // A row alone keeps the batch's L columns, its padding included.
  const Batch second = batch.row(1);
  EXPECT_EQ(second.input_ids.shape(), (Shape{1, 4}));
  EXPECT_EQ(second.input_ids.to_ints(), (std::vector<int32_t>{4, 0, 0, 0}));
  EXPECT_EQ(second.seq_offsets, (std::vector<int32_t>{900}));
  EXPECT_EQ(second.seq_query_lens, (std::vector<int32_t>{1}));
  EXPECT_EQ(second.seq_ids, (std::vector<int32_t>{5}));
  EXPECT_EQ(second.length(), 4);
}

TEST(BatchContracts, ARowWithoutIdsKeepsTheBatchLengthWithPlaceholders) {
  Batch batch;
  batch.seq_offsets = {0, 4};
  batch.seq_query_lens = {2, 5};
  const Batch shorter = batch.row(0);
  EXPECT_EQ(shorter.input_ids.shape(), (Shape{1, 5}));
  EXPECT_EQ(shorter.input_ids.to_ints(), (std::vector<int32_t>(5, 0)));
  EXPECT_EQ(shorter.length(), 5);
  EXPECT_EQ(shorter.seq_query_lens, (std::vector<int32_t>{2}));
  EXPECT_EQ(shorter.seq_ids, (std::vector<int32_t>{0}));  // row b is sequence b
  EXPECT_NO_THROW(shorter.validate("f"));
  const Batch longest = batch.row(1);  // already L long: no ids needed
  EXPECT_TRUE(longest.input_ids.empty());
  EXPECT_EQ(longest.length(), 5);
  EXPECT_EQ(longest.seq_offsets, (std::vector<int32_t>{4}));
  EXPECT_EQ(longest.seq_ids, (std::vector<int32_t>{1}));
  batch.seq_ids = {6, 2};
  EXPECT_EQ(batch.row(1).seq_ids, (std::vector<int32_t>{2}));
  EXPECT_EQ(batch.row(0).seq_ids, (std::vector<int32_t>{6}));
}

TEST(AttentionMaskContracts, ForRowCutsPerRowArraysAndKeepsTheRest) {
  const std::vector<int32_t> per_row{1, 0, 1,   // row 0
                                     0, 1, 1};  // row 1
  const std::vector<float> shared{0.5f, -1.0f, 2.0f, 3.0f, kH, 0.25f};
  const AttentionMask mask =
      AttentionMask::from_array(Array::from_ints(per_row, {2, 1, 1, 3}))
          .intersect(AttentionMask::from_array(Array::from_floats(shared, {1, 2, 1, 3})))
          .intersect(AttentionMask::sliding_window(4));
  for (const int64_t row : {int64_t{0}, int64_t{1}}) {
    const AttentionMask cut = mask.for_row(row);
    ASSERT_EQ(cut.arrays().size(), 2u);
    EXPECT_EQ(cut.arrays()[0].shape(), (Shape{1, 1, 1, 3}));
    EXPECT_EQ(cut.arrays()[0].to_ints(),
              std::vector<int32_t>(per_row.begin() + row * 3, per_row.begin() + row * 3 + 3));
    EXPECT_EQ(cut.arrays()[1].shape(), (Shape{1, 2, 1, 3}));  // one slice for all rows: kept
    EXPECT_EQ(cut.arrays()[1].to_floats(), shared);
    EXPECT_TRUE(cut.is_causal());
    EXPECT_EQ(cut.window(), 4);
  }
  EXPECT_EQ(AttentionMask::causal().for_row(3).kind(), AttentionMask::Kind::causal);
}

// --- 9: the contiguous constructor ------------------------------------------------------------

TEST(AttentionContractErrors, ContiguousHistoryRefusesNegativeFirstPositionAndWindow) {
  EXPECT_TRUE(throws_error([] { (void)zeros_history(3, -1); },
                           {"KVHistory: first position -1", "must be non-negative"}));
  EXPECT_TRUE(throws_error([] { (void)zeros_history(3, 0, -2); },
                           {"KVHistory:", "window -2 must be non-negative"}));
  const KVHistory fine = zeros_history(3, 1000, 7);
  EXPECT_EQ(fine.first_position(), 1000);
  EXPECT_EQ(fine.window(), 7);
}

// --- 5: paged histories mask and attend as their contiguous equivalents ----------------------

TEST(AttentionContracts, PagedHistoryMasksAsItsContiguousEquivalent) {
  // Positions 3..7 under a window of 3; two rows over the one sequence, the second padded.
  const Array chunk = Array::zeros(DType::f32, {1, 2, kPerChunk * kTokens, 4});
  const KVHistory paged(paged_columns(chunk, chunk), /*first_position=*/3, /*window=*/3);
  const KVHistory contiguous = zeros_history(kColumns, 3, 3);
  const Batch batch = Batch::rows({{0, 6, {1, 2}}, {1, 7, {3}}});
  // Causal within the window, by hand: query 6 sees 4..6, query 7 sees 5..7.
  EXPECT_EQ(mask_values(paged.apply_mask(batch, AttentionMask::causal())),
            (std::vector<float>{kH, 0,  0,  0,  kH,  //
                                kH, kH, 0,  0,  0,   //
                                kH, kH, 0,  0,  0,   //
                                kH, kH, kH, kH, kH}));
  std::vector<int32_t> allowed(2 * 2 * 8, 1);  // [1, 2 heads, 2 queries, 8 positions]
  allowed[0 * 16 + 0 * 8 + 5] = 0;             // head 0, query 0 loses position 5
  allowed[1 * 16 + 1 * 8 + 7] = 0;             // head 1, query 1 loses position 7
  std::vector<float> bias(2 * 2 * 8);
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = i % 5 == 0 ? kH : 0.125f * float(i % 7);
  const AttentionMask masks[] = {
      AttentionMask::causal(),
      AttentionMask::none(),
      AttentionMask::sliding_window(2),
      AttentionMask::from_array(Array::from_ints(allowed, {1, 2, 2, 8})),
      AttentionMask::from_array(Array::from_floats(bias, {2, 1, 2, 8}))
          .intersect(AttentionMask::causal()),
  };
  for (size_t m = 0; m < std::size(masks); ++m) {
    const std::vector<float> got = mask_values(paged.apply_mask(batch, masks[m]));
    EXPECT_EQ(got, mask_values(contiguous.apply_mask(batch, masks[m]))) << "mask " << m;
    EXPECT_NE(std::count(got.begin(), got.end(), kH), 0) << "mask " << m;
  }
}

TEST(AttentionContracts, SdpaWithAnExplicitMaskOverAPagedHistoryEqualsContiguous) {
  // Four query heads over two key/value heads, positions 0..4, a per-head additive mask.
  std::mt19937 rng(9);
  const Array keys = random_array({1, 2, kPerChunk * kTokens, 8}, rng);
  const Array values = random_array({1, 2, kPerChunk * kTokens, 6}, rng);
  const KVHistory paged(paged_columns(keys, values));
  const KVHistory contiguous(gathered(keys), gathered(values));
  for (const int64_t queries : {int64_t{3}, int64_t{1}}) {  // prefill and decode
    const Array q = random_array({1, 4, queries, 8}, rng);
    const Batch batch = Batch::uniform(1, queries, kColumns - queries);
    std::vector<float> bias(static_cast<size_t>(4 * queries * kColumns));
    for (size_t i = 0; i < bias.size(); ++i) bias[i] = i % 4 == 1 ? kH : 0.3f * float(i % 5);
    const AttentionMask array =
        AttentionMask::from_array(Array::from_floats(bias, {1, 4, queries, kColumns}));
    for (const AttentionMask& mask : {array, array.intersect(AttentionMask::causal())}) {
      const Array want = sdpa(batch, q, contiguous, mask, 0.4f);
      EXPECT_TRUE(all_close(sdpa(batch, q, paged, mask, 0.4f), want, 1e-5f)) << queries;
      // The mask matters: without it the result is another.
      EXPECT_FALSE(all_close(sdpa(batch, q, contiguous, AttentionMask::none(), 0.4f), want, 1e-3f))
          << queries;
    }
  }
}

// --- 6: the ragged mask's contents --------------------------------------------------------------

// Row 0: keys at 0, 1 and one query at 1 (its second query padding); row 1: keys at 0..3 and
// queries at 2, 3. The output spans row 1's four columns: row 0's last two are hidden.
TEST(AttentionContracts, RaggedMaskPadsShortRowsAndPaddingQueriesAsHidden) {
  const KVHistory ragged = KVHistory::of_rows({zeros_history(2), zeros_history(4)});
  const Batch batch = Batch::rows({{0, 1, {7}}, {1, 2, {8, 9}}});
  struct Case {
    const char* name;
    AttentionMask mask;
    std::vector<float> want;  // [2 rows, 1 head, 2 queries, 4 columns]
  };
  const Case cases[] = {
      {"none",
       AttentionMask::none(),
       {0, 0, kH, kH, kH, kH, kH, kH,  // row 0: its own columns, then a padding query
        0, 0, 0, 0, 0, 0, 0, 0}},      // row 1 sees everything
      {"causal",
       AttentionMask::causal(),
       {0, 0, kH, kH, kH, kH, kH, kH,  //
        0, 0, 0, kH, 0, 0, 0, 0}},
      {"window 2",
       AttentionMask::sliding_window(2),
       {0, 0, kH, kH, kH, kH, kH, kH,  //
        kH, 0, 0, kH, kH, kH, 0, 0}},
  };
  for (const Case& c : cases) {
    const AttentionMask physical = ragged.apply_mask(batch, c.mask);
    ASSERT_EQ(physical.arrays().size(), 1u) << c.name;
    EXPECT_EQ(physical.arrays().front().shape(), (Shape{2, 1, 2, 4})) << c.name;
    EXPECT_EQ(mask_values(physical), c.want) << c.name;
  }
}

// Rows of one length whose queries see every key: none(), as for a history of one row (no
// array of zeros to build and read).
TEST(AttentionContracts, ARaggedMaskHidingNothingIsNone) {
  const KVHistory ragged = KVHistory::of_rows({zeros_history(3), zeros_history(3)});
  const Batch batch = Batch::uniform(2, 1, 3);  // one query each, at position 3
  for (const AttentionMask& mask : {AttentionMask::none(), AttentionMask::causal()}) {
    EXPECT_TRUE(ragged.apply_mask(batch, mask).arrays().empty());
  }
  // A window hides the oldest key; a shorter row pads: arrays again.
  EXPECT_EQ(ragged.apply_mask(batch, AttentionMask::sliding_window(3)).arrays().size(), 1u);
  const KVHistory uneven = KVHistory::of_rows({zeros_history(2), zeros_history(3)});
  EXPECT_EQ(uneven.apply_mask(Batch::rows({{0, 2, {7}}, {1, 3, {8}}}), AttentionMask::causal())
                .arrays()
                .size(),
            1u);
}

// A mask array of one slice per row and per head: each row reads its own slice, and a row's
// heads stay apart.
TEST(AttentionContracts, RaggedMaskReadsEachRowsSliceOfAPerHeadArray) {
  const KVHistory ragged = KVHistory::of_rows({zeros_history(2), zeros_history(4)});
  const Batch batch = Batch::rows({{0, 1, {7}}, {1, 2, {8, 9}}});
  std::vector<int32_t> allowed(2 * 2 * 2 * 4, 1);  // [2 rows, 2 heads, 2 queries, 4 positions]
  for (int l = 0; l < 2; ++l) {
    allowed[static_cast<size_t>(((0 * 2 + 1) * 2 + l) * 4 + 0)] = 0;  // row 0, head 1: key 0
    allowed[static_cast<size_t>(((1 * 2 + 0) * 2 + l) * 4 + 3)] = 0;  // row 1, head 0: key 3
  }
  const AttentionMask physical =
      ragged.apply_mask(batch, AttentionMask::from_array(Array::from_ints(allowed, {2, 2, 2, 4})));
  ASSERT_EQ(physical.arrays().size(), 1u);
  EXPECT_EQ(physical.arrays().front().shape(), (Shape{2, 2, 2, 4}));
  EXPECT_EQ(mask_values(physical),
            (std::vector<float>{0,  0, kH, kH, kH, kH, kH, kH,    // row 0, head 0
                                kH, 0, kH, kH, kH, kH, kH, kH,    // row 0, head 1
                                0,  0, 0,  kH, 0,  0,  0,  kH,    // row 1, head 0
                                0,  0, 0,  0,  0,  0,  0,  0}));  // row 1, head 1
}

// --- 7: mask heads ------------------------------------------------------------------------------

TEST(AttentionContractErrors, SdpaTakesMaskHeadsOfOneOrHq) {
  std::mt19937 rng(12);
  const Array keys = random_array({1, 2, 5, 8}, rng), values = random_array({1, 2, 5, 8}, rng);
  const KVHistory history(keys, values);
  const KVHistory ragged = KVHistory::of_rows({history, history});
  for (const int64_t queries : {int64_t{3}, int64_t{1}}) {
    const Array q = random_array({1, 4, queries, 8}, rng);
    const Array q2 = random_array({2, 4, queries, 8}, rng);
    const Batch batch = Batch::uniform(1, queries, 5 - queries);
    const Batch two = Batch::uniform(2, queries, 5 - queries);
    const auto heads = [&](int64_t count) {
      return AttentionMask::from_array(Array::zeros(DType::f32, {1, count, queries, 5}));
    };
    for (const int64_t count : {int64_t{2}, int64_t{3}, int64_t{8}}) {
      const std::string rule = "has " + std::to_string(count) + " heads; need 1 or Hq = 4";
      EXPECT_TRUE(throws_error([&] { (void)sdpa(batch, q, history, heads(count), 0.5f); },
                               {"sdpa: mask", rule.c_str()}))
          << queries << " queries, " << count << " heads";
      EXPECT_TRUE(throws_error([&] { (void)sdpa(two, q2, ragged, heads(count), 0.5f); },
                               {"sdpa: mask", rule.c_str()}))
          << queries << " queries, " << count << " heads, ragged";
    }
    for (const int64_t count : {int64_t{1}, int64_t{4}}) {
      EXPECT_TRUE(all_close(sdpa(batch, q, history, heads(count), 0.5f),
                            sdpa(batch, q, history, AttentionMask::none(), 0.5f), 1e-5f))
          << count;
    }
  }
  // Two arrays of other head counts (neither 1) do not intersect: refused where they meet.
  const AttentionMask mixed =
      AttentionMask::from_array(Array::zeros(DType::f32, {1, 2, 1, 5}))
          .intersect(AttentionMask::from_array(Array::zeros(DType::f32, {1, 4, 1, 5})));
  EXPECT_TRUE(throws_error([&] { (void)history.apply_mask(Batch::uniform(1, 1, 4), mixed); },
                           {"KVHistory::apply_mask: mask array f32[1, 4, 1, 5] does not fit"}));
}

// A query or key holding NaN (a model that diverged) shows in the outputs it reaches as NaN, on
// every path — decode and prefill, contiguous and paged histories — and leaves the other
// heads' outputs finite: never a silent zero (a softmax whose max dropped the NaN and saw
// nothing) or a finite value.
TEST(AttentionContracts, NaNInAQueryOrAKeyReachesTheOutputsAsNaN) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  std::mt19937 rng(11);
  const Array keys = random_array({1, 1, 16, 8}, rng);
  const Array values = random_array({1, 1, 16, 8}, rng);
  const auto paged = [&](const Array& k) {  // one chunk of four 4-token blocks, in order
    return KVHistory(PagedColumns{{k}, {values}, 4, 4, {0, 1, 2, 3}, 16});
  };
  for (const int64_t queries : {int64_t{1}, int64_t{3}}) {
    const Batch batch = Batch::uniform(1, queries, 16 - queries);
    Array q = random_array({1, 2, queries, 8}, rng);
    q.mutable_data<float>()[3] = kNaN;  // head 0, query 0
    for (const KVHistory& history : {KVHistory(keys, values), paged(keys)}) {
      const Array out = sdpa(batch, q, history, AttentionMask::causal(), 0.35f);
      const float* o = out.data<float>();
      for (int64_t d = 0; d < 8; ++d) {
        EXPECT_TRUE(std::isnan(o[d])) << queries << " queries, paged " << history.paged();
        EXPECT_TRUE(std::isfinite(o[queries * 8 + d])) << "head 1";
      }
    }
    // A NaN key column every query sees: NaN in every output.
    Array poisoned = keys.clone();
    poisoned.mutable_data<float>()[5 * 8 + 2] = kNaN;
    const Array clean = random_array({1, 2, queries, 8}, rng);
    for (const KVHistory& history : {KVHistory(poisoned, values), paged(poisoned)}) {
      const Array out = sdpa(batch, clean, history, AttentionMask::causal(), 0.35f);
      for (const float v : out.to_floats()) {
        EXPECT_TRUE(std::isnan(v)) << queries << " queries, paged " << history.paged();
      }
    }
  }
}

}  // namespace
}  // namespace kvsnap::attention_contracts_test
