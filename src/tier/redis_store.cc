#include "tier/redis_store.h"

#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvsnap/error.h"

namespace kvsnap::detail {
namespace {

using Clock = std::chrono::steady_clock;

// SIGPIPE blocked on this thread while it lives. A write to a connection the server has closed
// (its idle timeout, a restart) fails with EPIPE and raises SIGPIPE, whose default action kills
// the process: hiredis writes with plain write(). A SIGPIPE raised meanwhile is taken from this
// thread's pending signals before the old mask returns (one pending before is left alone), and
// errno is kept for the caller. The process's signal dispositions are the application's.
class NoSigpipe {
 public:
  NoSigpipe() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    blocked_ = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
  }
  ~NoSigpipe() {
    if (!blocked_) return;
    const int saved = errno;
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      const timespec now{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &now) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    errno = saved;
  }
  NoSigpipe(const NoSigpipe&) = delete;
  NoSigpipe& operator=(const NoSigpipe&) = delete;

 private:
  sigset_t pipe_{}, old_{};
  bool was_pending_ = false, blocked_ = false;
};

timeval remaining(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
  const int64_t micros = std::max<int64_t>(left.count(), 1);
  return timeval{static_cast<time_t>(micros / 1000000), static_cast<suseconds_t>(micros % 1000000)};
}

}  // namespace

// The most bytes a reply holds around what it carries: "$<length>\r\n", "\r\n".
constexpr int64_t kReplyHeader = 64;
// The longest status or error line a reply to anything but GETEX carries, and the longest index
// member ("OFFSET:BYTES", two decimal numbers: 41 bytes at most).
constexpr int64_t kLineBytes = 4096;
constexpr int64_t kMemberBytes = 64;

// What one reply may hold, by the command it answers: GETEX an object, SMEMBERS an index's
// members, anything else a status, a number or an error line.
struct RedisStore::ReplyCeiling {
  int64_t string_bytes = kLineBytes;  // its string (an object, or a status or error line)
  int64_t members = 0;                // elements of its array (0: it is never one)
  // All its bytes, headers included: what may lie unparsed while it is read.
  int64_t bytes() const {
    return string_bytes + kReplyHeader + members * (kMemberBytes + kReplyHeader);
  }
};

// The reply limits, enforced while hiredis parses (it builds every reply through the functions
// in `hooks`, each handed `this` as the task's privdata): an array is refused from its header,
// before hiredis allocates its element pointers (a hostile "*200000000" would cost 1.6 GB, and
// a reply object per element after it), so is an array nested in one or an element past the
// count its array announced, and each string past what its command's reply may hold. Strings
// are bounded as they arrive too: round_trip checks the reader's buffer after every read. The
// hooks allocate nothing of their own (no exception may cross hiredis's C frames): why they
// stopped the reader is formatted by round_trip.
struct RedisStore::ReplyLimits {
  enum class Broken { no, nested, long_array, long_string, extra_element };
  redisReplyObjectFunctions hooks{};
  const redisReplyObjectFunctions* base = nullptr;  // hiredis's own
  ReplyCeiling reply;                               // of the reply being parsed
  Broken broken = Broken::no;
  int64_t value = 0;  // the count or length that broke a limit

  // Routes `context`'s reader through the limits.
  void install(redisContext* context) {
    base = context->reader->fn;
    hooks = *base;
    hooks.createArray = array_hook(hooks.createArray);
    hooks.createString = [](const redisReadTask* task, char* text, size_t length) -> void* {
      auto& self = *static_cast<ReplyLimits*>(task->privdata);
      if (extra(task)) return self.stop(Broken::extra_element, task->idx);
      const int64_t most = task->parent != nullptr ? kMemberBytes : self.reply.string_bytes;
      if (length > static_cast<size_t>(most)) {
        return self.stop(Broken::long_string, static_cast<int64_t>(length));
      }
      return self.base->createString(task, text, length);
    };
    hooks.createInteger = [](const redisReadTask* task, long long value) -> void* {
      auto& self = *static_cast<ReplyLimits*>(task->privdata);
      if (extra(task)) return self.stop(Broken::extra_element, task->idx);
      return self.base->createInteger(task, value);
    };
    hooks.createNil = [](const redisReadTask* task) -> void* {
      auto& self = *static_cast<ReplyLimits*>(task->privdata);
      if (extra(task)) return self.stop(Broken::extra_element, task->idx);
      return self.base->createNil(task);
    };
    context->reader->fn = &hooks;
    context->reader->privdata = this;
  }

  // The array hook for this hiredis's createArray, whose count is an int in 0.14 and a size_t
  // from 1.0 on.
  template <class Count>
  using CreateArray = void* (*)(const redisReadTask*, Count);
  template <class Count>
  static CreateArray<Count> array_hook(CreateArray<Count> /*hiredis's, for its type*/) {
    return [](const redisReadTask* task, Count elements) -> void* {
      auto& self = *static_cast<ReplyLimits*>(task->privdata);
      if (task->parent != nullptr) return self.stop(Broken::nested, 0);
      bool negative = false;
      if constexpr (std::is_signed_v<Count>) negative = elements < 0;
      if (negative || static_cast<uint64_t>(elements) > static_cast<uint64_t>(self.reply.members)) {
        return self.stop(Broken::long_array, static_cast<int64_t>(elements));
      }
      return self.base->createArray(task, elements);
    };
  }

  void expect(const ReplyCeiling& ceiling) {
    reply = ceiling;
    broken = Broken::no;
  }

  // Why the reader stopped, when a limit stopped it; empty otherwise.
  std::string why() const {
    switch (broken) {
      case Broken::no:
        return "";
      case Broken::nested:
        return "a reply nests an array in an array (no command the tier sends is answered so)";
      case Broken::long_array:
        return fmt::format(
            "a reply announces an array of {} elements, more than the {} {}", value, reply.members,
            reply.members > 0 ? "an index may list" : "its command is answered with");
      case Broken::long_string:
        return too_long(value, reply);
      case Broken::extra_element:
        return fmt::format("a reply holds an element past the count its array announced ({})",
                           value);
    }
    return "";
  }

  static std::string too_long(int64_t bytes, const ReplyCeiling& ceiling) {
    return fmt::format("a reply of {} bytes, more than the {} its command's reply may hold{}",
                       bytes, ceiling.members > 0 ? kMemberBytes : ceiling.string_bytes,
                       ceiling.string_bytes > kLineBytes ? " (the largest object)" : "");
  }

 private:
  // An element past its array's announced count, which hiredis would store past the array's
  // end: none is handed over by the hiredis built here, a guard for any other.
  static bool extra(const redisReadTask* task) {
    return task->parent != nullptr && task->idx >= task->parent->elements;
  }
  void* stop(Broken why, int64_t what) {
    broken = why;
    value = what;
    return nullptr;
  }
};

// One reply, freed with it.
class RedisStore::Reply {
 public:
  explicit Reply(redisReply* reply) : reply_(reply, freeReplyObject) {}
  const redisReply& operator*() const { return *reply_; }
  const redisReply* operator->() const { return reply_.get(); }
  bool error() const { return reply_->type == REDIS_REPLY_ERROR; }
  std::string_view text() const { return {reply_->str, reply_->len}; }

 private:
  std::unique_ptr<redisReply, void (*)(void*)> reply_;
};

std::string RedisStore::refusal(std::string_view command, const Reply& reply) {
  if (!reply.error()) return {};
  const std::string_view text = reply.text();
  if (text.starts_with("WRONGTYPE")) return {};
  constexpr size_t kShown = 200;
  const bool unknown = text.find("unknown command") != std::string_view::npos;
  return fmt::format("{} refused: {}{}{}", command, text.substr(0, kShown),
                     text.size() > kShown ? "..." : "",
                     unknown ? " (the tier needs Redis 6.2 or later)" : "");
}

RedisStore::RedisStore(RedisAddress address, StoreOptions options)
    : address_(std::move(address)),
      options_(std::move(options)),
      resolver_(address_.host, options_.resolve, options_.wait_for_resolution),
      limits_(std::make_unique<ReplyLimits>()) {}

RedisStore::~RedisStore() { drop_connection(); }

void RedisStore::drop_connection() noexcept {
  if (context_ != nullptr) redisFree(context_);
  context_ = nullptr;
}

void RedisStore::fail(const std::string& why, bool timed_out) {
  // A connection that never completed a round trip (refused, AUTH or SELECT refused, no answer):
  // the host's addresses may have moved to another server, resolved afresh next time.
  if (!answered_) resolver_.forget();
  drop_connection();  // replies may still be in flight: the connection is unusable
  retry_after_ = Clock::now() + options_.retry_interval;
  options_.health->failed(why, /*lost=*/!timed_out);
  throw StoreFailure(why,
                     timed_out ? StoreFailure::Reason::timed_out : StoreFailure::Reason::failed);
}

void RedisStore::await(short events, Deadline deadline) {
  pollfd socket{context_->fd, events, 0};
  while (true) {
    const int64_t left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) fail("no answer before the deadline", true);
    const int ready = ::poll(&socket, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (ready > 0) return;  // ready, or an error or hang-up the next read or write reports
    if (ready < 0 && errno != EINTR) {
      fail(fmt::format("cannot wait for the connection ({})", std::strerror(errno)), false);
    }
  }
}

void RedisStore::fail_io(Deadline deadline) {
  if (const std::string why = limits_->why(); !why.empty()) fail(why, false);
  const bool timed_out =
      (context_->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK)) ||
      Clock::now() >= deadline;
  fail(timed_out ? std::string("no answer before the deadline")
                 : fmt::format("the connection failed ({})", context_->errstr),
       timed_out);
}

void RedisStore::connect(Deadline deadline) {
  if (Clock::now() < retry_after_) {
    throw StoreFailure("the store failed moments ago; not retrying yet",
                       StoreFailure::Reason::waiting);
  }
  if (Clock::now() >= deadline) {
    throw StoreFailure("no time left to connect", StoreFailure::Reason::timed_out);
  }
  // The commands view their words: the database's digits live as long as they do.
  const std::string database = std::to_string(address_.database);
  std::vector<Command> setup;
  if (!address_.password.empty()) {
    setup.push_back(address_.user.empty() ? Command{"AUTH", address_.password}
                                          : Command{"AUTH", address_.user, address_.password});
  }
  if (address_.database != 0) setup.push_back({"SELECT", database});
  // Each address in turn, as hiredis tries a name's; numeric ones resolve without a lookup.
  std::vector<std::string> addresses;
  try {
    addresses = resolver_.addresses(deadline);
  } catch (const ResolveError& e) {
    fail(e.what(), false);
  }
  for (const std::string& host : addresses) {
    if (context_ != nullptr) redisFree(context_);
    context_ = redisConnectWithTimeout(host.c_str(), address_.port, remaining(deadline));
    if (context_ == nullptr) fail("cannot allocate a connection", false);
    if (context_->err == 0 || Clock::now() >= deadline) break;
  }
  // A connection is kept only once its AUTH and SELECT are answered: one whose setup did not
  // complete (refused, no time left to send it, memory) would run every later command as the
  // default user on database 0.
  try {
    answered_ = false;  // what a new connection says first is read as a reply (an error: DENIED)
    if (context_->err == 0) limits_->install(context_);
    if (context_->err != 0) {
      resolver_.forget();  // the name may have moved: resolved afresh next time
      const bool timed_out = Clock::now() >= deadline;
      fail(fmt::format("cannot connect to {}:{} ({})", address_.host, address_.port,
                       context_->errstr),
           timed_out);
    }
    if (!setup.empty()) (void)round_trip(setup, deadline);  // a refusal fails it ("AUTH refused")
  } catch (...) {
    drop_connection();
    throw;
  }
}

std::vector<RedisStore::Reply> RedisStore::round_trip(const std::vector<Command>& commands,
                                                      Deadline deadline, bool writing,
                                                      int64_t max_values) {
  limits_->expect({});
  if (context_ != nullptr && answered_ && !idle()) {
    // Bytes nobody asked for (a server that closed the connection, or one out of step): every
    // reply read on it would answer another command. A new connection instead.
    drop_connection();
  }
  if (context_ == nullptr) connect(deadline);
  if (Clock::now() >= deadline) {
    throw StoreFailure("no time left for the round trip", StoreFailure::Reason::timed_out);
  }
  // Running out of memory once a command is queued would leave the connection out of step (the
  // command queued, or replies unread, answered on the next round trip in another's place).
  std::vector<Reply> replies;
  try {
    send(commands, deadline);
    replies = read_replies(commands, deadline, max_values);
  } catch (const std::bad_alloc&) {
    drop_connection();
    throw;
  }
  if (context_->reader->pos != context_->reader->len) {
    fail("the store sent more replies than there were commands", false);
  }
  // Refusals of writes alone (out of memory with eviction off, a read-only replica, failed
  // snapshots): lookups still work and keep what this process knows the store holds. A
  // lookup's GETEX ... EX and EXPIRE are writes too: refused, the lookup reads only.
  const auto writes_only = [](const Reply& reply) {
    const std::string_view text = reply.text();
    return text.starts_with("OOM") || text.starts_with("READONLY") || text.starts_with("MISCONF");
  };
  const auto refreshes = [](const Command& command) {
    return command[0] == "GETEX" || command[0] == "EXPIRE";
  };
  std::string refused_writes;
  for (size_t i = 0; i < replies.size(); ++i) {
    std::string why = refusal(commands[i][0], replies[i]);
    if (why.empty()) continue;
    // Before the store counts as answering: one that refuses every command is unavailable, not
    // back and lost again on every round trip.
    if (!writes_only(replies[i]) || !(writing || refreshes(commands[i]))) fail(why, false);
    if (refused_writes.empty()) refused_writes = std::move(why);
  }
  answered_ = true;
  options_.health->answered();
  if (!writing) {
    if (refused_writes.empty()) return replies;
    options_.health->writes_refused(refused_writes);
    throw RefreshRefused{};
  }
  if (!refused_writes.empty()) {  // the batch is dropped, said once
    options_.health->writes_refused(refused_writes);
    throw StoreFailure(refused_writes, StoreFailure::Reason::failed);
  }
  options_.health->writes_taken();
  refresh_on_read_ = true;
  return replies;
}

void RedisStore::send(const std::vector<Command>& commands, Deadline deadline) {
  std::vector<const char*> argv;
  std::vector<size_t> lengths;
  for (const Command& command : commands) {
    argv.clear();
    lengths.clear();
    for (std::string_view part : command) {
      argv.push_back(part.data());
      lengths.push_back(part.size());
    }
    if (redisAppendCommandArgv(context_, static_cast<int>(argv.size()), argv.data(),
                               lengths.data()) != REDIS_OK) {
      fail(fmt::format("cannot queue {} ({})", command[0], context_->errstr), false);
    }
  }
  // Every read and write waits for the socket with the deadline checked in between: the
  // socket's timeout bounds one read, so a store answering a byte at a time would otherwise hold
  // the call as long as it keeps dripping.
  for (int sent = 0; sent == 0;) {
    await(POLLOUT, deadline);
    // A write of a large buffer can block past POLLOUT: the socket's timeout is what is left.
    redisSetTimeout(context_, remaining(deadline));
    bool written = false;
    {
      const NoSigpipe quiet;
      written = redisBufferWrite(context_, &sent) == REDIS_OK;
    }
    if (!written) fail_io(deadline);
  }
}

std::vector<RedisStore::Reply> RedisStore::lookup_round_trip(
    const std::function<std::vector<Command>(bool refresh)>& commands, Deadline deadline,
    int64_t max_values) {
  if (!refresh_on_read_ && Clock::now() >= refresh_again_) refresh_on_read_ = true;
  try {
    return round_trip(commands(refresh_on_read_), deadline, false, max_values);
  } catch (const RefreshRefused&) {
    refresh_on_read_ = false;
    refresh_again_ = Clock::now() + options_.retry_interval;
  }
  return round_trip(commands(false), deadline, false, max_values);  // never RefreshRefused
}

std::vector<RedisStore::Reply> RedisStore::read_replies(const std::vector<Command>& commands,
                                                        Deadline deadline, int64_t max_values) {
  // What each reply may hold, by its command; the objects all together, at most `max_values`.
  // A read happens only while the reply being parsed is incomplete, and what then lies unparsed
  // is checked against that reply's ceiling: the buffer never holds more than the largest
  // ceiling plus one read.
  std::vector<Reply> replies;
  replies.reserve(commands.size());
  int64_t left = max_values;  // what the objects' replies may still hold
  for (size_t i = 0; i < commands.size(); ++i) {
    ReplyCeiling ceiling;
    const bool object = commands[i][0] == "GETEX" || commands[i][0] == "GET";
    if (object) ceiling.string_bytes = std::min(options_.max_object_bytes, left);
    if (commands[i][0] == "SMEMBERS") ceiling.members = options_.max_index_members;
    // An object past what is left, not past the largest one: too much together, the store well.
    const auto too_much = [&, budgeted = object && left < options_.max_object_bytes] {
      if (!budgeted) return;
      drop_connection();  // the rest of the reply is in flight: the connection is unusable
      throw FetchTooLarge(i, max_values);
    };
    // An index listing more members, or longer ones, than the tier writes (planted by whoever can
    // write the store): this round trip fails, the store is well (it answered).
    const auto unusable_index = [&](const std::string& why) {
      if (commands[i][0] != "SMEMBERS") return;
      drop_connection();  // the rest of the reply is in flight: the connection is unusable
      options_.health->answered();
      throw UnusableIndex("an index: " + why, std::string(commands[i][1]));
    };
    limits_->expect(ceiling);
    void* reply = nullptr;
    while (redisGetReplyFromReader(context_, &reply) == REDIS_OK && reply == nullptr) {
      // Not whole: all that lies unparsed is this reply's (a multi-bulk's elements leave the
      // buffer one by one), so it grows past what it may hold no further than one read.
      const auto unparsed = static_cast<int64_t>(context_->reader->len - context_->reader->pos);
      if (unparsed > ceiling.bytes()) {
        too_much();
        unusable_index(ReplyLimits::too_long(unparsed, ceiling));
        fail(ReplyLimits::too_long(unparsed, ceiling), false);
      }
      await(POLLIN, deadline);
      if (redisBufferRead(context_) != REDIS_OK) fail_io(deadline);
    }
    if (reply == nullptr) {  // the reader failed, or a limit stopped it
      const ReplyLimits::Broken broken = limits_->broken;
      if (broken == ReplyLimits::Broken::long_string) too_much();
      if (broken == ReplyLimits::Broken::long_string || broken == ReplyLimits::Broken::long_array) {
        unusable_index(limits_->why());
      }
      fail_io(deadline);
    }
    replies.emplace_back(static_cast<redisReply*>(reply));
    // Whatever it holds — an object, or a status or error line as long (hiredis builds those
    // as strings too) — is held until the round trip ends: counted.
    if (object) left -= static_cast<int64_t>(replies.back()->len);
  }
  return replies;
}

bool RedisStore::idle() const {
  if (context_->reader->pos != context_->reader->len) return false;  // read, not yet a reply
  pollfd socket{context_->fd, POLLIN, 0};
  return ::poll(&socket, 1, 0) == 0;
}

void RedisStore::probe(std::span<const std::string> sets, std::span<const std::string> keys,
                       Deadline deadline, std::vector<std::vector<std::string>>& members,
                       std::vector<int64_t>& sizes) {
  // EXPIRE after each SMEMBERS: an index set in use lives as long as the points it names,
  // whose lifetimes GETEX refreshes. EXPIRE rather than EXISTS: it answers the same (1 when the
  // key is there) and refreshes its lifetime — an object asked after is in use (a prefix the
  // asking process holds itself, one its writer skips as stored) and must not expire while it
  // is. EXISTS where the store refuses writes (refresh_on_read_). STRLEN after each key: its
  // size (an error for a key of another type, which GET would not hand back either).
  const std::string ttl = std::to_string(options_.ttl.count());
  const std::vector<Reply> replies = lookup_round_trip(
      [&](bool refresh) {
        const auto check = [&](const std::string& key) {
          return refresh ? Command{"EXPIRE", key, ttl} : Command{"EXISTS", key};
        };
        std::vector<Command> commands;
        for (const std::string& set : sets) {
          commands.push_back({"SMEMBERS", set});
          commands.push_back(check(set));
        }
        for (const std::string& key : keys) {
          commands.push_back(check(key));
          commands.push_back({"STRLEN", key});
        }
        return commands;
      },
      deadline);
  members.assign(sets.size(), {});
  sizes.assign(keys.size(), -1);
  for (size_t i = 0; i < sets.size(); ++i) {
    const Reply& reply = replies[2 * i];
    // A key of another type (planted: SADD cannot add to it, and it would never be repaired).
    if (reply.error() && reply.text().starts_with("WRONGTYPE")) {
      throw UnusableIndex("an index: it is not a set (a key of another type)", sets[i]);
    }
    if (reply->type != REDIS_REPLY_ARRAY) continue;
    for (size_t m = 0; m < reply->elements; ++m) {
      const redisReply* member = reply->element[m];
      if (member->type == REDIS_REPLY_STRING) members[i].emplace_back(member->str, member->len);
    }
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    const Reply& found = replies[2 * sets.size() + 2 * i];
    const Reply& size = replies[2 * sets.size() + 2 * i + 1];
    if (found->type == REDIS_REPLY_INTEGER && found->integer > 0 &&
        size->type == REDIS_REPLY_INTEGER && size->integer >= 0 &&
        size->integer <= options_.max_object_bytes) {  // as fetch would hand it back
      sizes[i] = static_cast<int64_t>(size->integer);
    }
  }
}

std::vector<std::optional<std::string>> RedisStore::fetch(std::span<const std::string> keys,
                                                          Deadline deadline, int64_t max_bytes) {
  // GETEX refreshes the lifetime of what is used (Redis >= 6.2); GET where the store refuses
  // writes (refresh_on_read_).
  const std::string ttl = std::to_string(options_.ttl.count());
  std::vector<Reply> replies = lookup_round_trip(
      [&](bool refresh) {
        std::vector<Command> commands;
        for (const std::string& key : keys) {
          commands.push_back(refresh ? Command{"GETEX", key, "EX", ttl} : Command{"GET", key});
        }
        return commands;
      },
      deadline, max_bytes);
  std::vector<std::optional<std::string>> values;
  for (Reply& reply : replies) {
    // (A refusal — an unknown command: Redis before 6.2; NOAUTH... — failed the round trip.)
    if (reply->type == REDIS_REPLY_STRING) {
      values.emplace_back(std::string(reply.text()));
    } else {
      values.emplace_back(std::nullopt);  // missing, or a key of another type: not usable
    }
    reply = Reply(nullptr);  // each reply goes as it is copied: never the values twice over
  }
  return values;
}

Store::Refused RedisStore::write(const WriteBatch& batch, Deadline deadline) {
  const std::string ttl = std::to_string(options_.ttl.count());
  std::vector<Command> commands;
  for (const std::string& key : batch.doomed) commands.push_back({"DEL", key});
  const size_t first = commands.size();
  for (const auto& [key, value] : batch.objects) commands.push_back({"SET", key, value, "EX", ttl});
  for (const auto& [set, member] : batch.index) {
    commands.push_back({"SADD", set, member});
    commands.push_back({"EXPIRE", set, ttl});
  }
  const std::vector<Reply> replies = round_trip(commands, deadline, /*writing=*/true);
  Refused refused;  // objects refused one by one (a refusal of the command failed the trip)
  for (size_t i = 0; i < batch.objects.size(); ++i) {
    if (!replies[first + i].error()) continue;
    ++refused.objects;
    refused.bytes += static_cast<int64_t>(batch.objects[i].second.size());
  }
  return refused;
}

}  // namespace kvsnap::detail
