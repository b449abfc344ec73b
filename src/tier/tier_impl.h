// Internal: the Tier's implementation — key names (keys.h), objects (object.h), a connection for
// lookups and the write-behind (writer.h) with its own, the counters, and what this process
// knows: keys it wrote or read (not written again) and each layer's snapshot shapes.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "kvsnap/tier.h"
#include "tier/keys.h"
#include "tier/object.h"
#include "tier/store.h"
#include "tier/writer.h"

namespace kvsnap::detail {

// A mutex whose lock waits until a deadline at most (std::unique_lock(mutex, deadline)). Not
// std::timed_mutex: its try_lock_until on the steady clock is pthread_mutex_clocklock, which
// this toolchain's ThreadSanitizer does not intercept — it then takes every unlock for one of an
// unlocked mutex, and sees none of the order the lock gives.
class DeadlineMutex {
 public:
  bool try_lock_until(Deadline deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!free_.wait_until(lock, deadline, [&] { return !held_; })) return false;
    held_ = true;
    return true;
  }
  void unlock() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      held_ = false;
    }
    free_.notify_one();
  }

 private:
  std::mutex mutex_;
  std::condition_variable free_;
  bool held_ = false;
};

// Keys this process wrote or read, so it does not write them again. Bounded; cleared whenever
// the store turns out to have lost one (flushed, evicted, restarted).
class KnownKeys {
 public:
  bool contains(const std::string& key) const;
  void add(const std::vector<std::string>& keys);
  void erase(const std::string& key);
  void clear();

 private:
  static constexpr size_t kMaximum = size_t(1) << 16;
  mutable std::mutex mutex_;
  std::unordered_set<std::string> keys_;
};

class TierImpl {
 public:
  TierImpl(const std::string& address, std::vector<Cache*> layers, TierOptions options);

  TierMatch lookup(std::span<const int32_t> tokens, int64_t limit, int64_t better_than,
                   int64_t max_bytes);
  void store(std::span<const int32_t> tokens, std::span<const Snapshot* const> ranges,
             std::span<const TierPoint> points);
  bool offer(std::span<const int32_t> tokens, std::span<const Snapshot* const> ranges,
             std::span<const TierPoint> points) noexcept;
  bool offer(std::span<const int32_t> tokens,
             const std::function<std::vector<SnapshotPtr>()>& take_ranges,
             std::span<const TierPoint> points) noexcept;
  bool flush(std::chrono::milliseconds timeout) { return writer_->flush(timeout); }
  TierStats stats() const { return counters_.stats(); }
  const std::vector<Cache*>& layers() const { return layers_; }
  const std::string& address() const { return address_; }
  bool authenticated() const { return !mac_key_.empty(); }

 private:
  class Finder;  // one lookup (lookup.cc)
  bool ranged(size_t layer) const;
  // The objects of a store call, encoded (the copy of the data); nullopt, having copied no
  // more, once they would not fit the write queue.
  std::optional<WriteBatch> encode(std::span<const int32_t> tokens,
                                   const std::vector<std::optional<ObjectPart>>& kv,
                                   std::span<const TierPoint> points, int64_t end);
  // Whether an object of `size` bytes is more than the store takes (max_object_bytes): counted,
  // and said once a tier.
  bool too_large(int64_t size);
  // Counts and logs a rejected object and forgets it as known. `doom` (a damaged or forged
  // object, of no use to any process): the writer deletes it, unless this process has written
  // the key since, so the next process that stores it writes it whole again. An object that is
  // whole but not in this process's shapes is left to the processes it fits.
  void reject(const std::string& key, size_t bytes, const std::string& why, bool unauthenticated,
              bool doom);
  // An index a probe found unusable (UnusableIndex: planted): rejected and doomed like a
  // forged object, and what this process knows the store holds forgotten — the set listed its
  // points too — so the next sessions write them and their index entries again.
  void drop_index(const UnusableIndex& failure);
  // The shapes layer i's snapshots have in this process ("" until it stores one).
  std::vector<std::string> known_signatures() const;
  void learn_signature(size_t layer, const SnapshotRecord& record);

  std::string address_;  // redacted
  std::vector<Cache*> layers_;
  TierOptions options_;
  std::string mac_key_;
  TierKeys keys_;
  TierCounters counters_;
  KnownKeys known_;
  std::atomic<int64_t> logged_rejections_{0};
  std::atomic<bool> said_too_large_{false};         // objects over max_object_bytes: said once
  std::atomic<bool> said_lookup_too_large_{false};  // lookups over max_lookup_bytes: said once
  std::atomic<bool> logged_loss_{false};
  // Runs `store` (an offer's work): true when it returns; what it throws is counted in
  // store_errors and said once, and false returned.
  template <class Store>
  bool guarded(Store&& store) noexcept;
  std::atomic<bool> said_offer_refused_{false};  // an offer whose store threw: said once
  mutable std::mutex signatures_mutex_;
  std::vector<std::string> signatures_;
  DeadlineMutex lookup_mutex_;  // one lookup at a time on the connection
  std::unique_ptr<Store> lookup_store_;
  std::unique_ptr<WriteBehind> writer_;  // last: its thread stops before the rest goes
};

}  // namespace kvsnap::detail
