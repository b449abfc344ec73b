// Internal: the tier's write-behind — batches encoded at session close wait in a bounded queue
// and a background thread sends them (tagging each object with its MAC first), so a slow or dead
// store never holds up a request: when the queue is full, the new batch is dropped (counted).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tier/store.h"

namespace kvsnap::detail {

class WriteBehind {
 public:
  struct Options {
    size_t capacity = 64;
    std::chrono::milliseconds write_timeout{2000};
    std::string mac_key;  // empty: objects go untagged
    // Runs on the writer thread with the keys of every object the store accepted.
    std::function<void(const std::vector<std::string>&)> written;
  };
  WriteBehind(std::unique_ptr<Store> store, Options options, TierCounters& counters);
  // Waits up to write_timeout for the queue to drain, drops what is left (counted), and stops
  // once the batch in flight is done (bounded by write_timeout too).
  ~WriteBehind();
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;

  // Queues `batch`; false (and the batch dropped, counted) when the queue is full.
  bool push(WriteBatch batch);
  // Waits until the queue is empty and no batch is being written, or `timeout` passes.
  bool flush(std::chrono::milliseconds timeout);

 private:
  void run();
  void send(WriteBatch& batch);

  std::unique_ptr<Store> store_;
  Options options_;
  TierCounters& counters_;
  std::mutex mutex_;
  std::condition_variable wake_;  // a batch was queued, or stopping
  std::condition_variable idle_;  // the queue emptied and nothing is in flight
  std::deque<WriteBatch> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace kvsnap::detail
