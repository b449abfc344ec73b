// A hybrid model's state for prefix-cache tests: full attention (KVCache), sliding-window
// attention (RotatingKVCache), a recurrent layer (RecurrentCache) and a stateless layer, each
// driven by the reference kernels from token ids, with a from-scratch reference.
#pragma once

#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <algorithm>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "support/cache_support.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap::testing {

struct StackOptions {
  bool with_recurrent = true;
  int64_t window = 8;
  bool paged = false;  // the attention layer: PagedKVCache instead of KVCache
  int64_t block_tokens = 4;
  // Check on every write that the attention layer copies exactly what lazy snapshots name (a
  // KVCache only; not with several threads writing, whose copies interleave).
  bool check_copies = true;
};

class HybridStack {
 public:
  static constexpr int64_t kWindow = 8;
  static constexpr int64_t kQueryHeads = 4;

  explicit HybridStack(bool with_recurrent = true, int64_t window_size = kWindow)
      : HybridStack(StackOptions{.with_recurrent = with_recurrent, .window = window_size}) {}
  explicit HybridStack(const StackOptions& options)
      : options_(options),
        attention_(options.paged ? std::unique_ptr<Attention>(std::make_unique<PagedKVCache>(
                                       PagedKVCache::Options{options.block_tokens, 8}))
                                 : std::make_unique<KVCache>()),
        window(options.window) {}

  std::vector<Cache*> layers() {
    std::vector<Cache*> out{attention_.get(), &window, nullptr};
    if (options_.with_recurrent) out.push_back(&recurrent);
    return out;
  }
  Attention& attention() { return *attention_; }
  int64_t offset(SeqId slot = 0) const { return attention_->offset(slot); }

  // Runs `tokens` through every layer at the caches' offset of sequence `slot` and checks the
  // outputs against recomputing `sequence` (the whole sequence so far, ending with `tokens`)
  // from scratch.
  ::testing::AssertionResult forward_and_check(std::span<const int32_t> tokens,
                                               std::span<const int32_t> sequence, SeqId slot = 0) {
    return forward_rows_and_check(
        {{slot, {tokens.begin(), tokens.end()}, {sequence.begin(), sequence.end()}}});
  }

  // One row of a step over several sequences: `tokens` at sequence `slot`'s offset, ending
  // `sequence` (the whole sequence so far).
  struct Row {
    SeqId slot = 0;
    std::vector<int32_t> tokens, sequence;
  };
  // As forward_and_check, for several sequences in one step: the attention layers take one
  // heterogeneous batch (each row at its own offset, padded to the longest), the recurrent
  // layer row by row; each row is checked against recomputing its own sequence.
  ::testing::AssertionResult forward_rows_and_check(const std::vector<Row>& rows) {
    std::vector<Batch::Chunk> chunks;
    int64_t longest = 0, named = 0, written = 0;
    // Copy only what would be lost: the writes copy out exactly the slots lazy snapshots still
    // name, never more than the bytes they overwrite.
    auto* contiguous = dynamic_cast<KVCache*>(attention_.get());
    const bool check = options_.check_copies && contiguous != nullptr;
    for (const Row& row : rows) {
      const int64_t start = offset(row.slot), length = static_cast<int64_t>(row.tokens.size());
      if (start + length != static_cast<int64_t>(row.sequence.size())) {
        return ::testing::AssertionFailure()
               << "slot " << row.slot << ": caches at " << start << " + " << length
               << " tokens != sequence of " << row.sequence.size();
      }
      chunks.push_back({row.slot, start, row.tokens});
      longest = std::max(longest, length);
      written += length;
      if (check) named += contiguous->lazy_bytes(row.slot, start, start + length);
    }
    const Batch batch = Batch::rows(chunks);
    const auto count = static_cast<int64_t>(rows.size());
    Array keys = Array::zeros(DType::f32, {count, kv_.heads, longest, kv_.depth});
    Array values = keys.clone();
    Array q = Array::zeros(DType::f32, {count, kQueryHeads, longest, kv_.depth});
    for (int64_t b = 0; b < count; ++b) {
      const std::vector<int64_t> ids = widen(rows[static_cast<size_t>(b)].tokens);
      const auto length = static_cast<int64_t>(ids.size());
      keys.slice(0, b, b + 1).slice(2, 0, length).assign(kv_.keys(ids));
      values.slice(0, b, b + 1).slice(2, 0, length).assign(kv_.values(ids));
      q.slice(0, b, b + 1).slice(2, 0, length).assign(queries(ids, batch.seq_offsets[b]));
    }
    const int64_t copied_before = attention_->copy_stats().materialized_bytes;
    const Array a =
        sdpa(batch, q, attention_->update(batch, keys, values), AttentionMask::causal(), 0.5f);
    const int64_t copied = attention_->copy_stats().materialized_bytes - copied_before;
    if (check && (copied != named || copied > written * token_bytes())) {
      return ::testing::AssertionFailure()
             << "writing " << written << " tokens in " << count << " rows copied " << copied
             << " bytes; lazy snapshots named " << named << " of the " << written * token_bytes()
             << " it overwrote";
    }
    const Array w =
        sdpa(batch, q, window.update(batch, keys, values), AttentionMask::causal(), 0.5f);
    for (int64_t b = 0; b < count; ++b) {
      const Row& row = rows[static_cast<size_t>(b)];
      const std::vector<int64_t> ids = widen(row.tokens), all = widen(row.sequence);
      const auto length = static_cast<int64_t>(ids.size());
      const int64_t start = batch.seq_offsets[b];
      const Batch one = Batch::uniform(1, length, start);
      const Array qb = queries(ids, start);
      const KVHistory full(kv_.keys(all), kv_.values(all));
      const auto got = [&](const Array& out) {
        return out.slice(0, b, b + 1).slice(2, 0, length).contiguous();
      };
      if (auto r = all_close(got(a), sdpa(one, qb, full, AttentionMask::causal(), 0.5f), 1e-4f);
          !r) {
        return r << " (full attention, slot " << row.slot << ", positions from " << start << ")";
      }
      const AttentionMask sliding = AttentionMask::sliding_window(options_.window);
      if (auto r = all_close(got(w), sdpa(one, qb, full, sliding, 0.5f), 1e-4f); !r) {
        return r << " (sliding window, slot " << row.slot << ", positions from " << start << ")";
      }
      if (options_.with_recurrent) {
        const auto out = recurrent_layer_.forward(recurrent, ids, row.slot);
        const auto expected = recurrent_layer_.reference(all);
        if (auto r = all_close(out.delta, expected.delta.slice(1, start, start + length), 1e-4f);
            !r) {
          return r << " (recurrent, slot " << row.slot << ", positions from " << start << ")";
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  // Bytes of one token's keys and values in the attention layers.
  int64_t token_bytes() const { return 2 * kv_.heads * kv_.depth * dtype_size(kv_.dtype); }

  StackOptions options_;
  std::unique_ptr<Attention> attention_;
  RotatingKVCache window;
  RecurrentLayer recurrent_layer_;
  RecurrentCache recurrent = recurrent_layer_.make_cache();

 private:
  static std::vector<int64_t> widen(std::span<const int32_t> tokens) {
    return std::vector<int64_t>(tokens.begin(), tokens.end());
  }
  // Queries depend on the token and its position (as with rotary embeddings).
  Array queries(const std::vector<int64_t>& ids, int64_t start) const {
    std::vector<float> data;
    for (int64_t h = 0; h < kQueryHeads; ++h)
      for (size_t l = 0; l < ids.size(); ++l)
        for (int64_t d = 0; d < kv_.depth; ++d)
          data.push_back(std::sin(0.31f * static_cast<float>(ids[l]) +
                                  0.17f * static_cast<float>(start + static_cast<int64_t>(l)) +
                                  0.53f * static_cast<float>(h * kv_.depth + d)));
    return Array::from_floats(data, {1, kQueryHeads, static_cast<int64_t>(ids.size()), kv_.depth});
  }

  TokenKV kv_{.heads = 2, .depth = 4};
};

// Token lists for the tests that drive a stack: first, first + 1, ... (count of them), and two
// lists one after the other.
inline std::vector<int32_t> range(int32_t first, int32_t count) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < count; ++i) out.push_back(first + i);
  return out;
}
inline std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace kvsnap::testing
