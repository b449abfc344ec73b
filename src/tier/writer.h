// Internal: the tier's write-behind — batches encoded at session close wait in a bounded queue
// and a background thread sends them (tagging each object with its MAC first), so a slow or dead
// store never holds up a request: when the queue is full, the new batch is dropped (counted).
// A batch goes out in slices of about kSliceBytes, and before each slice the writer lets the
// lookups in flight finish: a request's lookup waits behind at most one slice, not behind the
// megabytes the request before it stored (the store answers each connection in turn).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tier/store.h"

namespace kvsnap::detail {

// Lookups in flight, so the writer can step aside for them between slices.
class LookupGate {
 public:
  // Marks one lookup in flight for its lifetime.
  class Entry {
   public:
    explicit Entry(LookupGate& gate);
    ~Entry();
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;

   private:
    LookupGate& gate_;
  };
  // Waits until as many lookups have finished as had started now — the ones in flight now, or
  // as many later ones (counted, not tracked: later ones cannot hold the writer for long, so a
  // stream of lookups cannot starve it) — or until `until`.
  void wait_for_lookups(Deadline until);

 private:
  std::mutex mutex_;
  std::condition_variable finished_one_;
  uint64_t started_ = 0, finished_ = 0;
};

class WriteBehind {
 public:
  static constexpr int64_t kSliceBytes = int64_t(256) << 10;

  struct Options {
    size_t capacity = 64;
    int64_t capacity_bytes = int64_t(1) << 30;  // of objects queued and in flight
    std::chrono::milliseconds write_timeout{2000};
    // The most the writer steps aside for lookups before each slice (their own time limit).
    std::chrono::milliseconds lookup_timeout{50};
    std::string mac_key;  // empty: objects go untagged
    // Runs on the writer thread with the keys of every object the store accepted.
    std::function<void(const std::vector<std::string>&)> written;
    // Runs on the writer thread when the store lacks an object or index entry a batch skipped
    // as known (WriteBatch::known).
    std::function<void()> lost;
    // Whether this process knows it wrote `key` (then a doomed key is not deleted: the write
    // came after the rejection that doomed it).
    std::function<bool(const std::string&)> known;
    // Runs on the writer thread when its check of what a batch skipped as known meets an index
    // the tier cannot use (UnusableIndex: planted): that check is given up.
    std::function<void(const UnusableIndex&)> unusable_index;
  };
  WriteBehind(std::unique_ptr<Store> store, Options options, TierCounters& counters);
  // Waits up to write_timeout for the queue to drain, drops what is left (counted), and stops
  // once the batch in flight is done (bounded by write_timeout too).
  ~WriteBehind();
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;

  // Queues `batch`; false (and the batch dropped, counted) when the queue is full: capacity
  // batches, or its objects would pass capacity_bytes (unless nothing else is queued or being
  // written: one batch of any size goes).
  bool push(WriteBatch batch);
  // Deletes `key` from the store (an object every reader rejects) with the next batch written,
  // or on its own when none waits. Doomed keys wait apart from the queue, at most
  // kMaxDoomedKeys of them (more are forgotten: the next reader rejects and dooms them again),
  // so a lookup that rejects many objects never fills the queue the sessions' writes need.
  static constexpr size_t kMaxDoomedKeys = 1024;
  void doom(std::string key);
  // Whether a batch of `bytes` of objects would be queued now (a caller asks before copying
  // them; push decides).
  bool has_room(int64_t bytes);
  // Waits until the queue and the doomed keys are empty and no batch is being written, or
  // `timeout` passes.
  bool flush(std::chrono::milliseconds timeout);
  // Lookups mark themselves here (LookupGate::Entry) so writes step aside for them.
  LookupGate& lookups() { return lookups_; }

 private:
  void run();
  // Whether a batch of `bytes` is queued now (under mutex_).
  bool fits(int64_t bytes) const;
  void send(WriteBatch& batch);
  // Whether the store still holds what `batch` skipped as known (one round trip; true when
  // it could not be asked).
  bool still_holds(const WriteBatch& batch, Deadline deadline);
  // Writes `slice`: how many objects the store refused, or nullopt when it failed (the rest of
  // the batch is dropped).
  std::optional<int64_t> send_slice(const WriteBatch& slice, Deadline deadline);

  std::unique_ptr<Store> store_;
  Options options_;
  TierCounters& counters_;
  LookupGate lookups_;
  std::mutex mutex_;
  std::condition_variable wake_;  // a batch was queued, a key doomed, or stopping
  std::condition_variable idle_;  // the queue and doomed keys emptied, nothing in flight
  std::deque<WriteBatch> queue_;
  std::vector<std::string> doomed_;  // keys to delete with the next batch (doom)
  int64_t queued_bytes_ = 0;         // objects' bytes in queue_ and in flight
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace kvsnap::detail
