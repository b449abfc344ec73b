// Internal: the blocks of a PagedKVCache and the snapshots made of them.
//
// A block is referenced by sequences ("live" references) and by snapshots ("holders"). While a
// sequence uses a block, its bytes are the cache's; once no sequence does, one holder pays for
// them (its size() includes the block) — so the bytes of blocks only snapshots keep are counted
// exactly once, and a holder's materialize hook runs whenever what it pays for changes.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attention/recycler.h"
#include "cache/kv_layout.h"
#include "cache/sequences.h"
#include "cache/state_snapshot.h"
#include "kvsnap/attention.h"

namespace kvsnap::detail {

class PagedSnapshot;

class BlockPool {
 public:
  // Block ids are int32: a pool never holds more blocks.
  static constexpr int64_t kMaxBlocks = INT32_MAX;

  // block_tokens * blocks_per_chunk <= kMaxTokens and blocks_per_chunk <= kMaxBlocks (checked
  // by PagedKVCache).
  BlockPool(int64_t block_tokens, int64_t blocks_per_chunk)
      : block_tokens(block_tokens), blocks_per_chunk(blocks_per_chunk) {
    spare_lists_.reserve(kSpareLists);  // a snapshot's destruction allocates nothing
  }

  int64_t block_bytes() const { return layout.token_bytes() * block_tokens; }
  // Blocks that hold `tokens` tokens from a block's start.
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_tokens - 1) / block_tokens; }
  // A free block (the pool grows by a chunk when none is left), not yet referenced.
  int32_t allocate(const char* call);
  // Grows the pool until at least `count` blocks are free, so the next `count` allocate() calls
  // allocate no storage. A growth that throws (std::bad_alloc) leaves the pool as it was.
  void reserve(int64_t count, const char* call);
  // A block allocate() gave that nobody came to reference (what was to reference it failed):
  // free again.
  void give_back(int32_t id) { settle(id); }
  // When no block is referenced (by a sequence or a snapshot): drops every block and chunk,
  // their memory going back (histories handed out keep the chunks they view), and the layout,
  // so the next write takes any layout. Otherwise nothing.
  void drop_if_unused();
  // Keys [1, H, T, D] / values [1, H, T, Dv] of block `id` (views of its chunk).
  Array keys(int32_t id) const;
  Array values(int32_t id) const;
  // Copies the first `tokens` tokens of block `from` into block `to` (freshly allocated), which
  // remembers that it began as that copy.
  void copy(int32_t from, int32_t to, int64_t tokens);
  // Records that `count` tokens were written into block `id` from slot `slot` on.
  void written(int32_t id, int64_t slot, int64_t count);
  // The block where `ours` (its tokens before `slot`) meets `theirs` (its tokens from `slot` to
  // `end`) mid-block: `theirs` when it is the same block or its first `slot` tokens are ours
  // (one began as a copy of the other, or both of one block, unchanged since); else a fresh
  // block joining the two (counted in blocks_copied), not yet referenced.
  int32_t meet(int32_t ours, int32_t theirs, int64_t slot, int64_t end, const char* call);
  // Whether anyone but one sequence references the block (a write must copy it first).
  bool shared(int32_t id) const {
    const Block& b = blocks_[static_cast<size_t>(id)];
    return b.live > 1 || !b.holders.empty();
  }

  void acquire(int32_t id);  // a sequence starts using the block
  void release(int32_t id);  // a sequence stops using it
  // Room for one more holder of the block, so the next hold() of it allocates nothing (may
  // throw std::bad_alloc, changing nothing).
  void make_room_to_hold(int32_t id);
  // Never throws after make_room_to_hold(id).
  void hold(int32_t id, PagedSnapshot* holder);
  void unhold(int32_t id, PagedSnapshot* holder);
  bool live(int32_t id) const { return blocks_[static_cast<size_t>(id)].live > 0; }
  PagedSnapshot* payer(int32_t id) const { return blocks_[static_cast<size_t>(id)].payer; }

  // An empty list for a snapshot's blocks: one a snapshot gave back (its capacity kept) when any,
  // so a capture allocates nothing once warm. give_back_list never throws. Under the lock.
  std::vector<int32_t> take_list();
  void give_back_list(std::vector<int32_t>&& list) noexcept;
  // A paged history of `length` columns over `table`: its columns made in a recycled object
  // (detail::Recycler), so a decode step's history allocates nothing once warm. Under the lock.
  KVHistory history(const std::vector<int32_t>& table, int64_t length);
  // Blocks allocated, and those referenced by anyone.
  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t blocks_in_use() const { return blocks() - static_cast<int64_t>(free_.size()); }
  // Blocks some sequence uses (each once, however many share it).
  int64_t live_blocks() const { return live_blocks_; }

  const int64_t block_tokens, blocks_per_chunk;
  KVLayout layout;  // rows 1: set at the first write, fixed while a block is in use
  bool has_layout = false;
  // Whether the layout binds writes and restores: some block is in use. Otherwise the next one
  // may bring another (PagedSequence::adopt), the blocks kept for reuse dropped first.
  bool fixed() const { return has_layout && blocks_in_use() > 0; }
  CopyStats stats;  // copies on write (materialized) and joins at restore (restored)
  int64_t blocks_copied = 0;
  CacheLock lock;  // the cache's lock: its sequences, its snapshots and these blocks

 private:
  // Snapshots' block lists kept for the next captures: as many as captures live at once in a
  // serving step, usually (one per sequence and scheduled offset).
  static constexpr size_t kSpareLists = 64;
  std::vector<std::vector<int32_t>> spare_lists_;
  Recycler<PagedColumns> columns_{[](PagedColumns& c) {
    c.key_chunks.clear();  // the chunks' memory is not kept by a history kept for reuse
    c.value_chunks.clear();
    c.table.clear();
  }};
  struct Block {
    int32_t live = 0;
    std::vector<PagedSnapshot*> holders;
    PagedSnapshot* payer = nullptr;
    // What the block holds: `serial` is new whenever the block is allocated or tokens below
    // `filled` are written again; a copy keeps its source's serial then (`origin`) and how many
    // of its first tokens still are that copy (`origin_tokens`).
    uint64_t serial = 0, origin = 0;
    int64_t filled = 0, origin_tokens = 0;
  };
  // Adds a chunk of blocks_per_chunk free blocks. Throws Error (the pool unchanged) when the
  // chunk's arrays would hold more than 2^60 elements or its blocks pass kMaxBlocks.
  void grow(const char* call);
  // When no sequence uses the block: a holder pays for it, or it is free.
  void settle(int32_t id);
  // Whether blocks `a` and `b` hold the same first `tokens` tokens by the serials above.
  bool same_start(int32_t a, int32_t b, int64_t tokens) const;

  std::vector<Array> key_chunks_, value_chunks_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;
  int64_t live_blocks_ = 0;
  uint64_t next_serial_ = 0;
};

// Block references of a KV range [from, to): blocks_[i] holds positions
// [(first_block + i) * T, (first_block + i + 1) * T).
class PagedSnapshot final : public StateSnapshot, public Pooled<PagedSnapshot> {
 public:
  using Pooled<PagedSnapshot>::operator new;
  using Pooled<PagedSnapshot>::operator delete;

  // Takes references to `blocks` (already in the pool) for [from, to).
  PagedSnapshot(std::shared_ptr<BlockPool> pool, std::vector<int32_t> blocks, int64_t from,
                int64_t to);
  ~PagedSnapshot() override;

  int64_t size() const override;
  void set_materialize_hook(std::function<void(int64_t)> hook) override;
  int64_t hook_and_size(std::function<void(int64_t)> hook) override;
  int64_t from() const override { return begin_; }
  int64_t to() const override { return end_; }
  bool is_lazy() const override;
  // A copy of its tokens, gathered from its blocks.
  SnapshotRecord record() const override;
  // Its record's dtypes and shapes without the data (gathering it would copy every token):
  // writers copy the tokens they need from the blocks through copy_record.
  std::optional<SnapshotRecord> record_outline() const override;
  // Tokens [column, column + place's tokens) straight from the blocks.
  void copy_record(bool second, Array& place, int64_t column = 0) const override;

  const std::shared_ptr<BlockPool>& pool() const { return pool_; }
  const std::vector<int32_t>& blocks() const { return blocks_; }
  int64_t first_block() const { return begin_ / pool_->block_tokens; }
  // Calls visit(first token, keys, values) for the parts of its tokens [from, to) (counted
  // from its first), block by block (the pool's lock held by the caller).
  void for_each_part(int64_t from, int64_t to,
                     const std::function<void(int64_t, const Array&, const Array&)>& visit) const;
  // The same for its first `limit` tokens.
  void for_each_part(int64_t limit,
                     const std::function<void(int64_t, const Array&, const Array&)>& visit) const {
    for_each_part(0, limit, visit);
  }
  // Called by the pool when this snapshot starts or stops paying for a block.
  void paid(int64_t delta) {
    if (hook_ && delta != 0) hook_(delta);
  }

 private:
  std::shared_ptr<BlockPool> pool_;
  std::vector<int32_t> blocks_;
  int64_t begin_, end_;
  std::function<void(int64_t)> hook_;
};

}  // namespace kvsnap::detail
