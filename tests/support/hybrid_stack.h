// A hybrid model's state for prefix-cache tests: full attention (KVCache), sliding-window
// attention (RotatingKVCache), a recurrent layer (RecurrentCache) and a stateless layer, each
// driven by the reference kernels from token ids, with a from-scratch reference.
#pragma once

#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

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
    const int64_t start = offset(slot);
    const auto length = static_cast<int64_t>(tokens.size());
    if (start + length != static_cast<int64_t>(sequence.size())) {
      return ::testing::AssertionFailure() << "caches at " << start << " + " << length
                                           << " tokens != sequence of " << sequence.size();
    }
    const std::vector<int64_t> ids = widen(tokens);
    const std::vector<int64_t> all = widen(sequence);
    Batch batch = Batch::uniform(1, length, start);
    batch.seq_ids = {slot};
    const Array q = queries(ids, start);
    const KVHistory full(kv_.keys(all), kv_.values(all));
    // Copy only what would be lost: the write copies out exactly the slots of [start, end)
    // that lazy snapshots still name, never more than the bytes it overwrites.
    auto* contiguous = dynamic_cast<KVCache*>(attention_.get());
    const bool check = options_.check_copies && contiguous != nullptr;
    const int64_t named = check ? contiguous->lazy_bytes(slot, start, start + length) : 0;
    const int64_t copied_before = attention_->copy_stats().materialized_bytes;
    const Array a = sdpa(batch, q, attention_->update(batch, kv_.keys(ids), kv_.values(ids)),
                         AttentionMask::causal(), 0.5f);
    const int64_t copied = attention_->copy_stats().materialized_bytes - copied_before;
    if (check && (copied != named || copied > length * token_bytes())) {
      return ::testing::AssertionFailure()
             << "writing positions [" << start << ", " << start + length << ") copied " << copied
             << " bytes; lazy snapshots named " << named << " of the " << length * token_bytes()
             << " it overwrote";
    }
    if (auto r = all_close(a, sdpa(batch, q, full, AttentionMask::causal(), 0.5f), 1e-4f); !r) {
      return r << " (full attention, positions from " << start << ")";
    }
    const Array w = sdpa(batch, q, window.update(batch, kv_.keys(ids), kv_.values(ids)),
                         AttentionMask::causal(), 0.5f);
    if (auto r = all_close(
            w, sdpa(batch, q, full, AttentionMask::sliding_window(options_.window), 0.5f), 1e-4f);
        !r) {
      return r << " (sliding window, positions from " << start << ")";
    }
    if (options_.with_recurrent) {
      const auto out = recurrent_layer_.forward(recurrent, ids, slot);
      const auto expected = recurrent_layer_.reference(all);
      if (auto r = all_close(out.delta, expected.delta.slice(1, start, start + length), 1e-4f);
          !r) {
        return r << " (recurrent, positions from " << start << ")";
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

}  // namespace kvsnap::testing
