#include <gtest/gtest.h>
#include <kvsnap/ops.h>

#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "ops/decode_kernels.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::all_close;
using testing::random_array;
using testing::throws_error;

// Naive reference: explicit triple loop in double over logical positions, no shared code with
// sdpa. visible(b, h, l, k) decides masking; keys are in position order starting at 0.
template <class Visible>
std::vector<double> naive_attention(const Array& q, const Array& k, const Array& v, float scale,
                                    Visible visible) {
  const int64_t B = q.dim(0), Hq = q.dim(1), L = q.dim(2), D = q.dim(3);
  const int64_t H = k.dim(1), K = k.dim(2), Dv = v.dim(3);
  const auto qf = q.to_floats(), kf = k.to_floats(), vf = v.to_floats();
  std::vector<double> out(static_cast<size_t>(B * Hq * L * Dv), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t l = 0; l < L; ++l) {
        const int64_t kh = h / (Hq / H);
        std::vector<double> w(static_cast<size_t>(K), 0.0);
        double best = -1e300, total = 0.0;
        bool any = false;
        for (int64_t j = 0; j < K; ++j) {
          if (!visible(b, h, l, j)) continue;
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d)
            dot += double(qf[((b * Hq + h) * L + l) * D + d]) * kf[((b * H + kh) * K + j) * D + d];
          w[j] = dot * scale;
          best = std::max(best, w[j]);
          any = true;
        }
        if (!any) continue;
        for (int64_t j = 0; j < K; ++j) {
          w[j] = visible(b, h, l, j) ? std::exp(w[j] - best) : 0.0;
          total += w[j];
        }
        for (int64_t j = 0; j < K; ++j)
          for (int64_t d = 0; d < Dv; ++d)
            out[((b * Hq + h) * L + l) * Dv + d] +=
                w[j] / total * vf[((b * H + kh) * K + j) * Dv + d];
      }
  return out;
}

::testing::AssertionResult matches(const Array& actual, const std::vector<double>& expected) {
  const auto a = actual.to_floats();
  if (a.size() != expected.size()) return ::testing::AssertionFailure() << "size differs";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::fabs(a[i] - expected[i]) > 1e-5 * std::max(1.0, std::fabs(expected[i]))) {
      return ::testing::AssertionFailure()
             << "element " << i << ": " << a[i] << " vs " << expected[i];
    }
  }
  return ::testing::AssertionSuccess();
}

struct Inputs {
  Array q, k, v;
};

Inputs make_inputs(int64_t B, int64_t Hq, int64_t H, int64_t L, int64_t K, int64_t D, int64_t Dv,
                   uint32_t seed, DType dtype = DType::f32) {
  std::mt19937 rng(seed);
  return {random_array({B, Hq, L, D}, rng, dtype), random_array({B, H, K, D}, rng, dtype),
          random_array({B, H, K, Dv}, rng, dtype)};
}

TEST(Sdpa, NoMaskMatchesNaive) {
  const auto in = make_inputs(2, 4, 4, 3, 7, 8, 5, 1);
  const auto out =
      sdpa(Batch::uniform(2, 3, 4), in.q, KVHistory(in.k, in.v), AttentionMask::none(), 0.3f);
  EXPECT_EQ(out.shape(), (Shape{2, 4, 3, 5}));
  EXPECT_TRUE(matches(out, naive_attention(in.q, in.k, in.v, 0.3f, [](auto...) { return true; })));
}

TEST(Sdpa, CausalChunkMatchesNaive) {
  // 4 queries at positions 6..9 over 10 keys.
  const auto in = make_inputs(1, 2, 2, 4, 10, 16, 16, 2);
  const auto out =
      sdpa(Batch::uniform(1, 4, 6), in.q, KVHistory(in.k, in.v), AttentionMask::causal(), 0.25f);
  EXPECT_TRUE(matches(
      out, naive_attention(in.q, in.k, in.v, 0.25f,
                           [](int64_t, int64_t, int64_t l, int64_t j) { return j <= 6 + l; })));
}

TEST(Sdpa, SlidingWindowMatchesNaive) {
  const auto in = make_inputs(1, 2, 1, 6, 6, 8, 8, 3);
  const auto out = sdpa(Batch::uniform(1, 6, 0), in.q, KVHistory(in.k, in.v),
                        AttentionMask::sliding_window(3), 0.5f);
  EXPECT_TRUE(matches(
      out, naive_attention(in.q, in.k, in.v, 0.5f, [](int64_t, int64_t, int64_t l, int64_t j) {
        return j <= l && l - j < 3;
      })));
}

TEST(Sdpa, ExplicitPerHeadArrayMatchesNaive) {
  std::mt19937 rng(4);
  const auto in = make_inputs(1, 2, 1, 3, 5, 4, 4, 4);
  std::vector<int32_t> allowed(2 * 3 * 5);
  for (auto& a : allowed) a = rng() % 3 != 0;
  const auto logical = AttentionMask::from_array(Array::from_ints(allowed, {1, 2, 3, 5}));
  const auto out = sdpa(Batch::uniform(1, 3, 2), in.q, KVHistory(in.k, in.v), logical, 0.5f);
  EXPECT_TRUE(matches(
      out, naive_attention(in.q, in.k, in.v, 0.5f, [&](int64_t, int64_t h, int64_t l, int64_t j) {
        return allowed[(h * 3 + l) * 5 + j] != 0;
      })));
}

TEST(Sdpa, IntersectionMatchesNaive) {
  const auto in = make_inputs(1, 1, 1, 4, 8, 4, 4, 5);
  std::vector<int32_t> allowed(4 * 8, 1);
  allowed[3 * 8 + 5] = 0;  // query 3 (position 7) may not see position 5
  const auto logical = AttentionMask::sliding_window(4).intersect(
      AttentionMask::from_array(Array::from_ints(allowed, {1, 1, 4, 8})));
  const auto out = sdpa(Batch::uniform(1, 4, 4), in.q, KVHistory(in.k, in.v), logical, 0.5f);
  EXPECT_TRUE(matches(
      out, naive_attention(in.q, in.k, in.v, 0.5f, [&](int64_t, int64_t, int64_t l, int64_t j) {
        const int64_t i = 4 + l;
        return j <= i && i - j < 4 && allowed[l * 8 + j] != 0;
      })));
}

TEST(Sdpa, RingOrderHistoryEqualsPositionOrder) {
  // The same keys stored rotated (oldest in column 3) attend exactly as in position order.
  const auto in = make_inputs(1, 2, 2, 1, 5, 8, 8, 6);
  auto rotate = [](const Array& a) {  // position p goes to column (p + 3) % 5
    Array out = Array::zeros(a.dtype(), a.shape());
    out.slice(2, 3, 5).assign(a.slice(2, 0, 2));
    out.slice(2, 0, 3).assign(a.slice(2, 2, 5));
    return out;
  };
  const auto batch = Batch::uniform(1, 1, 14);
  const auto logical = AttentionMask::sliding_window(5);
  const auto straight = sdpa(batch, in.q, KVHistory(in.k, in.v, 10), logical, 0.4f);
  const auto ring = sdpa(batch, in.q, KVHistory(rotate(in.k), rotate(in.v), 10, 3), logical, 0.4f);
  EXPECT_TRUE(all_close(ring, straight, 1e-6f));
}

TEST(Sdpa, GqaEqualsMhaWithRepeatedHeads) {
  const auto in = make_inputs(2, 6, 2, 4, 9, 8, 8, 7);
  auto repeat = [](const Array& a, int64_t times) {
    Shape shape = a.shape();
    shape[1] *= times;
    Array out = Array::zeros(a.dtype(), shape);
    for (int64_t h = 0; h < shape[1]; ++h)
      out.slice(1, h, h + 1).assign(a.slice(1, h / times, h / times + 1));
    return out;
  };
  const auto batch = Batch::uniform(2, 4, 5);
  const auto gqa = sdpa(batch, in.q, KVHistory(in.k, in.v), AttentionMask::causal(), 0.35f);
  const auto mha = sdpa(batch, in.q, KVHistory(repeat(in.k, 3), repeat(in.v, 3)),
                        AttentionMask::causal(), 0.35f);
  // Not bitwise: GQA stacks a key head's query heads into one product, and OpenBLAS rounds a
  // product of more rows differently (in the last bit).
  EXPECT_TRUE(all_close(gqa, mha, 1e-6f));
}

TEST(Sdpa, HalfPrecisionInputsComputeInFloat32) {
  const auto in = make_inputs(1, 2, 2, 3, 6, 8, 8, 8, DType::f16);
  const auto out =
      sdpa(Batch::uniform(1, 3, 3), in.q, KVHistory(in.k, in.v), AttentionMask::causal(), 0.3f);
  EXPECT_EQ(out.dtype(), DType::f32);
  EXPECT_TRUE(matches(
      out, naive_attention(in.q, in.k, in.v, 0.3f,
                           [](int64_t, int64_t, int64_t l, int64_t j) { return j <= 3 + l; })));
}

TEST(Sdpa, StridedHistoryViewsGiveTheSameResult) {
  const auto in = make_inputs(1, 2, 2, 2, 12, 8, 8, 9);
  const auto batch = Batch::uniform(1, 2, 6);
  const auto view = sdpa(batch, in.q, KVHistory(in.k.slice(2, 0, 8), in.v.slice(2, 0, 8)),
                         AttentionMask::causal(), 0.3f);
  const auto compact = sdpa(
      batch, in.q, KVHistory(in.k.slice(2, 0, 8).contiguous(), in.v.slice(2, 0, 8).contiguous()),
      AttentionMask::causal(), 0.3f);
  EXPECT_TRUE(all_close(view, compact, 0.0f));
}

// Keys and values whose columns all view one row (a stride of 0 along the tokens: numpy's
// broadcast, torch's expand) read as the copies they stand for, on the decode kernels and on
// BLAS (which refuses a leading dimension below a row's length and writes nothing).
TEST(Sdpa, BroadcastColumnsGiveTheResultOfTheirCopies) {
  const auto in = make_inputs(1, 2, 2, 2, 1, 8, 8, 11);
  std::vector<float> key_rows = in.k.to_floats(), value_rows = in.v.to_floats();
  const Array k = Array::wrap(key_rows.data(), DType::f32, {1, 2, 5, 8}, {16, 8, 0, 1});
  const Array v = Array::wrap(value_rows.data(), DType::f32, {1, 2, 5, 8}, {16, 8, 0, 1});
  const auto batch = Batch::uniform(1, 2, 3);
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    const auto broadcast = sdpa(batch, in.q, KVHistory(k, v), AttentionMask::causal(), 0.3f);
    const auto copied =
        sdpa(batch, in.q, KVHistory(k.contiguous(), v.contiguous()), AttentionMask::causal(), 0.3f);
    EXPECT_TRUE(all_close(broadcast, copied, 0.0f)) << "decode kernels " << kernels;
  }
}

// A key the explicit mask hides is hidden whatever it holds: an infinite or NaN key's score
// reaches no output (NaN + -inf is NaN, which a max with the masked score kept).
TEST(Sdpa, AHiddenNonFiniteKeyReachesNoOutput) {
  auto in = make_inputs(1, 1, 1, 1, 3, 4, 4, 12);
  const std::vector<float> keys = in.k.to_floats();
  for (const float bad :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> forged = keys;
    for (int d = 0; d < 4; ++d) forged[2 * 4 + d] = bad;  // column 2
    const Array k = Array::from_floats(forged, {1, 1, 3, 4});
    const auto hide =
        AttentionMask::from_array(Array::from_ints(std::vector<int32_t>{1, 1, 0}, {1, 1, 1, 3}));
    const auto out = sdpa(Batch::uniform(1, 1, 2), in.q, KVHistory(k, in.v), hide, 0.5f);
    const auto two =
        sdpa(Batch::uniform(1, 1, 2), in.q,
             KVHistory(in.k.slice(2, 0, 2).contiguous(), in.v.slice(2, 0, 2).contiguous()),
             AttentionMask::none(), 0.5f);
    EXPECT_TRUE(all_close(out, two, 1e-6f)) << bad;
  }
}

// Rows with histories of their own (ragged): an explicit mask has one slice for all rows or one
// per row, and every row's values are as deep (one output array) — refused up front, naming sdpa.
TEST(SdpaErrors, RaggedRowsAndTheirMask) {
  const auto a = make_inputs(1, 2, 2, 1, 4, 8, 8, 13), b = make_inputs(1, 2, 2, 1, 6, 8, 8, 14);
  const Array q = Array::zeros(DType::f32, {2, 2, 1, 8});
  const KVHistory rows =
      KVHistory::of_rows({KVHistory(a.k, a.v), KVHistory(b.k.slice(2, 0, 4), b.v.slice(2, 0, 4))});
  const Batch batch = Batch::uniform(2, 1, 4);
  for (const int64_t mask_rows : {int64_t{3}, int64_t{5}}) {
    const auto mask = AttentionMask::from_array(Array::from_ints(
        std::vector<int32_t>(static_cast<size_t>(mask_rows) * 4, 1), {mask_rows, 1, 1, 4}));
    EXPECT_TRUE(throws_error([&] { (void)sdpa(batch, q, rows, mask, 0.5f); },
                             {"sdpa: mask", "rows; the batch has 2 (one, or one per row)"}));
  }
  for (const int64_t mask_rows : {int64_t{1}, int64_t{2}}) {
    const auto mask = AttentionMask::from_array(Array::from_ints(
        std::vector<int32_t>(static_cast<size_t>(mask_rows) * 4, 1), {mask_rows, 1, 1, 4}));
    EXPECT_EQ(sdpa(batch, q, rows, mask, 0.5f).shape(), (Shape{2, 2, 1, 8}));
  }
  const auto deep = make_inputs(1, 2, 2, 1, 4, 8, 6, 15);
  const KVHistory mixed = KVHistory::of_rows({KVHistory(a.k, a.v), KVHistory(deep.k, deep.v)});
  EXPECT_TRUE(throws_error([&] { (void)sdpa(batch, q, mixed, AttentionMask::none(), 0.5f); },
                           {"sdpa: row 1 of the history has values 6 deep, row 0's are 8"}));
}

// A lookback of any length, however far its queries lie from the history (positions before it
// included), hides only keys that far back: the largest window hides nothing (its arithmetic does
// not overflow).
TEST(Sdpa, TheLongestLookbackHidesNothing) {
  const auto in = make_inputs(1, 2, 2, 2, 5, 8, 8, 16);
  const KVHistory history(in.k, in.v, /*first_position=*/10);
  for (const int64_t offset : {int64_t{3}, int64_t{14}}) {
    const auto batch = Batch::uniform(1, 2, offset);
    const auto longest = AttentionMask::lookback(std::numeric_limits<int64_t>::max());
    EXPECT_TRUE(all_close(sdpa(batch, in.q, history, longest, 0.3f),
                          sdpa(batch, in.q, history, AttentionMask::none(), 0.3f), 0.0f))
        << offset;
  }
}

TEST(Sdpa, PaddingQueriesReturnZeros) {
  const auto in = make_inputs(2, 1, 1, 3, 3, 4, 4, 10);
  Batch batch = Batch::uniform(2, 3, 0);
  batch.seq_query_lens[1] = 1;
  const auto out =
      sdpa(batch, in.q, KVHistory(in.k, in.v), AttentionMask::causal(), 1.0f).to_floats();
  for (size_t i = 3 * 4 + 4; i < out.size(); ++i) EXPECT_EQ(out[i], 0.0f) << i;
}

TEST(Sdpa, GroupsOfThreeOverSeveralStackedBlocksWithPaddingMatchNaive) {
  // Six query heads on two key heads: 42 queries per stacked block (126 rows), so 100 queries
  // take three blocks, the last one partial; row 1 has 61 real queries, the rest padding.
  const int64_t queries = 100, offset = 20, keys = offset + queries;
  const auto in = make_inputs(2, 6, 2, queries, keys, 8, 5, 21);
  Batch batch = Batch::uniform(2, queries, offset);
  batch.seq_query_lens[1] = 61;
  const auto out = sdpa(batch, in.q, KVHistory(in.k, in.v), AttentionMask::causal(), 0.3f);
  std::vector<double> want =
      naive_attention(in.q, in.k, in.v, 0.3f,
                      [&](int64_t, int64_t, int64_t l, int64_t j) { return j <= offset + l; });
  for (int64_t h = 0; h < 6; ++h) {  // row 1's padding queries give zeros
    for (int64_t l = 61; l < queries; ++l) {
      for (int64_t d = 0; d < 5; ++d)
        want[static_cast<size_t>(((6 + h) * queries + l) * 5 + d)] = 0;
    }
  }
  EXPECT_TRUE(matches(out, want));
}

TEST(SdpaErrors, ShapesHeadsDtypesAndBatch) {
  const auto in = make_inputs(1, 3, 2, 2, 4, 8, 8, 11);
  const auto batch = Batch::uniform(1, 2, 2);
  EXPECT_TRUE(throws_error(
      [&] { (void)sdpa(batch, in.q, KVHistory(in.k, in.v), AttentionMask::none(), 1.0f); },
      {"sdpa", "3 query heads", "2 key/value heads"}));
  const auto good = make_inputs(1, 4, 2, 2, 4, 8, 8, 12);
  EXPECT_TRUE(throws_error(
      [&] {
        (void)sdpa(Batch::uniform(1, 3, 0), good.q, KVHistory(good.k, good.v),
                   AttentionMask::none(), 1.0f);
      },
      {"sdpa", "f32[1, 4, 2, 8]", "3 queries"}));
  std::mt19937 rng(1);
  EXPECT_TRUE(throws_error(
      [&] {
        (void)sdpa(batch, random_array({1, 4, 2, 6}, rng), KVHistory(good.k, good.v),
                   AttentionMask::none(), 1.0f);
      },
      {"sdpa", "keys", "axis 3 must be 6"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)sdpa(batch, Array::zeros(DType::i32, {1, 4, 2, 8}), KVHistory(good.k, good.v),
                   AttentionMask::none(), 1.0f);
      },
      {"sdpa", "q", "float dtype"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)sdpa(batch, good.q.slice(0, 0, 1).reshape({4, 2, 8}), KVHistory(good.k, good.v),
                   AttentionMask::none(), 1.0f);
      },
      {"sdpa", "q", "4-d"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)sdpa(batch, good.q, KVHistory(good.k, good.v), AttentionMask::none(),
                   std::numeric_limits<float>::infinity());
      },
      {"sdpa", "scale"}));
}

// A paged history's columns as one contiguous [1, H, length, D] array, for the reference.
Array gather_paged(const std::vector<Array>& chunks, int64_t blocks_per_chunk, int64_t tokens,
                   const std::vector<int32_t>& table, int64_t length) {
  const Array& any = chunks.front();
  Array out = Array::zeros(DType::f32, {1, any.dim(1), length, any.dim(3)});
  for (int64_t column = 0; column < length; ++column) {
    const int32_t block = table[static_cast<size_t>(column / tokens)];
    const int64_t at = block % blocks_per_chunk * tokens + column % tokens;
    out.slice(2, column, column + 1)
        .assign(chunks[static_cast<size_t>(block / blocks_per_chunk)].slice(2, at, at + 1));
  }
  return out;
}

// A hand-built paged history is checked whole when made: nothing it names lies outside its
// chunks, and the chunks have the shape its header gives them.
TEST(PagedHistory, AHandBuiltOneIsCheckedWhenMade) {
  std::mt19937 rng(5);
  const int64_t heads = 2, tokens = 2, per_chunk = 4, depth = 8;
  const auto chunk = [&](int64_t h, int64_t columns) {
    return random_array({1, h, columns, depth}, rng);
  };
  const int64_t columns = per_chunk * tokens;
  const auto paged = [&](std::vector<int32_t> table, int64_t length) {
    return PagedColumns{std::vector<Array>{chunk(heads, columns)},
                        std::vector<Array>{chunk(heads, columns)},
                        per_chunk,
                        tokens,
                        std::move(table),
                        length};
  };
  const auto refused = [](PagedColumns columns, std::initializer_list<const char*> what,
                          int64_t first_position = 0) {
    return throws_error([&] { (void)KVHistory(std::move(columns), first_position); }, what);
  };
  EXPECT_NO_THROW((void)KVHistory(paged({3, 0}, 3)));
  PagedColumns no_blocks = paged({0}, 2);
  no_blocks.blocks_per_chunk = 0;  // the struct's default: once a division by zero
  EXPECT_TRUE(refused(no_blocks, {"KVHistory", "blocks_per_chunk 0"}));
  EXPECT_TRUE(refused(paged({0, 4}, 3), {"KVHistory", "block 4", "[0, 1 x 4)"}));
  // Sizes of any magnitude are checked without overflowing: four blocks of 2^62 tokens hold 5
  // columns; the chunk is what does not fit.
  PagedColumns huge = paged({0, 0, 0, 0}, 5);
  huge.blocks_per_chunk = 1;
  huge.block_tokens = int64_t{1} << 62;
  EXPECT_TRUE(refused(huge, {"KVHistory", "chunk f32[1, 2, 8, 8] does not fit"}));
  EXPECT_TRUE(refused(paged({-1}, 1), {"KVHistory", "block -1"}));
  EXPECT_TRUE(refused(paged({0}, 3), {"KVHistory", "3 columns", "1 blocks of 2 tokens"}));
  EXPECT_TRUE(refused(paged({0}, 1), {"KVHistory", "first position -5"}, -5));
  PagedColumns fewer_value_heads = paged({0}, 1);
  fewer_value_heads.value_chunks = {chunk(1, columns)};
  EXPECT_TRUE(refused(fewer_value_heads, {"KVHistory", "chunk f32[1, 1, 8, 8]"}));
  PagedColumns uneven = paged({0, 4}, 3);
  uneven.key_chunks.push_back(chunk(heads, tokens));  // a second chunk of one block
  uneven.value_chunks.push_back(chunk(heads, columns));
  EXPECT_TRUE(refused(uneven, {"KVHistory", "chunk f32[1, 2, 2, 8]"}));
}

// A hand-built paged history whose chunks' rows overlap (a row stride shorter than a row: a view
// onto the same floats) is read as the rows it shows, on the prefill and the decode paths (such
// blocks are converted one at a time; a run read in place must not point into a copy).
TEST(PagedHistory, ChunksWhoseRowsOverlapAreReadAsTheyShow) {
  std::mt19937 rng(8);
  const std::vector<float> keys = random_array({1, 1, 1, 80}, rng).to_floats();
  const std::vector<float> values = random_array({1, 1, 1, 80}, rng).to_floats();
  const auto overlapping = [](const std::vector<float>& floats) {
    return Array::wrap(const_cast<float*>(floats.data()), DType::f32, {1, 2, 8, 8}, {80, 40, 4, 1});
  };
  const KVHistory paged(PagedColumns{{overlapping(keys)}, {overlapping(values)}, 2, 4, {1, 0}, 7});
  const KVHistory contiguous = paged.contiguous();
  for (const int64_t queries : {int64_t{3}, int64_t{1}}) {
    const Array q = random_array({1, 4, queries, 8}, rng);
    const auto batch = Batch::uniform(1, queries, 7 - queries);
    EXPECT_TRUE(all_close(sdpa(batch, q, paged, AttentionMask::causal(), 0.3f),
                          sdpa(batch, q, contiguous, AttentionMask::causal(), 0.3f), 1e-6f))
        << queries << " queries";
  }
}

// Half-precision blocks (of a pool of several heads) are converted a head at a time: every head
// attends over its own keys, on the prefill and the decode paths.
TEST(PagedHistory, HalfPrecisionBlocksAreReadHeadByHead) {
  std::mt19937 rng(9);
  for (const DType dtype : {DType::f16, DType::bf16}) {
    const Array keys = random_array({1, 3, 12, 8}, rng).astype(dtype);
    const Array values = random_array({1, 3, 12, 8}, rng).astype(dtype);
    const KVHistory paged(PagedColumns{{keys}, {values}, 3, 4, {2, 0, 1}, 10});
    const KVHistory contiguous = paged.contiguous();
    for (const int64_t queries : {int64_t{4}, int64_t{1}}) {
      const Array q = random_array({1, 6, queries, 8}, rng);
      const auto batch = Batch::uniform(1, queries, 10 - queries);
      EXPECT_TRUE(all_close(sdpa(batch, q, paged, AttentionMask::causal(), 0.3f),
                            sdpa(batch, q, contiguous, AttentionMask::causal(), 0.3f), 1e-6f))
          << dtype_name(dtype) << ", " << queries << " queries";
    }
  }
}

// A paged history is one sequence's: a batch of several rows needs one history per row.
TEST(PagedHistory, OneSequenceServesOneRow) {
  std::mt19937 rng(6);
  const Array keys = random_array({1, 2, 8, 8}, rng), values = random_array({1, 2, 8, 8}, rng);
  const KVHistory history(PagedColumns{{keys}, {values}, 4, 2, {0, 1}, 3});
  EXPECT_TRUE(throws_error(
      [&] {
        (void)sdpa(Batch::uniform(2, 1, 3), random_array({2, 4, 1, 8}, rng), history,
                   AttentionMask::causal(), 0.3f);
      },
      {"sdpa", "a paged history holds one sequence", "2 rows"}));
}

// Rows whose blocks lie in pools of other geometries (their chunks' head strides differ) decode
// each over its own keys.
TEST(PagedHistory, RowsOfPoolsWithOtherStridesDecodeOverTheirOwnKeys) {
  std::mt19937 rng(7);
  const int64_t heads = 2, tokens = 4, depth = 32;
  const auto chunk = [&](int64_t per_chunk) {
    return random_array({1, heads, per_chunk * tokens, depth}, rng);
  };
  const Array wide_k = chunk(16), wide_v = chunk(16), narrow_k = chunk(2), narrow_v = chunk(2);
  const std::vector<int32_t> wide_table{5, 2, 9}, narrow_table{1, 0};
  const KVHistory rows = KVHistory::of_rows(
      {KVHistory(PagedColumns{{wide_k}, {wide_v}, 16, tokens, wide_table, 11}),
       KVHistory(PagedColumns{{narrow_k}, {narrow_v}, 2, tokens, narrow_table, 7})});
  const Array q = random_array({2, 4, 1, depth}, rng);
  const Batch batch = Batch::rows({{0, 10, {0}}, {1, 6, {0}}});
  const Array out = sdpa(batch, q, rows, AttentionMask::causal(), 0.2f);
  const std::pair<Array, Array> own[2] = {{gather_paged({wide_k}, 16, tokens, wide_table, 11),
                                           gather_paged({wide_v}, 16, tokens, wide_table, 11)},
                                          {gather_paged({narrow_k}, 2, tokens, narrow_table, 7),
                                           gather_paged({narrow_v}, 2, tokens, narrow_table, 7)}};
  for (int64_t b = 0; b < 2; ++b) {
    const auto& [k, v] = own[b];
    const Array expected = sdpa(Batch::uniform(1, 1, k.dim(2) - 1), q.slice(0, b, b + 1),
                                KVHistory(k, v), AttentionMask::causal(), 0.2f);
    EXPECT_TRUE(all_close(out.slice(0, b, b + 1), expected, 1e-5f)) << "row " << b;
  }
}

// Rows that hold the same key blocks beside value blocks of their own (nothing says values follow
// keys) each weigh their own values, with the decode kernels and without.
TEST(PagedHistory, RowsSharingKeysButNotValuesWeighTheirOwnValues) {
  std::mt19937 rng(10);
  const int64_t depth = 32;
  const Array keys = random_array({1, 2, 16, depth}, rng);
  const Array values[2] = {random_array({1, 2, 16, depth}, rng),
                           random_array({1, 2, 16, depth}, rng)};
  const std::vector<int32_t> table{2, 0, 3};
  const KVHistory rows =
      KVHistory::of_rows({KVHistory(PagedColumns{{keys}, {values[0]}, 4, 4, table, 10}),
                          KVHistory(PagedColumns{{keys}, {values[1]}, 4, 4, table, 10})});
  const Array q = random_array({2, 4, 1, depth}, rng);
  const Batch batch = Batch::rows({{0, 9, {0}}, {1, 9, {0}}});
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    const Array out = sdpa(batch, q, rows, AttentionMask::causal(), 0.2f);
    for (int64_t b = 0; b < 2; ++b) {
      const Array k = gather_paged({keys}, 4, 4, table, 10);
      const Array v = gather_paged({values[b]}, 4, 4, table, 10);
      const Array expected = sdpa(Batch::uniform(1, 1, 9), q.slice(0, b, b + 1), KVHistory(k, v),
                                  AttentionMask::causal(), 0.2f);
      EXPECT_TRUE(all_close(out.slice(0, b, b + 1), expected, 1e-5f))
          << "row " << b << ", kernels " << kernels;
    }
  }
}

}  // namespace
}  // namespace kvsnap
