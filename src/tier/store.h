// Internal: what a tier backend is — a key-value store with sets of strings, reached in batched
// round trips, each bounded by a deadline — and what the tier counts.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvsnap/tier.h"

namespace kvsnap::detail {

using Deadline = std::chrono::steady_clock::time_point;

// A round trip that did not complete. The tier goes on without the store.
struct StoreFailure : std::runtime_error {
  enum class Reason {
    failed,     // unreachable, refused, or the connection broke
    timed_out,  // no answer before the deadline
    waiting,    // not tried: the store failed less than a retry interval ago
  };
  StoreFailure(const std::string& what, Reason reason) : std::runtime_error(what), reason(reason) {}
  Reason reason;
};

// A probe that met an index set listing more members, or longer ones, than any tier writes
// (Store::kMaximumIndexMembers), or an index that is not a set at all (a Redis key of another
// type, which SADD cannot add to): planted by whoever can write the store. The store is well; the
// index is of no use to anyone (TierImpl::drop_index deletes it, and the next write makes it).
struct UnusableIndex : StoreFailure {
  UnusableIndex(const std::string& what, std::string set)
      : StoreFailure(what, Reason::failed), set(std::move(set)) {}
  std::string set;
};

// A fetch whose values together would pass the bytes it may hold: `index` is the first key whose
// value did not fit (the values before it did). The store is well; the connection may be new
// next time (a Redis reply is cut off mid-way).
struct FetchTooLarge : std::runtime_error {
  FetchTooLarge(size_t index, int64_t max_bytes)
      : std::runtime_error("the values would pass the bytes the fetch may hold"),
        index(index),
        max_bytes(max_bytes) {}
  size_t index;
  int64_t max_bytes;
};

struct WriteBatch {
  std::vector<std::pair<std::string, std::string>> objects;  // key, value
  std::vector<std::pair<std::string, std::string>> index;    // set, member
  // Objects and index entries not written because this process knows the store holds them:
  // the writer checks that it still does (a flushed, restarted or evicting store loses them).
  std::vector<std::string> known;
  std::vector<std::pair<std::string, int64_t>> known_index;  // set, the point's offset
  // Objects to delete (ones a lookup rejected as damaged or forged), before anything else.
  std::vector<std::string> doomed;
  bool empty() const {
    return objects.empty() && index.empty() && known.empty() && known_index.empty() &&
           doomed.empty();
  }
  int64_t bytes() const {
    int64_t total = 0;
    for (const auto& object : objects) total += static_cast<int64_t>(object.second.size());
    return total;
  }
};

class Store {
 public:
  // The largest object a store hands back: Redis's largest value (its proto-max-bulk-len, 512 MB
  // by default), so every backend hands back the same objects. Anything larger is never read
  // into memory: a dir: file reads as missing; a Redis reply fails the round trip before its
  // bytes pass this size.
  static constexpr int64_t kMaximumObjectBytes = int64_t(512) << 20;
  // The most members probe lists of one index (a restore point per offset of a 64k-token chunk;
  // half as many offsets where processes of two versions wrote a bare and a sized member each):
  // a store planted with millions of them costs a lookup that many names at most (a dir: index
  // is listed that far; a Redis reply announcing more fails before anything is allocated).
  static constexpr int64_t kMaximumIndexMembers = int64_t(1) << 16;

  virtual ~Store() = default;
  // One round trip: the members of each set (empty when missing) and the size of each key's
  // value in bytes (-1 when missing, or not one fetch would hand back); the sets and keys there
  // start their lifetimes afresh (they are in use). A size is what the store says: fetch still
  // holds the values to its bytes.
  virtual void probe(std::span<const std::string> sets, std::span<const std::string> keys,
                     Deadline deadline, std::vector<std::vector<std::string>>& members,
                     std::vector<int64_t>& sizes) = 0;
  // One round trip: each key's value (nullopt when missing), its lifetime refreshed. The replies
  // together hold at most `max_bytes` (objects, and any line sent in their place): a store whose
  // answer would pass it throws FetchTooLarge before the reply that would. Checked as the bytes
  // arrive, so a hostile store costs `max_bytes` plus, while the last reply is read and copied
  // out, the connection's buffer and a copy of that reply (two of the largest objects at most).
  virtual std::vector<std::optional<std::string>> fetch(std::span<const std::string> keys,
                                                        Deadline deadline, int64_t max_bytes) = 0;
  // Deletes the doomed keys, writes the objects, then adds the index members (each with the
  // lifetime). Returns the objects the store refused one by one (a dir: store's object over its
  // size limit); a store that refuses the commands themselves (Redis: NOAUTH, READONLY, out of
  // memory with eviction off) throws StoreFailure, saying so — as does Redis for a value over
  // its proto-max-bulk-len, which it answers by closing the connection (the batch is lost:
  // TierOptions::max_object_bytes must stay within the server's setting).
  struct Refused {
    int64_t objects = 0;
    int64_t bytes = 0;  // their values' bytes
  };
  virtual Refused write(const WriteBatch& batch, Deadline deadline) = 0;
};

// Whether the store answers, shared by a tier's connections: logs once when it is lost and once
// when it is back, so an outage is two lines, not one per request; `back` runs then too (the
// store may have lost what it held) — unless every failure since was only an answer too late
// (`lost` false: a slow store, which kept what it held; the writer's probes still notice what a
// store lost).
class StoreHealth {
 public:
  StoreHealth(std::string address, std::function<void(const std::string&)> log,
              std::function<void()> back)
      : address_(std::move(address)), log_(std::move(log)), back_(std::move(back)) {}
  void failed(const std::string& why, bool lost = true);
  void answered();
  // The store answers but refuses writes (out of memory with eviction off, a read-only replica):
  // logged once, and once when it takes them again.
  void writes_refused(const std::string& why);
  void writes_taken();

 private:
  std::mutex mutex_;
  bool down_ = false, lost_ = false, refusing_writes_ = false;
  std::string address_;
  std::function<void(const std::string&)> log_;
  std::function<void()> back_;
};

// The counters behind TierStats, updated from any thread.
struct TierCounters {
  std::atomic<int64_t> lookups{0}, hits{0}, restored_tokens{0}, bytes_read{0}, bytes_written{0},
      timeouts{0}, rejected{0}, unauthenticated{0}, objects_written{0}, dropped_batches{0},
      store_errors{0}, caller_microseconds{0};
  TierStats stats() const;
};

// Adds the time from its construction to its destruction to a counter.
class CallerTime {
 public:
  explicit CallerTime(std::atomic<int64_t>& counter)
      : counter_(counter), start_(std::chrono::steady_clock::now()) {}
  ~CallerTime() {
    counter_ += std::chrono::duration_cast<std::chrono::microseconds>(
                    std::chrono::steady_clock::now() - start_)
                    .count();
  }
  CallerTime(const CallerTime&) = delete;
  CallerTime& operator=(const CallerTime&) = delete;

 private:
  std::atomic<int64_t>& counter_;
  std::chrono::steady_clock::time_point start_;
};

struct StoreOptions {
  std::chrono::seconds ttl{0};
  std::chrono::milliseconds retry_interval{0};
  std::shared_ptr<StoreHealth> health;
  // dir: only — without a MAC key nothing but ownership says who wrote an object: the folder
  // must be private (check_private_folder) and files of other users read as missing.
  bool own_files_only = false;
  // Redis only: the reply limits above (Store::kMaximum...), lowered by tests; TierImpl lowers
  // max_index_members to 16 per token of its chunk.
  int64_t max_object_bytes = Store::kMaximumObjectBytes;
  int64_t max_index_members = Store::kMaximumIndexMembers;
  // Redis only: a host name's numeric addresses (IPv4 before IPv6, as hiredis orders them), or
  // throws std::exception saying why there are none. Empty: getaddrinfo. Tests: one that hangs.
  std::function<std::vector<std::string>(const std::string& host)> resolve = nullptr;
  // Redis only: every call waits for a running resolution of the host name until its deadline
  // (the writer's connection: off the request path, a batch waits rather than being dropped).
  // Otherwise only the call that started it waits; later ones fail at once (waiting).
  bool wait_for_resolution = false;
};

// Throws Error unless `address` is "dir:PATH" or "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]".
void check_store_address(const std::string& address);
// `address` with any password replaced by "***".
std::string redact_address(const std::string& address);
// A connection to the store at `address` (connecting lazily: never fails for an unreachable
// store). Throws Error for a malformed address or a folder that cannot be used.
std::unique_ptr<Store> open_store(const std::string& address, const StoreOptions& options);

}  // namespace kvsnap::detail
