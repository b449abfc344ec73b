#include "cache/kv_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <new>

#include "array/streaming.h"

namespace kvsnap::detail {
namespace {

// Storage for a piece of `tokens` tokens, its owned prefix to be filled by the caller.
void allocate_storage(Piece& piece, const KVLayout& layout, int64_t tokens) {
  auto [keys, values] = layout.allocate_uninitialized(tokens);
  piece.keys = std::move(keys);
  piece.values = std::move(values);
}

int64_t storage_bytes(const Piece& piece) {
  return piece.keys.empty() ? 0 : piece.keys.nbytes() + piece.values.nbytes();
}

// Splits `piece` at token `cut` (0 < cut < tokens); returns the second half. Lazy tokens split
// by arithmetic; owned tokens are copied into compact storage for each half, so each piece's
// storage stays exactly its own (its size() is what it holds). Everything is allocated before
// `piece` changes: running out of memory leaves it as it was (still in the lazy index).
std::unique_ptr<Piece> cut_piece(Piece& piece, int64_t cut, KVStore* store, CopyStats& copies) {
  auto second = std::make_unique<Piece>();
  second->snapshot = piece.snapshot;
  second->tokens = piece.tokens - cut;
  second->column = piece.column + cut;
  second->owned = std::max<int64_t>(0, piece.owned - cut);
  const int64_t kept = std::min(piece.owned, cut);
  Piece first;  // the first half's storage, when it keeps owned tokens
  const bool owns = !piece.keys.empty();
  const KVLayout& layout = piece.snapshot->layout;
  if (owns && second->owned > 0) allocate_storage(*second, layout, second->tokens);
  if (owns && kept > 0) allocate_storage(first, layout, cut);
  if (piece.indexed) store->unlink(piece);
  if (owns) {
    const int64_t before = storage_bytes(piece);
    if (second->owned > 0) {
      second->keys.assign_slice(2, 0, piece.keys.slice(2, cut, cut + second->owned));
      second->values.assign_slice(2, 0, piece.values.slice(2, cut, cut + second->owned));
      copies.snapshot_bytes += second->owned * layout.token_bytes();
    }
    if (kept > 0) {
      first.keys.assign_slice(2, 0, piece.keys.slice(2, 0, kept));
      first.values.assign_slice(2, 0, piece.values.slice(2, 0, kept));
      copies.snapshot_bytes += kept * layout.token_bytes();
      piece.keys = std::move(first.keys);
      piece.values = std::move(first.values);
    } else {
      piece.keys = Array();
      piece.values = Array();
    }
    piece.snapshot->storage_changed(storage_bytes(piece) - before);
  }
  piece.tokens = cut;
  piece.owned = std::min(piece.owned, cut);
  if (piece.lazy()) store->link(piece);
  if (second->lazy()) store->link(*second);
  return second;
}

const char* cache_name(SnapshotRecord::Kind kind) {
  return kind == SnapshotRecord::Kind::kv ? "KVCache" : "RotatingKVCache";
}

}  // namespace

// ---- KVStateSnapshot ------------------------------------------------------------------------

KVStateSnapshot::KVStateSnapshot(SnapshotRecord::Kind kind, KVStore& store, int64_t column,
                                 int64_t tokens, int64_t from, int64_t to, int64_t window)
    : StateSnapshot(kind),
      layout(store.layout),
      begin(from),
      end(to),
      window(window),
      owner_(tokens > 0 ? &store : nullptr),
      lock_(tokens > 0 ? store.lock : nullptr),
      tokens_(tokens) {
  head_.snapshot = this;
  head_.tokens = tokens;
  head_.column = column;
  if (tokens > 0) store.link(head_);
}

KVStateSnapshot::KVStateSnapshot(SnapshotRecord::Kind kind, const KVLayout& layout, Array keys,
                                 Array values, int64_t from, int64_t to, int64_t window)
    : StateSnapshot(kind),
      layout(layout),
      begin(from),
      end(to),
      window(window),
      owner_(nullptr),
      tokens_(keys.dim(2)) {
  head_.snapshot = this;
  head_.tokens = tokens_;
  head_.owned = tokens_;
  head_.keys = std::move(keys);
  head_.values = std::move(values);
}

KVStateSnapshot::~KVStateSnapshot() {
  locked([&] {  // the store's index may be in use on another thread
    if (KVStore* store = owner()) for_each_piece([&](Piece& piece) { store->unlink(piece); });
  });
  for (Piece* piece = head_.next; piece != nullptr;) {
    Piece* next = piece->next;
    delete piece;
    piece = next;
  }
}

template <class Visit>
void KVStateSnapshot::for_each_piece(Visit&& visit) {
  for (Piece* piece = &head_; piece != nullptr; piece = piece->next) visit(*piece);
}

template <class Visit>
void KVStateSnapshot::for_each_piece(Visit&& visit) const {
  for (const Piece* piece = &head_; piece != nullptr; piece = piece->next) visit(*piece);
}

int64_t KVStateSnapshot::size() const {
  const auto count = [&] {
    int64_t bytes = 0;
    for_each_piece([&](const Piece& piece) { bytes += storage_bytes(piece); });
    return bytes;
  };
  return locked(count);  // pieces may be materializing on another thread
}

int64_t KVStateSnapshot::hook_and_size(std::function<void(int64_t)> hook) {
  return locked([&] {  // a write on another thread may be materializing it
    hook_ = std::move(hook);
    return size();
  });
}

void KVStateSnapshot::storage_changed(int64_t delta) {
  if (hook_ && delta != 0) hook_(delta);
}

void KVStateSnapshot::for_each_part(
    int64_t limit,
    const std::function<void(int64_t, const Array&, const Array&, int64_t)>& visit) const {
  int64_t first = 0;
  for_each_piece([&](const Piece& piece) {
    if (first >= limit) return;
    const int64_t count = std::min(piece.tokens, limit - first);
    const int64_t owned = std::min(piece.owned, count);
    if (owned > 0) {
      visit(first, piece.keys.slice(2, 0, owned), piece.values.slice(2, 0, owned), -1);
    }
    if (count > owned) {
      const int64_t column = piece.column + owned;
      visit(first + owned, owner()->keys.slice(2, column, piece.column + count),
            owner()->values.slice(2, column, piece.column + count), column);
    }
    first += piece.tokens;
  });
}

Array KVStateSnapshot::keys() const {
  if (tokens_ == 0) return layout.allocate_uninitialized(0).first;
  Array out;
  int parts = 0;
  for_each_part(tokens_, [&](int64_t, const Array& k, const Array&, int64_t) {
    if (++parts == 1) out = k;
  });
  if (parts == 1) return out;
  out = layout.allocate_uninitialized(tokens_).first;
  for_each_part(tokens_, [&](int64_t first, const Array& k, const Array&, int64_t) {
    out.assign_slice(2, first, k);
  });
  return out;
}

Array KVStateSnapshot::values() const {
  if (tokens_ == 0) return layout.allocate_uninitialized(0).second;
  Array out;
  int parts = 0;
  for_each_part(tokens_, [&](int64_t, const Array&, const Array& v, int64_t) {
    if (++parts == 1) out = v;
  });
  if (parts == 1) return out;
  out = layout.allocate_uninitialized(tokens_).second;
  for_each_part(tokens_, [&](int64_t first, const Array&, const Array& v, int64_t) {
    out.assign_slice(2, first, v);
  });
  return out;
}

SnapshotRecord KVStateSnapshot::record() const {
  return locked([&] {  // read consistently with the store's writers
    SnapshotRecord out{kind(), keys(), values(), begin, end, window};
    out.live = viewed_live();
    return out;
  });
}

void KVStateSnapshot::copy_record(bool second, Array& place, int64_t column) const {
  // A write that overwrites the columns copies them out first, under this lock: what is read
  // here is the snapshot's, wherever it lies now. Only the parts overlapping the range are read.
  const int64_t end = column + place.shape()[2];
  locked([&] {
    for_each_part(end, [&](int64_t first, const Array& k, const Array& v, int64_t) {
      const Array& part = second ? v : k;
      const int64_t from = std::max(first, column), to = first + part.shape()[2];
      if (to > from) place.assign_slice(2, from - column, part.slice(2, from - first, to - first));
    });
  });
}

bool KVStateSnapshot::viewed_live() const {
  if (owner() == nullptr) return false;
  int parts = 0;
  bool lazy = false;
  for_each_part(tokens_, [&](int64_t, const Array&, const Array&, int64_t column) {
    ++parts;
    lazy = column >= 0;
  });
  return parts == 1 && lazy;
}

void KVStateSnapshot::move_piece(Piece& source, Piece& target, KVStore* store) {
  if (source.indexed) store->unlink(source);
  target.tokens = source.tokens;
  target.column = source.column;
  target.owned = source.owned;
  target.keys = std::move(source.keys);
  target.values = std::move(source.values);
  target.snapshot = this;
  source.tokens = source.owned = 0;
  if (target.lazy()) store->link(target);
}

int64_t KVStateSnapshot::unbacked_tokens() const {
  int64_t tokens = 0;
  for_each_piece([&](const Piece& piece) {
    if (piece.lazy() && piece.keys.empty()) tokens += piece.lazy_end() - piece.lazy_begin();
  });
  return tokens;
}

bool KVStateSnapshot::has_lazy_piece() const {
  bool lazy = false;
  for_each_piece([&](const Piece& piece) { lazy = lazy || piece.lazy(); });
  return lazy;
}

void KVStateSnapshot::append_run(int64_t column, int64_t tokens) {
  Piece* last = &head_;
  while (last->next != nullptr) last = last->next;
  auto run = std::make_unique<Piece>();
  run->tokens = tokens;
  run->column = column;
  owner()->link(*run);
  insert_after(*last, std::move(run));
  tokens_ += tokens;
}

void KVStateSnapshot::insert_after(Piece& piece, std::unique_ptr<Piece> next) {
  Piece* added = next.release();
  added->snapshot = this;
  added->next = piece.next;
  piece.next = added;
}

KVStateSnapshot::KVStateSnapshot(const KVStateSnapshot& like, int64_t from, int64_t to)
    : StateSnapshot(like.kind()),
      layout(like.layout),
      begin(from),
      end(to),
      window(like.window),
      owner_(like.owner()),
      lock_(like.lock_),
      tokens_(0) {
  head_.snapshot = this;
}

std::unique_ptr<KVStateSnapshot> KVStateSnapshot::split_off(int64_t at, CopyStats& stats) {
  const int64_t cut = at - begin;
  // Allocated first: running out of memory leaves this snapshot whole.
  std::unique_ptr<KVStateSnapshot> after(new KVStateSnapshot(*this, at, end));
  // Make a piece end exactly at `cut`; the pieces after it move.
  Piece* last = &head_;
  int64_t first = 0;
  while (first + last->tokens < cut) {
    first += last->tokens;
    last = last->next;
  }
  if (first + last->tokens > cut) {
    insert_after(*last, cut_piece(*last, cut - first, owner(), stats));
  }
  Piece* moved = last->next;
  last->next = nullptr;
  after->move_piece(*moved, after->head_, owner());
  after->head_.next = moved->next;
  delete moved;
  for (Piece* piece = after->head_.next; piece != nullptr; piece = piece->next) {
    piece->snapshot = after.get();
  }
  after->tokens_ = tokens_ - cut;
  tokens_ = cut;
  end = at;
  if (!after->has_lazy_piece()) after->set_owner(nullptr);
  if (!has_lazy_piece()) set_owner(nullptr);
  return after;
}

void KVStateSnapshot::append(KVStateSnapshot& next) {
  if (owner() != nullptr && next.owner() != nullptr && owner() != next.owner()) {
    next.owner()->materialize(next);  // lazy in two stores: one owner per snapshot
  }
  KVStore* store = owner() != nullptr ? owner() : next.owner();
  Piece* last = &head_;
  while (last->next != nullptr) last = last->next;
  Piece& join = next.head_;
  const bool adjacent_lazy_runs = last->tokens > 0 && join.tokens > 0 && last->owned == 0 &&
                                  join.owned == 0 && last->keys.empty() && join.keys.empty() &&
                                  last->column + last->tokens == join.column;
  if (adjacent_lazy_runs) {  // one piece
    store->unlink(*last);
    store->unlink(join);
    last->tokens += join.tokens;
    join.tokens = 0;
    store->link(*last);
  } else if (join.tokens > 0) {
    auto* moved = new Piece();
    move_piece(join, *moved, store);
    last->next = moved;
    last = moved;
  }
  last->next = join.next;
  join.next = nullptr;
  for (Piece* piece = last->next; piece != nullptr; piece = piece->next) piece->snapshot = this;
  next.set_owner(nullptr);
  tokens_ += next.tokens_;
  next.tokens_ = 0;
  end = next.end;
  set_owner(has_lazy_piece() ? store : nullptr);
}

KVStateSnapshot& as_kv_state(Snapshot* snapshot, SnapshotRecord::Kind kind, const char* call) {
  auto* state = dynamic_cast<KVStateSnapshot*>(snapshot);
  if (state == nullptr || state->kind() != kind) {
    throw Error(
        fmt::format("{}: the snapshot is not a {} snapshot (snapshots restore only into a cache "
                    "of their own kind)",
                    call, cache_name(kind)));
  }
  return *state;
}

// ---- KVStore --------------------------------------------------------------------------------

void KVStore::clear() noexcept {
  let_go();
  keys = Array();
  values = Array();
  has_layout = false;
}

void KVStore::resize(int64_t columns, int64_t keep) {
  if (lazy_end() > keep) preserve(keep, lazy_end());
  auto [new_keys, new_values] = layout.allocate_uninitialized(columns);
  if (keep > 0) {
    new_keys.assign_slice(2, 0, keys.slice(2, 0, keep));
    new_values.assign_slice(2, 0, values.slice(2, 0, keep));
    stats.growth_bytes += keep * token_bytes();
  }
  keys = std::move(new_keys);
  values = std::move(new_values);
}

void KVStore::replace(Array new_keys, Array new_values) {
  materialize_all();
  keys = std::move(new_keys);
  values = std::move(new_values);
}

void KVStore::write(int64_t column, const Array& new_keys, const Array& new_values) {
  preserve(column, column + new_keys.dim(2));
  // Into a history past the last-level cache, the new columns bypass it (array/streaming.h).
  const int64_t span = strided_copy_stream_span();
  const StreamingWrites streaming(span > 0 && column * token_bytes() >= span);
  keys.assign_slice(2, column, new_keys);
  values.assign_slice(2, column, new_values);
}

void KVStore::preserve(int64_t from, int64_t to) {
  if (index.end() <= from) return;  // nothing lazy reaches the write: the common case
  index.overlapping(from, to, overlapping_);
  for (Piece* piece : overlapping_) {
    Piece* target = piece;
    const int64_t start = std::max(from, piece->lazy_begin());
    if (start > piece->lazy_begin()) {
      // The write begins inside the piece's lazy columns: the part before it stays lazy.
      std::unique_ptr<Piece> second = cut_piece(*piece, start - piece->column, this, stats);
      target = second.get();
      piece->snapshot->insert_after(*piece, std::move(second));
    }
    copy_out(*target, std::min(to, target->lazy_end()));
  }
}

int64_t KVStore::lazy_bytes(int64_t from, int64_t to) const {
  if (index.end() <= from || to <= from) return 0;
  std::vector<Piece*> pieces;
  index.overlapping(from, to, pieces);
  int64_t columns = 0;
  for (const Piece* piece : pieces) {
    columns += std::min(to, piece->lazy_end()) - std::max(from, piece->lazy_begin());
  }
  return columns * token_bytes();
}

void KVStore::copy_out(Piece& piece, int64_t to) {
  const int64_t from = piece.lazy_begin();
  if (to <= from) return;
  if (piece.keys.empty()) {
    allocate_storage(piece, layout, piece.tokens);
    piece.snapshot->storage_changed(storage_bytes(piece));
  }
  piece.keys.assign_slice(2, from - piece.column, keys.slice(2, from, to));
  piece.values.assign_slice(2, from - piece.column, values.slice(2, from, to));
  stats.materialized_bytes += (to - from) * token_bytes();
  index.erase(&piece);
  piece.owned = to - piece.column;
  if (piece.lazy()) {
    index.insert(&piece);
    return;
  }
  if (!piece.snapshot->has_lazy_piece()) piece.snapshot->became_owned();
}

void KVStore::materialize(KVStateSnapshot& snapshot) {
  if (snapshot.owner() != this) return;
  snapshot.for_each_piece([&](Piece& piece) { copy_out(piece, piece.lazy_end()); });
}

void KVStore::materialize_all() {
  index.all(overlapping_);
  for (Piece* piece : overlapping_) copy_out(*piece, piece->lazy_end());
}

void KVStore::let_go() noexcept {
  while (Piece* piece = index.any()) {
    if (piece->keys.empty()) {  // no storage yet: the one allocation this needs
      bool allocated = true;
      try {
        allocate_storage(*piece, layout, piece->tokens);
      } catch (const std::bad_alloc&) {
        allocated = false;
      }
      if (allocated) {
        piece->snapshot->storage_changed(storage_bytes(*piece));
      } else {
        // Out of memory: the piece keeps the buffers alive and reads its columns there.
        piece->keys = keys.slice(2, piece->column, piece->lazy_end());
        piece->values = values.slice(2, piece->column, piece->lazy_end());
        piece->snapshot->storage_changed(storage_bytes(*piece));
        index.erase(piece);
        piece->owned = piece->tokens;
        if (!piece->snapshot->has_lazy_piece()) piece->snapshot->became_owned();
        continue;
      }
    }
    copy_out(*piece, piece->lazy_end());  // into storage it has: allocates nothing
  }
}

std::unique_ptr<KVStateSnapshot> KVStore::capture(SnapshotRecord::Kind kind, int64_t column,
                                                  int64_t tokens, int64_t from, int64_t to,
                                                  int64_t window) {
  return std::make_unique<KVStateSnapshot>(kind, *this, column, tokens, from, to, window);
}

}  // namespace kvsnap::detail
