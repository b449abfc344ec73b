// Internal: the Redis backend of the tier (hiredis, synchronous, pipelined): one connection,
// opened lazily and dropped on any failure; every round trip bounded by its deadline through the
// socket timeouts; after a failure nothing is tried for the retry interval.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tier/host_resolver.h"
#include "tier/store.h"

struct redisContext;

namespace kvsnap::detail {

struct RedisAddress {
  std::string host;
  int port = 6379;
  std::string user;      // Redis 6 ACL user; empty: AUTH with the password alone
  std::string password;  // empty: no AUTH
  int database = 0;
};

// Parses "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]" (PASSWORD may use %XX escapes; HOST may be
// a bracketed IPv6 address). Throws Error naming the address (password hidden) and the rule.
RedisAddress parse_redis_address(const std::string& address);

class RedisStore final : public Store {
 public:
  RedisStore(RedisAddress address, StoreOptions options);
  ~RedisStore() override;
  RedisStore(const RedisStore&) = delete;
  RedisStore& operator=(const RedisStore&) = delete;

  void probe(std::span<const std::string> sets, std::span<const std::string> keys,
             Deadline deadline, std::vector<std::vector<std::string>>& members,
             std::vector<int64_t>& sizes) override;
  std::vector<std::optional<std::string>> fetch(std::span<const std::string> keys,
                                                Deadline deadline, int64_t max_bytes) override;
  Refused write(const WriteBatch& batch, Deadline deadline) override;

  class Reply;
  using Command = std::vector<std::string_view>;

 private:
  // Sends `commands` in one pipeline and returns their replies in order. Throws StoreFailure
  // (dropping the connection) when the connection or a reply fails or the deadline passes, and
  // when a reply refuses its command itself (refusal()): then a store that refuses a lookup's
  // commands is unavailable, and one that refuses a write's (`writing`: out of memory with
  // eviction off, a read-only replica) refuses writes (StoreHealth), its lookups unaffected.
  // The objects' replies (GET, GETEX) together hold at most `max_values`: past it, FetchTooLarge
  // (the connection dropped, the store well).
  std::vector<Reply> round_trip(const std::vector<Command>& commands, Deadline deadline,
                                bool writing = false, int64_t max_values = INT64_MAX);
  // A lookup's round trip: commands(refresh_on_read_), sent again as commands(false) (reading
  // only) when the store refuses the refreshes as writes (RefreshRefused).
  std::vector<Reply> lookup_round_trip(
      const std::function<std::vector<Command>(bool refresh)>& commands, Deadline deadline,
      int64_t max_values = INT64_MAX);
  // Queues `commands` and writes them to the socket (fails as round_trip does).
  void send(const std::vector<Command>& commands, Deadline deadline);
  // The replies to `commands`, sent: each bounded as it is parsed by what its command is answered
  // with (ReplyLimits), the objects together by `max_values`.
  std::vector<Reply> read_replies(const std::vector<Command>& commands, Deadline deadline,
                                  int64_t max_values);
  // Whether the connection holds nothing unread: no bytes read but not yet a reply, none waiting
  // on the socket (nor a hang-up).
  bool idle() const;
  bool answered_ = false;  // the connection has completed a round trip
  // Whether lookups refresh the lifetimes of what they read (GETEX ... EX, EXPIRE), or read
  // only (GET, EXISTS): a store that refuses writes (a read-only replica, MISCONF) refuses those
  // too. Off when it did, until a write is taken or the retry interval has passed.
  bool refresh_on_read_ = true;
  std::chrono::steady_clock::time_point refresh_again_{};
  // Thrown by round_trip when a lookup's only refusals are of its refreshes as writes: every
  // reply was read (the connection is in step), and the lookup is sent again, reading only.
  struct RefreshRefused {};
  void connect(Deadline deadline);
  // Frees the connection (none next: the next round trip connects again).
  void drop_connection() noexcept;
  // Waits until the socket is ready for `events` (poll), failing at the deadline.
  void await(short events, Deadline deadline);
  // Fails for a hiredis call that returned REDIS_ERR: timed out when the socket's timeout or
  // the deadline ran out.
  [[noreturn]] void fail_io(Deadline deadline);
  [[noreturn]] void fail(const std::string& why, bool timed_out);
  // Why `reply` refuses its command itself (NOAUTH, NOPERM, READONLY, MISCONF, OOM, LOADING, an
  // unknown command...), which every other such command would be refused for too: said (the
  // health log), not read as a missing key or one refused object. Empty for a reply that is no
  // error, or an error of its key alone (WRONGTYPE: a key of another type).
  static std::string refusal(std::string_view command, const Reply& reply);

  RedisAddress address_;
  StoreOptions options_;
  HostResolver resolver_;  // the host's addresses (resolved on a thread of their own)
  // What the reader may build of a reply (StoreOptions' limits), checked as hiredis parses: see
  // install_limits in redis_store.cc. Outlives every connection's reader.
  struct ReplyCeiling;
  struct ReplyLimits;
  std::unique_ptr<ReplyLimits> limits_;
  redisContext* context_ = nullptr;
  std::chrono::steady_clock::time_point retry_after_{};
};

}  // namespace kvsnap::detail
