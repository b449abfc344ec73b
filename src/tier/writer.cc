#include "tier/writer.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <set>

#include "tier/keys.h"
#include "tier/object.h"

namespace kvsnap::detail {

namespace {

int64_t object_bytes(const WriteBatch& batch) {
  int64_t bytes = 0;
  for (const auto& object : batch.objects) bytes += static_cast<int64_t>(object.second.size());
  return bytes;
}

}  // namespace

LookupGate::Entry::Entry(LookupGate& gate) : gate_(gate) {
  const std::lock_guard<std::mutex> lock(gate_.mutex_);
  ++gate_.started_;
}

LookupGate::Entry::~Entry() {
  {
    const std::lock_guard<std::mutex> lock(gate_.mutex_);
    ++gate_.finished_;
  }
  gate_.finished_one_.notify_all();
}

void LookupGate::wait_for_lookups(Deadline until) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t in_flight_now = started_;
  finished_one_.wait_until(lock, until, [&] { return finished_ >= in_flight_now; });
}

WriteBehind::WriteBehind(std::unique_ptr<Store> store, Options options, TierCounters& counters)
    : store_(std::move(store)),
      options_(std::move(options)),
      counters_(counters),
      thread_([this] { run(); }) {}

WriteBehind::~WriteBehind() {
  (void)flush(options_.write_timeout);
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    counters_.dropped_batches += static_cast<int64_t>(queue_.size());
    for (const WriteBatch& batch : queue_) queued_bytes_ -= object_bytes(batch);
    queue_.clear();  // the store is too slow: what is left would hold up the exit
    doomed_.clear();
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

bool WriteBehind::fits(int64_t bytes) const {
  // A batch larger than the budget still goes when nothing else waits or is written: else a
  // session that large could never be stored, nor any later one with its prompt.
  return queue_.size() < options_.capacity &&
         (queued_bytes_ + bytes <= options_.capacity_bytes || (queued_bytes_ == 0 && !busy_));
}

bool WriteBehind::has_room(int64_t bytes) {
  const std::lock_guard<std::mutex> lock(mutex_);
  return fits(bytes);
}

bool WriteBehind::push(WriteBatch batch) {
  const int64_t bytes = object_bytes(batch);
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!fits(bytes)) {
      ++counters_.dropped_batches;
      return false;
    }
    queue_.push_back(std::move(batch));  // first: out of memory here must leave the count as it was
    queued_bytes_ += bytes;
  }
  wake_.notify_one();
  return true;
}

void WriteBehind::doom(std::string key) {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (doomed_.size() >= kMaxDoomedKeys ||
        std::find(doomed_.begin(), doomed_.end(), key) != doomed_.end()) {
      return;
    }
    doomed_.push_back(std::move(key));
  }
  wake_.notify_one();
}

bool WriteBehind::flush(std::chrono::milliseconds timeout) {
  // A year stands for any longer wait: now + milliseconds::max() overflows the clock.
  timeout = std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365));
  std::unique_lock<std::mutex> lock(mutex_);
  return idle_.wait_for(lock, timeout,
                        [this] { return queue_.empty() && doomed_.empty() && !busy_; });
}

void WriteBehind::run() {
  // Writes are best-effort background work: on a busy machine the requests' threads go first.
  // (Linux: a thread's nice value; failing to set it changes nothing else.)
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty() || !doomed_.empty(); });
    if (queue_.empty() && (stopping_ || doomed_.empty())) return;  // stopping: all was sent
    WriteBatch batch;
    if (!queue_.empty()) {
      batch = std::move(queue_.front());
      queue_.pop_front();
    }
    // The doomed keys go with it, deleted before its objects are written (only doom() fills
    // a batch's doomed list).
    batch.doomed.swap(doomed_);
    const int64_t bytes = object_bytes(batch);
    busy_ = true;
    lock.unlock();
    try {
      send(batch);
    } catch (...) {
      // Anything but the store's own failures (handled in send): out of memory while tagging
      // the objects, a callback that threw. The batch is lost, not the process.
      ++counters_.dropped_batches;
    }
    batch = {};  // its memory goes before its bytes leave the count
    lock.lock();
    queued_bytes_ -= bytes;
    busy_ = false;
    if (queue_.empty() && doomed_.empty()) idle_.notify_all();
  }
}

void WriteBehind::send(WriteBatch& batch) {
  if (!options_.mac_key.empty()) {
    for (auto& [key, value] : batch.objects) append_tag(value, key, options_.mac_key);
  }
  if (options_.known) std::erase_if(batch.doomed, options_.known);
  if (batch.empty()) return;
  // The write timeout bounds the store's time: waiting for lookups extends the deadline.
  Deadline deadline = std::chrono::steady_clock::now() + options_.write_timeout;
  if (!batch.known.empty() || !batch.known_index.empty()) {
    const auto waited_from = std::chrono::steady_clock::now();
    lookups_.wait_for_lookups(waited_from + options_.lookup_timeout);
    deadline += std::chrono::steady_clock::now() - waited_from;
    if (!still_holds(batch, deadline) && options_.lost) options_.lost();
    // A set the check doomed (planted: unusable) goes first in this batch: before its index
    // entries are added to it, not after (which would delete them).
    const std::lock_guard<std::mutex> lock(mutex_);
    batch.doomed.insert(batch.doomed.end(), std::make_move_iterator(doomed_.begin()),
                        std::make_move_iterator(doomed_.end()));
    doomed_.clear();
  }
  if (batch.objects.empty() && batch.index.empty() && batch.doomed.empty()) return;
  std::vector<std::string> accepted;
  bool refused = false;
  WriteBatch slice;
  int64_t bytes = 0;
  for (size_t i = 0; i < batch.objects.size() || i == 0; ++i) {
    const bool last = i + 1 >= batch.objects.size();
    if (i < batch.objects.size()) {
      bytes += static_cast<int64_t>(batch.objects[i].second.size());
      slice.objects.push_back(std::move(batch.objects[i]));
    }
    if (i == 0) slice.doomed = std::move(batch.doomed);
    if (last) slice.index = std::move(batch.index);  // entries after every object they name
    if (!last && bytes < kSliceBytes) continue;
    const auto waited_from = std::chrono::steady_clock::now();
    lookups_.wait_for_lookups(waited_from + options_.lookup_timeout);
    deadline += std::chrono::steady_clock::now() - waited_from;
    std::optional<int64_t> slice_refused = send_slice(slice, deadline);
    if (!slice_refused) return;  // the store failed: the rest (and the index) is dropped
    refused = refused || *slice_refused > 0;
    for (auto& object : slice.objects) accepted.push_back(std::move(object.first));
    slice = {};
    bytes = 0;
  }
  // Known only once the whole batch is in, index included: a point whose index entry was lost
  // with a later slice must be written (and indexed) again, not skipped as known.
  if (!refused && options_.written) {
    try {
      options_.written(accepted);
    } catch (...) {  // out of memory noting them: the batch is stored, only known less
    }
  }
}

bool WriteBehind::still_holds(const WriteBatch& batch, Deadline deadline) {
  std::vector<std::string> sets;
  for (const auto& [set, offset] : batch.known_index) {
    if (std::find(sets.begin(), sets.end(), set) == sets.end()) sets.push_back(set);
  }
  std::vector<std::vector<std::string>> members;
  std::vector<int64_t> sizes;
  try {
    store_->probe(sets, batch.known, deadline, members, sizes);
  } catch (const UnusableIndex& failure) {
    if (options_.unusable_index) options_.unusable_index(failure);
    return true;  // what it knows is forgotten (and the set deleted): written again anyway
  } catch (const StoreFailure& failure) {
    if (failure.reason != StoreFailure::Reason::waiting) ++counters_.store_errors;
    return true;  // unknown: the next batch asks again
  }
  if (std::any_of(sizes.begin(), sizes.end(), [](int64_t size) { return size < 0; })) return false;
  // A known point is held when its index lists its offset, whatever size the member says: each
  // set's members are read once.
  std::vector<std::set<int64_t>> listed(sets.size());
  for (size_t k = 0; k < sets.size(); ++k) {
    for (const std::string& member : members[k]) {
      if (const auto entry = TierKeys::parse_index_member(member)) listed[k].insert(entry->offset);
    }
  }
  for (const auto& [set, offset] : batch.known_index) {
    const auto k = static_cast<size_t>(std::find(sets.begin(), sets.end(), set) - sets.begin());
    if (listed[k].count(offset) == 0) return false;
  }
  return true;
}

std::optional<int64_t> WriteBehind::send_slice(const WriteBatch& slice, Deadline deadline) {
  try {
    const Store::Refused refused = store_->write(slice, deadline);
    counters_.store_errors += refused.objects;
    counters_.objects_written += static_cast<int64_t>(slice.objects.size()) - refused.objects;
    counters_.bytes_written += slice.bytes() - refused.bytes;
    return refused.objects;
  } catch (const StoreFailure& failure) {
    if (failure.reason != StoreFailure::Reason::waiting) ++counters_.store_errors;
    ++counters_.dropped_batches;
    return std::nullopt;
  }
}

}  // namespace kvsnap::detail
