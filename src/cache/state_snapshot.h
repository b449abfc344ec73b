// Internal: what every built-in snapshot is — a StateSnapshot that describes itself as a
// SnapshotRecord — and the pool their objects come from, so a capture allocates nothing once
// the pool is warm.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <new>
#include <optional>
#include <vector>

#include "cache/snapshot_record.h"
#include "kvsnap/cache.h"

namespace kvsnap::detail {

// The base of KVCache, RotatingKVCache and RecurrentCache snapshots: one dynamic_cast tells a
// built-in snapshot from a foreign one, then `record()` says what it holds.
class StateSnapshot : public Snapshot {
 public:
  explicit StateSnapshot(SnapshotRecord::Kind kind) : kind_(kind) {}
  SnapshotRecord::Kind kind() const { return kind_; }
  // Its data (views of the live cache while lazy, or a copy when it is held in parts) and
  // offsets.
  virtual SnapshotRecord record() const = 0;
  // Copies record()'s first array (or its second) into `place`, consistently with the writers
  // of the cache it is lazy in (under that cache's lock): for a record whose arrays are `live`,
  // read after record() returned. `place` has the array's dtype and shape, except that along
  // the token axis (2) of a KV or window record it may hold only the tokens from `column` on
  // (the record's token `column` onwards, place's extent of them); `column` is 0 otherwise.
  virtual void copy_record(bool second, Array& place, int64_t column = 0) const {
    const SnapshotRecord data = record();
    const Array& array = second ? data.second : data.first;
    place.assign(data.kind == SnapshotRecord::Kind::recurrent
                     ? array
                     : array.slice(2, column, column + place.shape()[2]));
  }
  // For a snapshot whose record() gathers its data into new arrays (a paged one: blocks): a
  // record with the same kind, offsets, dtypes and shapes whose arrays hold no data (each is
  // one element behind every index) and `live` set, so a writer copies what it needs through
  // copy_record instead of gathering everything first. nullopt for the other kinds (whose
  // record() is a view, or a copy writers take as it is).
  virtual std::optional<SnapshotRecord> record_outline() const { return std::nullopt; }
  // Sets the materialize hook and returns size() at the same instant (under the lock of the
  // cache it is lazy in), so a holder that counts its bytes misses no change another thread
  // makes in between.
  virtual int64_t hook_and_size(std::function<void(int64_t)> hook) {
    set_materialize_hook(std::move(hook));
    return size();
  }

 private:
  SnapshotRecord::Kind kind_;
};

// Sets `snapshot`'s materialize hook and returns its size at that instant (atomically for the
// built-in kinds; foreign ones are set, then measured).
inline int64_t hook_and_size(Snapshot& snapshot, std::function<void(int64_t)> hook) {
  if (auto* state = dynamic_cast<StateSnapshot*>(&snapshot)) {
    return state->hook_and_size(std::move(hook));
  }
  snapshot.set_materialize_hook(std::move(hook));
  return snapshot.size();
}

// The built-in snapshot `snapshot` is, or null for a foreign kind.
inline const StateSnapshot* as_state_snapshot(const Snapshot* snapshot) {
  return dynamic_cast<const StateSnapshot*>(snapshot);
}
inline StateSnapshot* as_state_snapshot(Snapshot* snapshot) {
  return dynamic_cast<StateSnapshot*>(snapshot);
}

// Whether Pooled objects are kept for reuse: true but in tests that fail allocations one at a
// time (oom_test), where every object then comes from operator new, so that each can fail.
inline std::atomic<bool> reuse_pooled_objects{true};

// Class-level operator new/delete for a final class T, from a per-thread free list of bounded
// length: captures in a decode loop reuse the objects of the snapshots released before them.
template <class T>
class Pooled {
 public:
  static void* operator new(std::size_t size) {
    List& pool = list();
    if (size == sizeof(T) && !pool.items.empty() &&
        reuse_pooled_objects.load(std::memory_order_relaxed)) {
      void* object = pool.items.back();
      pool.items.pop_back();
      return object;
    }
    return ::operator new(size);
  }
  static void operator delete(void* object, std::size_t size) noexcept {
    if (size == sizeof(T) && !dead() && reuse_pooled_objects.load(std::memory_order_relaxed)) {
      List& pool = list();
      if (pool.items.size() < pool.items.capacity()) {
        pool.items.push_back(object);  // within the capacity reserved up front: never allocates
        return;
      }
    }
    ::operator delete(object);
  }

 private:
  static constexpr std::size_t kKeep = 1024;
  struct List {
    // A thread's list may first be made by a delete, which must not throw: without memory for
    // it the list keeps no objects (every delete goes to the heap).
    List() noexcept {
      try {
        items.reserve(kKeep);
      } catch (const std::bad_alloc&) {
      }
    }
    ~List() {
      for (void* object : items) ::operator delete(object);
      dead() = true;
    }
    std::vector<void*> items;
  };
  static List& list() {
    thread_local List pool;
    return pool;
  }
  // Set once this thread's list is gone (objects freed during thread exit go to the heap).
  static bool& dead() {
    thread_local bool gone = false;
    return gone;
  }
};

}  // namespace kvsnap::detail
