#include "cache/block_pool.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvsnap::detail {

void BlockPool::grow(const char* call) {
  if (blocks() > kMaxBlocks - blocks_per_chunk) {
    throw Error(fmt::format(
        "{}: the pool holds {} blocks; another {} would pass 2^31 - 1, the most block ids name",
        call, blocks(), blocks_per_chunk));
  }
  const auto first = static_cast<int32_t>(blocks_.size());
  const auto count = static_cast<size_t>(blocks_per_chunk);
  // Head-major: a head's columns of consecutive blocks are consecutive (attention multiplies a
  // run of consecutive blocks at once).
  const int64_t columns = blocks_per_chunk * block_tokens;  // <= kMaxTokens
  for (const int64_t depth : {layout.key_depth, layout.value_depth}) {
    int64_t elements = 0;
    if (__builtin_mul_overflow(layout.heads, depth, &elements) ||
        __builtin_mul_overflow(elements, columns, &elements) || elements > kMaxTokens) {
      throw Error(fmt::format(
          "{}: a chunk of the pool, {} blocks of {} tokens of {}, would hold more than 2^60 "
          "elements, the most an array holds (choose a smaller block_tokens or blocks_per_chunk)",
          call, blocks_per_chunk, block_tokens, layout.describe()));
    }
  }
  Shape key_shape{1, layout.heads, columns, layout.key_depth};
  Shape value_shape{1, layout.heads, columns, layout.value_depth};
  Array keys = Array::uninitialized(layout.key_dtype, key_shape);
  Array values = Array::uninitialized(layout.value_dtype, value_shape);
  // Everything that may throw first (geometric growth): a failed growth leaves the pool as it
  // was.
  const auto room = [](auto& vector, size_t more) {
    if (vector.capacity() < vector.size() + more) {
      vector.reserve(std::max(vector.size() + more, 2 * vector.capacity()));
    }
  };
  room(key_chunks_, 1);
  room(value_chunks_, 1);
  // Room for every block at once: releasing blocks (destructors do) never allocates.
  room(free_, blocks_.size() + count - free_.size());
  blocks_.resize(blocks_.size() + count);
  key_chunks_.push_back(std::move(keys));
  value_chunks_.push_back(std::move(values));
  // Lowest ids first: free_ is popped from the back.
  for (int32_t id = static_cast<int32_t>(blocks_.size()) - 1; id >= first; --id) {
    free_.push_back(id);
  }
}

void BlockPool::drop_if_unused() {
  if (blocks_in_use() != 0) return;
  key_chunks_.clear();
  value_chunks_.clear();
  blocks_.clear();
  free_.clear();
  has_layout = false;
}

void BlockPool::reserve(int64_t count, const char* call) {
  while (static_cast<int64_t>(free_.size()) < count) grow(call);
}

int32_t BlockPool::allocate(const char* call) {
  if (free_.empty()) grow(call);
  const int32_t id = free_.back();
  free_.pop_back();
  Block& block = blocks_[static_cast<size_t>(id)];
  block.serial = ++next_serial_;
  block.origin = 0;
  block.filled = block.origin_tokens = 0;
  return id;
}

Array BlockPool::keys(int32_t id) const {
  const int64_t first = id % blocks_per_chunk * block_tokens;
  return key_chunks_[static_cast<size_t>(id / blocks_per_chunk)].slice(2, first,
                                                                       first + block_tokens);
}

Array BlockPool::values(int32_t id) const {
  const int64_t first = id % blocks_per_chunk * block_tokens;
  return value_chunks_[static_cast<size_t>(id / blocks_per_chunk)].slice(2, first,
                                                                         first + block_tokens);
}

void BlockPool::copy(int32_t from, int32_t to, int64_t tokens) {
  if (tokens <= 0) return;
  keys(to).assign_slice(2, 0, keys(from).slice(2, 0, tokens));
  values(to).assign_slice(2, 0, values(from).slice(2, 0, tokens));
  Block& copy = blocks_[static_cast<size_t>(to)];
  copy.origin = blocks_[static_cast<size_t>(from)].serial;
  copy.filled = copy.origin_tokens = tokens;
}

void BlockPool::written(int32_t id, int64_t slot, int64_t count) {
  Block& block = blocks_[static_cast<size_t>(id)];
  if (slot < block.filled) {  // tokens written again: what copied it no longer matches it
    block.serial = ++next_serial_;
    block.origin_tokens = std::min(block.origin_tokens, slot);
  }
  block.filled = slot + count;
}

int32_t BlockPool::meet(int32_t ours, int32_t theirs, int64_t slot, int64_t end, const char* call) {
  if (ours == theirs || same_start(ours, theirs, slot)) return theirs;
  const int32_t joined = allocate(call);
  copy(ours, joined, slot);
  keys(joined).assign_slice(2, slot, keys(theirs).slice(2, slot, end));
  values(joined).assign_slice(2, slot, values(theirs).slice(2, slot, end));
  written(joined, slot, end - slot);
  ++blocks_copied;
  return joined;
}

bool BlockPool::same_start(int32_t a, int32_t b, int64_t tokens) const {
  const Block &x = blocks_[static_cast<size_t>(a)], &y = blocks_[static_cast<size_t>(b)];
  const auto began_as = [tokens](const Block& copy, uint64_t serial) {
    return serial != 0 && copy.origin == serial && copy.origin_tokens >= tokens;
  };
  return began_as(x, y.serial) || began_as(y, x.serial) ||
         (began_as(x, x.origin) && began_as(y, x.origin));
}

void BlockPool::acquire(int32_t id) {
  Block& block = blocks_[static_cast<size_t>(id)];
  if (block.live == 0) ++live_blocks_;
  if (block.live++ == 0 && block.payer != nullptr) {
    // A sequence uses it again: its bytes are the cache's, not the snapshot's.
    PagedSnapshot* payer = block.payer;
    block.payer = nullptr;
    payer->paid(-block_bytes());
  }
}

void BlockPool::release(int32_t id) {
  Block& block = blocks_[static_cast<size_t>(id)];
  if (--block.live == 0) --live_blocks_;
  settle(id);
}

void BlockPool::make_room_to_hold(int32_t id) {
  std::vector<PagedSnapshot*>& holders = blocks_[static_cast<size_t>(id)].holders;
  if (holders.size() == holders.capacity())
    holders.reserve(std::max<size_t>(4, 2 * holders.size()));
}

void BlockPool::hold(int32_t id, PagedSnapshot* holder) {
  Block& block = blocks_[static_cast<size_t>(id)];
  block.holders.push_back(holder);
  if (block.live == 0 && block.payer == nullptr) block.payer = holder;  // counted in its size()
}

void BlockPool::unhold(int32_t id, PagedSnapshot* holder) {
  Block& block = blocks_[static_cast<size_t>(id)];
  block.holders.erase(std::find(block.holders.begin(), block.holders.end(), holder));
  if (block.payer == holder) block.payer = nullptr;  // it goes: its bytes go with it
  settle(id);
}

void BlockPool::settle(int32_t id) {
  Block& block = blocks_[static_cast<size_t>(id)];
  if (block.live > 0 || block.payer != nullptr) return;
  if (block.holders.empty()) {
    free_.push_back(id);
    return;
  }
  block.payer = block.holders.front();
  block.payer->paid(block_bytes());
}

std::vector<int32_t> BlockPool::take_list() {
  if (spare_lists_.empty()) return {};
  std::vector<int32_t> list = std::move(spare_lists_.back());
  spare_lists_.pop_back();
  return list;
}

void BlockPool::give_back_list(std::vector<int32_t>&& list) noexcept {
  // A long list (a long prefix's) is not kept: at most kSpareLists x 4096 entries wait.
  if (spare_lists_.size() >= kSpareLists || list.capacity() == 0 || list.capacity() > 4096) return;
  list.clear();
  spare_lists_.push_back(std::move(list));  // within the capacity reserved
}

KVHistory BlockPool::history(const std::vector<int32_t>& table, int64_t length) {
  return HistoryParts::paged(columns_.make([&](PagedColumns& c) {
    c.key_chunks.assign(key_chunks_.begin(), key_chunks_.end());
    c.value_chunks.assign(value_chunks_.begin(), value_chunks_.end());
    c.blocks_per_chunk = blocks_per_chunk;
    c.block_tokens = block_tokens;
    // Geometric growth: a sequence's history grows a block at a time.
    if (c.table.capacity() < table.size())
      c.table.reserve(std::max(table.size(), 2 * c.table.capacity()));
    c.table.assign(table.begin(), table.end());
    c.length = length;
  }));
}

// ---- PagedSnapshot ----------------------------------------------------------------------------

PagedSnapshot::PagedSnapshot(std::shared_ptr<BlockPool> pool, std::vector<int32_t> blocks,
                             int64_t from, int64_t to)
    : StateSnapshot(SnapshotRecord::Kind::kv),
      pool_(std::move(pool)),
      blocks_(std::move(blocks)),
      begin_(from),
      end_(to) {
  // Room first, then the references: running out of memory leaves no block held (the
  // destructor does not run for a constructor that throws).
  for (int32_t id : blocks_) pool_->make_room_to_hold(id);
  for (int32_t id : blocks_) pool_->hold(id, this);
}

PagedSnapshot::~PagedSnapshot() {
  const Guard guard(pool_->lock);
  hook_ = nullptr;  // its bytes leave with it; the holder that pays next is told
  for (int32_t id : blocks_) pool_->unhold(id, this);
  pool_->give_back_list(std::move(blocks_));
}

int64_t PagedSnapshot::size() const {
  const Guard guard(pool_->lock);
  int64_t blocks = 0;
  for (int32_t id : blocks_) blocks += pool_->payer(id) == this ? 1 : 0;
  return blocks * pool_->block_bytes();
}

void PagedSnapshot::set_materialize_hook(std::function<void(int64_t)> hook) {
  const Guard guard(pool_->lock);
  hook_ = std::move(hook);
}

int64_t PagedSnapshot::hook_and_size(std::function<void(int64_t)> hook) {
  const Guard guard(pool_->lock);
  hook_ = std::move(hook);
  return size();
}

bool PagedSnapshot::is_lazy() const {
  const Guard guard(pool_->lock);
  return std::any_of(blocks_.begin(), blocks_.end(), [&](int32_t id) { return pool_->live(id); });
}

void PagedSnapshot::for_each_part(
    int64_t from, int64_t to,
    const std::function<void(int64_t, const Array&, const Array&)>& visit) const {
  const int64_t block_tokens = pool_->block_tokens;
  // From the block holding token `from` (a chunk of a long snapshot visits its own blocks only).
  const auto first =
      static_cast<size_t>(std::max<int64_t>(0, (begin_ + from) / block_tokens - first_block()));
  for (size_t i = first; i < blocks_.size(); ++i) {
    const int64_t block_start = (first_block() + static_cast<int64_t>(i)) * block_tokens;
    if (block_start >= begin_ + to) break;
    const int64_t lo = std::max(begin_ + from, block_start) - begin_;
    const int64_t hi = std::min(begin_ + to, block_start + block_tokens) - begin_;
    if (hi <= lo) continue;
    const int64_t slot = lo + begin_ - block_start;
    visit(lo, pool_->keys(blocks_[i]).slice(2, slot, slot + hi - lo),
          pool_->values(blocks_[i]).slice(2, slot, slot + hi - lo));
  }
}

SnapshotRecord PagedSnapshot::record() const {
  const Guard guard(pool_->lock);
  const int64_t tokens = end_ - begin_;
  auto buffers = pool_->layout.allocate_uninitialized(tokens);
  Array& keys = buffers.first;
  Array& values = buffers.second;
  for_each_part(tokens, [&](int64_t first, const Array& k, const Array& v) {
    keys.assign_slice(2, first, k);
    values.assign_slice(2, first, v);
  });
  return {SnapshotRecord::Kind::kv, std::move(keys), std::move(values), begin_, end_};
}

std::optional<SnapshotRecord> PagedSnapshot::record_outline() const {
  // One element behind every index (zero strides): the shapes without the data.
  alignas(16) static std::byte nothing[16]{};
  const KVLayout& layout = pool_->layout;
  const int64_t tokens = end_ - begin_;
  const auto outline = [&](DType dtype, int64_t depth) {
    return Array::wrap(nothing, dtype, {layout.rows, layout.heads, tokens, depth}, {0, 0, 0, 0});
  };
  SnapshotRecord out{SnapshotRecord::Kind::kv, outline(layout.key_dtype, layout.key_depth),
                     outline(layout.value_dtype, layout.value_depth), begin_, end_};
  out.live = true;  // read through copy_record
  return out;
}

void PagedSnapshot::copy_record(bool second, Array& place, int64_t column) const {
  const Guard guard(pool_->lock);  // blocks a snapshot holds are never written; the pool may grow
  for_each_part(column, column + place.dim(2), [&](int64_t first, const Array& k, const Array& v) {
    place.assign_slice(2, first - column, second ? v : k);
  });
}

}  // namespace kvsnap::detail
