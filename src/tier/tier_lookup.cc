// TierImpl::lookup: one round trip for the index sets of the prompt's chunks and its chunks'
// sizes; then, deepest restore point first, one round trip for the chunks the point needs
// and its object, each checked (object.h) before anything is returned. A missing or rejected
// chunk rules out every point past it; a missing or rejected point falls back to the next one.
// All a lookup holds of what the store sent stays within its bytes (max_lookup_bytes, or the
// caller's): chunks that would pass them rule out every point past them, and a point whose object
// would is passed over — known from the sizes the probe and the index members say before anything
// is fetched, and checked again as the bytes arrive (a member without a size, or one that says
// less than the store sends).
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <new>

#include "tier/object.h"
#include "tier/tier_impl.h"

namespace kvsnap::detail {

using Clock = std::chrono::steady_clock;

class TierImpl::Finder {
 public:
  Finder(TierImpl& tier, std::span<const int32_t> tokens, int64_t limit, int64_t better_than,
         int64_t max_bytes, Deadline deadline)
      : tier_(tier),
        tokens_(tokens),
        limit_(limit),
        better_than_(better_than),
        max_bytes_(max_bytes),
        deadline_(deadline),
        chunk_(tier.keys_.chunk_tokens()),
        first_(better_than / chunk_),
        chain_(tier.keys_.chain(tokens, limit / chunk_)),
        signatures_(tier.known_signatures()) {
    any_kv_ = false;
    for (size_t i = 0; i < tier.layers_.size(); ++i) any_kv_ = any_kv_ || tier.ranged(i);
  }

  TierMatch run() {
    for (int64_t point : candidates()) {
      if (Clock::now() >= deadline_) {
        throw StoreFailure("no time left for the next point", StoreFailure::Reason::timed_out);
      }
      if (fetch(point)) return assemble(point);
    }
    return {};
  }

 private:
  int64_t last() const { return static_cast<int64_t>(chain_.size()) - 1; }

  // Restore points in (better_than, limit] whose chunks all exist and fit the bytes together,
  // deepest first.
  std::vector<int64_t> candidates() {
    std::vector<std::string> sets, chunk_keys;
    for (int64_t j = first_; j <= last(); ++j) sets.push_back(TierKeys::index_key(digest(j)));
    // Every chunk of the prompt, also those the caller holds: one this process knows it wrote
    // but the store lacks means the store lost data (flushed, evicted) — write again.
    for (int64_t j = 0; any_kv_ && j < last(); ++j) {
      chunk_keys.push_back(TierKeys::chunk_key(digest(j + 1)));
    }
    std::vector<std::vector<std::string>> members;
    std::vector<int64_t> sizes;
    tier_.lookup_store_->probe(sets, chunk_keys, deadline_, members, sizes);
    for (size_t k = 0; k < chunk_keys.size(); ++k) {
      if (sizes[k] < 0 && tier_.known_.contains(chunk_keys[k])) tier_.known_.clear();
    }
    usable_end_ = any_kv_ ? first_ : last();
    while (any_kv_ && usable_end_ < last() && sizes[static_cast<size_t>(usable_end_)] >= 0) {
      ++usable_end_;
    }
    // Points past the chunks that fit the bytes are never fetched (said as a fetch that would
    // not fit is): their chunks alone would pass them. before[j - first_]: the bytes of chunks
    // [first_, j), as the store says (never summed past the bound).
    const int64_t existing_end = usable_end_;
    std::vector<int64_t> before{0};
    for (int64_t j = first_; any_kv_ && j < existing_end; ++j) {
      const int64_t size = sizes[static_cast<size_t>(j)];
      if (size > max_bytes_ - before.back()) break;
      before.push_back(before.back() + size);
    }
    if (any_kv_) usable_end_ = first_ + static_cast<int64_t>(before.size()) - 1;
    // Each offset once, with the least size its members say (a planted member saying more
    // cannot hide the point, one saying less is caught as the bytes arrive); a member without a
    // size (written by an earlier version) counts only when none says one, so a store of such
    // members heals as this version writes the points again.
    std::map<int64_t, int64_t, std::greater<>> points;
    for (size_t k = 0; k < members.size(); ++k) {
      const int64_t j = first_ + static_cast<int64_t>(k);
      for (const std::string& listed : members[k]) {
        const std::optional<TierKeys::Member> member = TierKeys::parse_index_member(listed);
        if (!member) continue;  // not ours
        const int64_t t = member->offset;
        if (t / chunk_ != j || t <= better_than_ || t > limit_ || (any_kv_ && j > existing_end)) {
          continue;
        }
        int64_t& bytes = points.try_emplace(t, member->bytes).first->second;
        if (bytes < 0 || (member->bytes >= 0 && member->bytes < bytes)) bytes = member->bytes;
      }
    }
    std::vector<int64_t> fitting;
    for (const auto& [t, bytes] : points) {
      const int64_t j = t / chunk_;
      const int64_t chunks =
          any_kv_ && j <= usable_end_ ? before[static_cast<size_t>(j - first_)] : 0;
      if ((any_kv_ && j > usable_end_) || bytes > max_bytes_ - chunks) {
        over_budget();
      } else {
        fitting.push_back(t);
      }
    }
    return fitting;
  }

  // Fetches and checks point `t` and the chunks before it not fetched yet; true when all hold.
  bool fetch(int64_t t) {
    const int64_t base = t / chunk_;
    if (any_kv_ && base > usable_end_) return false;
    // Chunks a deeper point fetched that this one does not need (its object was missing or
    // rejected) go: they would take this point's bytes.
    for (auto it = chunks_.lower_bound(base); it != chunks_.end(); it = chunks_.erase(it)) {
      held_ -= it->second.bytes;
    }
    // The chunks first, then the point: chunks that do not fit rule out every point past them.
    std::vector<std::string> keys;
    std::vector<int64_t> wanted;
    for (int64_t j = first_; any_kv_ && j < base; ++j) {
      if (chunks_.count(j) > 0) continue;
      wanted.push_back(j);
      keys.push_back(TierKeys::chunk_key(digest(j + 1)));
    }
    keys.push_back(TierKeys::point_key(digest(base), t, tokens(base * chunk_, t)));
    std::vector<std::optional<std::string>> values;
    try {
      values = tier_.lookup_store_->fetch(keys, deadline_, max_bytes_ - held_);
    } catch (const FetchTooLarge& too_large) {
      over_budget();
      if (too_large.index < wanted.size()) {
        usable_end_ = std::min(usable_end_, wanted[too_large.index]);
      }
      return false;  // a shallower point may fit (its point object smaller, or fewer chunks)
    }
    for (const std::optional<std::string>& value : values) {
      tier_.counters_.bytes_read += value ? static_cast<int64_t>(value->size()) : 0;
    }
    for (size_t k = 0; k < wanted.size(); ++k) {
      const int64_t j = wanted[k];
      const ObjectSpec spec{ObjectSpec::Kind::chunk, j * chunk_, (j + 1) * chunk_};
      const int64_t bytes = values[k] ? static_cast<int64_t>(values[k]->size()) : 0;
      std::vector<SnapshotPtr> chunk = check(keys[k], std::move(values[k]), spec);
      if (chunk.empty()) {
        usable_end_ = std::min(usable_end_, j);
        break;
      }
      chunks_[j] = {std::move(chunk), bytes};
      held_ += bytes;
    }
    if (any_kv_ && base > usable_end_) return false;
    const ObjectSpec point_spec{ObjectSpec::Kind::point, base * chunk_, t};
    point_ = check(keys.back(), std::move(values.back()), point_spec);
    return !point_.empty();
  }

  // Counted once a lookup, said once a tier.
  void over_budget() {
    if (!counted_over_budget_) ++tier_.counters_.store_errors;
    counted_over_budget_ = true;
    if (tier_.said_lookup_too_large_.exchange(true)) return;
    tier_.options_.log(fmt::format(
        "a restore point needs more than the {} bytes a lookup may hold (max_lookup_bytes {}, or "
        "the caller's budget): shallower ones are used; raise it for long prompts on wide models",
        max_bytes_, tier_.options_.max_lookup_bytes));
  }

  // The object's snapshots, or an empty vector when it is missing or rejected.
  std::vector<SnapshotPtr> check(const std::string& key, std::optional<std::string> value,
                                 const ObjectSpec& spec) {
    if (!value) {
      if (tier_.known_.contains(key)) tier_.known_.clear();  // the store lost it
      return {};
    }
    const size_t bytes = value->size();
    std::vector<SnapshotPtr> snapshots;
    try {
      snapshots = decode_object(std::move(*value), key, tier_.keys_.root_hex(), spec, tier_.layers_,
                                tier_.mac_key_);
    } catch (const ObjectRejected& rejected) {  // damaged or forged: of no use to anyone
      tier_.reject(key, bytes, rejected.what(), rejected.unauthenticated, /*doom=*/true);
      return {};
    }
    try {
      fits(snapshots);
    } catch (const ObjectRejected& rejected) {  // whole, but not in this process's shapes
      tier_.reject(key, bytes, rejected.what(), rejected.unauthenticated, /*doom=*/false);
      return {};
    }
    used_.push_back(key);
    return snapshots;
  }

  // Throws ObjectRejected unless each snapshot has the shapes of its layer's other snapshots
  // (those this process stored, or else the first one of this lookup).
  // A rejected object teaches nothing: the shapes it would have set are kept only when all of
  // it fits.
  void fits(const std::vector<SnapshotPtr>& snapshots) {
    std::vector<std::string> signatures = signatures_;
    for (size_t i = 0; i < snapshots.size(); ++i) {
      if (snapshots[i] == nullptr) continue;
      const std::string shapes =
          snapshot_signature(*snapshot_record(*snapshots[i]), tier_.layers_[i]);
      if (signatures[i].empty()) signatures[i] = shapes;
      if (shapes != signatures[i]) {
        throw ObjectRejected(fmt::format("layer {} holds {}, this layer's snapshots have {}", i,
                                         shapes, signatures[i]),
                             false);
      }
    }
    signatures_ = std::move(signatures);
  }

  TierMatch assemble(int64_t t) {
    TierMatch match;
    match.offset = t;
    const int64_t base = t / chunk_;
    for (int64_t j = first_; any_kv_ && j < base; ++j) {
      match.segments.push_back({j * chunk_, (j + 1) * chunk_, std::move(chunks_[j].snapshots)});
    }
    match.segments.push_back({any_kv_ ? base * chunk_ : first_ * chunk_, t, std::move(point_)});
    tier_.known_.add(used_);
    return match;
  }

  const Digest& digest(int64_t j) const { return chain_[static_cast<size_t>(j)]; }
  std::span<const int32_t> tokens(int64_t from, int64_t to) const {
    return tokens_.subspan(static_cast<size_t>(from), static_cast<size_t>(to - from));
  }

  TierImpl& tier_;
  std::span<const int32_t> tokens_;
  const int64_t limit_, better_than_, max_bytes_;
  const Deadline deadline_;
  const int64_t chunk_;
  const int64_t first_;  // the first chunk to fetch: the caller holds the ones before
  bool any_kv_ = false;
  std::vector<Digest> chain_;
  std::vector<std::string> signatures_;
  // Chunks [first_, usable_end_) exist, fit the bytes together, and none was rejected.
  int64_t usable_end_ = 0;
  struct Chunk {
    std::vector<SnapshotPtr> snapshots;
    int64_t bytes = 0;  // as the store sent it
  };
  std::map<int64_t, Chunk> chunks_;  // fetched and checked, by index
  int64_t held_ = 0;                 // their bytes
  bool counted_over_budget_ = false;
  std::vector<SnapshotPtr> point_;
  std::vector<std::string> used_;
};

TierMatch TierImpl::lookup(std::span<const int32_t> tokens, int64_t limit, int64_t better_than,
                           int64_t max_bytes) {
  limit = std::min(limit, static_cast<int64_t>(tokens.size()));
  better_than = std::max<int64_t>(better_than, 0);
  max_bytes = std::min(max_bytes, options_.max_lookup_bytes);
  if (limit <= better_than || max_bytes <= 0) return {};  // nothing could be held
  const CallerTime timed(counters_.caller_microseconds);
  const LookupGate::Entry in_flight(writer_->lookups());  // writes step aside until it is done
  ++counters_.lookups;
  const Deadline deadline = Clock::now() + options_.lookup_timeout;
  std::unique_lock<DeadlineMutex> lock(lookup_mutex_, deadline);
  if (!lock.owns_lock()) {
    ++counters_.timeouts;  // other lookups held the connection until the deadline
    return {};
  }
  try {
    TierMatch match = Finder(*this, tokens, limit, better_than, max_bytes, deadline).run();
    if (match.offset > 0) {
      ++counters_.hits;
      counters_.restored_tokens += match.offset - better_than;
    }
    return match;
  } catch (const UnusableIndex& failure) {  // a miss; the set goes
    try {
      drop_index(failure);
    } catch (const std::bad_alloc&) {  // the next lookup that meets it drops it
      ++counters_.store_errors;
    }
    return {};
  } catch (const StoreFailure& failure) {
    if (failure.reason == StoreFailure::Reason::timed_out) ++counters_.timeouts;
    if (failure.reason == StoreFailure::Reason::failed) ++counters_.store_errors;
    return {};
  } catch (const std::bad_alloc&) {  // what the store sent did not fit in memory: a miss
    ++counters_.store_errors;
    return {};
  }
}

}  // namespace kvsnap::detail
