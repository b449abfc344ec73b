// Internal: the per-sequence states of a multi-sequence cache, by id, and the lock a cache and
// its snapshots share.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "kvsnap/cache.h"

namespace kvsnap::detail {

// Sequence ids index a vector: they are small (slots of a serving engine).
inline constexpr SeqId kMaxSequences = SeqId(1) << 20;

template <class Seq>
class Sequences {
 public:
  using Make = std::function<std::unique_ptr<Seq>()>;
  explicit Sequences(Make make) : make_(std::move(make)), empty_(make_()) {}

  // Throws Error naming `call` for an id outside [0, kMaxSequences).
  static void check_id(SeqId id, const char* call) {
    if (id < 0 || id >= kMaxSequences) {
      throw Error(fmt::format("{}: sequence id {} outside [0, {})", call, id, kMaxSequences));
    }
  }
  // The state of sequence `id`, created (empty) when it has none: only for a call that has
  // checked everything and now changes the sequence (see change()). Throws Error naming `call`
  // for an id outside [0, kMaxSequences).
  Seq& at(SeqId id, const char* call) {
    check_id(id, call);
    if (static_cast<size_t>(id) >= by_id_.size()) by_id_.resize(static_cast<size_t>(id) + 1);
    std::unique_ptr<Seq>& slot = by_id_[static_cast<size_t>(id)];
    if (slot == nullptr) slot = take_staged(id);
    if (slot == nullptr) slot = make_();
    return *slot;
  }
  // Makes sequence `id` ahead of the change that creates it, with every allocation that takes
  // (its state, its place by id): find, peek and for_each do not see it, and at() or change()
  // takes it instead of making one. Returns it (the one staged before, when called again).
  // Throws Error naming `call` for an id outside [0, kMaxSequences).
  Seq& stage(SeqId id, const char* call) {
    check_id(id, call);
    if (static_cast<size_t>(id) >= by_id_.size()) by_id_.resize(static_cast<size_t>(id) + 1);
    for (auto& [staged, sequence] : staged_) {
      if (staged == id) return *sequence;
    }
    staged_.emplace_back(id, make_());
    return *staged_.back().second;
  }
  // Drops every staged sequence no change took.
  void unstage() noexcept { staged_.clear(); }
  // The state of sequence `id` for checks: an absent sequence reads as an empty one, and none
  // is created (a call that fails or changes nothing leaves no new sequence). Throws Error
  // naming `call` for an id outside [0, kMaxSequences).
  const Seq& peek(SeqId id, const char* call) const {
    check_id(id, call);
    const Seq* sequence = find(id);
    return sequence != nullptr ? *sequence : *empty_;
  }
  // Runs `change(at(id, call))` and returns its result; when that throws, a sequence it created
  // is dropped again.
  template <class Change>
  decltype(auto) change(SeqId id, const char* call, Change&& change) {
    if (find(id) != nullptr) return change(*find(id));
    Seq& created = at(id, call);
    try {
      return change(created);
    } catch (...) {
      by_id_[static_cast<size_t>(id)].reset();
      throw;
    }
  }
  // The state of sequence `id`, or null when it has none; throws Error naming `call` for an id
  // outside [0, kMaxSequences) (a call on an absent sequence that gives what an empty one does).
  Seq* find(SeqId id, const char* call) const {
    check_id(id, call);
    return find(id);
  }
  // The state of sequence `id`, or null when it has none.
  Seq* find(SeqId id) const {
    if (id < 0 || static_cast<size_t>(id) >= by_id_.size()) return nullptr;
    return by_id_[static_cast<size_t>(id)].get();
  }
  template <class Visit>
  void for_each(Visit&& visit) const {
    for (size_t id = 0; id < by_id_.size(); ++id) {
      if (by_id_[id] != nullptr) visit(static_cast<SeqId>(id), *by_id_[id]);
    }
  }

 private:
  // The staged sequence `id`, taken out of staged_ (null when none); allocates nothing.
  std::unique_ptr<Seq> take_staged(SeqId id) noexcept {
    for (auto it = staged_.begin(); it != staged_.end(); ++it) {
      if (it->first != id) continue;
      std::unique_ptr<Seq> sequence = std::move(it->second);
      staged_.erase(it);
      return sequence;
    }
    return nullptr;
  }

  Make make_;
  std::unique_ptr<const Seq> empty_;  // what peek() gives for an absent sequence
  std::vector<std::unique_ptr<Seq>> by_id_;
  std::vector<std::pair<SeqId, std::unique_ptr<Seq>>> staged_;  // stage(): not yet taken
};

// Adds `more` to `total`, field by field.
inline void add(CopyStats& total, const CopyStats& more) {
  total.appended_bytes += more.appended_bytes;
  total.growth_bytes += more.growth_bytes;
  total.materialized_bytes += more.materialized_bytes;
  total.restored_bytes += more.restored_bytes;
  total.snapshot_bytes += more.snapshot_bytes;
}

// The lock of one cache: every call of the cache holds it, and so does whoever destroys or reads
// a snapshot lazy in it. Recursive: a call may destroy snapshots of its own cache.
using CacheLock = std::recursive_mutex;
using Guard = std::lock_guard<CacheLock>;

}  // namespace kvsnap::detail
