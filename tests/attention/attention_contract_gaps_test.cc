// PagedColumns::key_block / value_block (attention.h): keys [1, H, T, D] and values [1, H, T, Dv]
// of a table entry's block, as views of its chunk — the values block i holds, and the storage
// the cache's blocks are kept in, not a copy.
#include <gtest/gtest.h>
#include <kvsnap/attention.h>
#include <kvsnap/paged_kv_cache.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "support/cache_support.h"
#include "support/test_support.h"

namespace kvsnap::attention_contract_gaps_test {
namespace {

using testing::id_range;
using testing::TokenKV;

// Chunk c of a hand-made pool: element [0, h, column, d] = 1000 c + 100 h + 10 column + d, so
// every element says where it lives.
Array chunk(int64_t c, int64_t heads, int64_t columns, int64_t depth) {
  std::vector<float> data;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t column = 0; column < columns; ++column)
      for (int64_t d = 0; d < depth; ++d)
        data.push_back(static_cast<float>(1000 * c + 100 * h + 10 * column + d));
  return Array::from_floats(data, {1, heads, columns, depth});
}

// A table in no particular order over two chunks of two blocks of 3 tokens: entry i's keys are
// columns [r * T, (r + 1) * T) of chunk table[i] / 2 (r = table[i] % 2), its values the same of
// the value chunks; each a view of its chunk (writing the chunk shows through it).
TEST(PagedColumnsBlocks, KeyAndValueBlocksAreViewsOfTheTableEntrysBlock) {
  constexpr int64_t kHeads = 2, kDepth = 4, kValueDepth = 3, kTokens = 3, kPerChunk = 2;
  PagedColumns p;
  p.blocks_per_chunk = kPerChunk;
  p.block_tokens = kTokens;
  for (int64_t c = 0; c < 2; ++c) {
    p.key_chunks.push_back(chunk(c, kHeads, kPerChunk * kTokens, kDepth));
    p.value_chunks.push_back(chunk(c + 5, kHeads, kPerChunk * kTokens, kValueDepth));
  }
  p.table = {3, 0, 2};
  p.length = 8;
  for (size_t i = 0; i < p.table.size(); ++i) {
    const int64_t id = p.table[i], c = id / kPerChunk, first = id % kPerChunk * kTokens;
    const Array keys = p.key_block(i), values = p.value_block(i);
    ASSERT_EQ(keys.shape(), (Shape{1, kHeads, kTokens, kDepth})) << i;
    ASSERT_EQ(values.shape(), (Shape{1, kHeads, kTokens, kValueDepth})) << i;
    EXPECT_EQ(keys.to_floats(),
              p.key_chunks[static_cast<size_t>(c)].slice(2, first, first + kTokens).to_floats())
        << i;
    EXPECT_EQ(values.to_floats(),
              p.value_chunks[static_cast<size_t>(c)].slice(2, first, first + kTokens).to_floats())
        << i;
    EXPECT_EQ(keys.to_floats()[0], static_cast<float>(1000 * c + 10 * first)) << i;
    // Views: the chunk's storage, at the block's first column.
    EXPECT_TRUE(keys.shares_storage(p.key_chunks[static_cast<size_t>(c)])) << i;
    EXPECT_TRUE(values.shares_storage(p.value_chunks[static_cast<size_t>(c)])) << i;
    EXPECT_EQ(keys.data<float>(),
              p.key_chunks[static_cast<size_t>(c)].data<float>() + first * kDepth)
        << i;
    const float mark = -1.0f - static_cast<float>(i);
    p.key_chunks[static_cast<size_t>(c)].mutable_data<float>()[first * kDepth] = mark;
    p.value_chunks[static_cast<size_t>(c)].mutable_data<float>()[first * kValueDepth] = mark - 1;
    EXPECT_EQ(keys.to_floats()[0], mark) << i;
    EXPECT_EQ(values.to_floats()[0], mark - 1) << i;
  }
}

// The paged history a PagedKVCache hands back: block i of its table holds tokens
// [i T, (i + 1) T), and its views share the storage of the cache's own blocks (the live state
// the cache reports, and the history a later view returns).
TEST(PagedColumnsBlocks, ACachesBlocksAreReadInPlaceThroughThem) {
  const TokenKV kv;
  PagedKVCache cache(PagedKVCache::Options{.block_tokens = 4, .blocks_per_chunk = 2});
  const std::vector<int64_t> ids = id_range(100, 10);
  const KVHistory history = testing::write(cache, kv, ids);
  ASSERT_TRUE(history.paged());
  const PagedColumns& p = history.paged_columns();
  ASSERT_EQ(p.length, 10);
  ASSERT_EQ(p.table.size(), 3U);
  const KVHistory later = cache.view(Batch{});
  ASSERT_TRUE(later.paged());
  for (size_t i = 0; i < p.table.size(); ++i) {
    const Array keys = p.key_block(i), values = p.value_block(i);
    ASSERT_EQ(keys.shape(), (Shape{1, kv.heads, 4, kv.depth})) << i;
    ASSERT_EQ(values.shape(), (Shape{1, kv.heads, 4, kv.depth})) << i;
    const auto count = static_cast<int64_t>(std::min<size_t>(4, ids.size() - 4 * i));
    const std::vector<int64_t> held(ids.begin() + static_cast<int64_t>(4 * i),
                                    ids.begin() + static_cast<int64_t>(4 * i) + count);
    EXPECT_EQ(keys.slice(2, 0, count).to_floats(), kv.keys(held).to_floats()) << i;
    EXPECT_EQ(values.slice(2, 0, count).to_floats(), kv.values(held).to_floats()) << i;
    const auto chunk_of = static_cast<size_t>(p.table[i] / p.blocks_per_chunk);
    EXPECT_TRUE(keys.shares_storage(p.key_chunks[chunk_of])) << i;
    EXPECT_TRUE(values.shares_storage(p.value_chunks[chunk_of])) << i;
    // The same memory as the cache's blocks seen through a later view.
    EXPECT_EQ(keys.data<float>(), later.paged_columns().key_block(i).data<float>()) << i;
    EXPECT_EQ(values.data<float>(), later.paged_columns().value_block(i).data<float>()) << i;
  }
}

}  // namespace
}  // namespace kvsnap::attention_contract_gaps_test
