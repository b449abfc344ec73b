// The Redis tier under faults, each against a real redis-server on a free loopback port: absent
// at start, killed and restarted, paused beyond the lookup timeout, flushed, evicting at
// maxmemory; AUTH, databases and TTLs. Every output equals recomputation (run_turn) and no
// request fails because of the tier.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "support/slow_link.h"
#include "support/tier_support.h"
#include "tier/store.h"

namespace kvsnap {
namespace {

using Clock = std::chrono::steady_clock;
using testing::Conversation;
using testing::RedisServer;
using testing::tier_options;
using testing::TierProcess;
using testing::tokens;
using testing::operator+;

Conversation talk;

TEST(TierRedis, AServerAbsentAtStartCostsNothingButHitsAndIsUsedOnceItAnswers) {
  RedisServer server;
  server.stop();
  TierProcess process(server.address());
  EXPECT_EQ(process.turn(talk.first, talk.reply, talk.ends).cached, 0);  // nothing, no failure
  EXPECT_GE(process.tier->stats().store_errors, 1);
  EXPECT_EQ(process.log.count("is unavailable"), 1) << process.log.all();
  server.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // past the retry interval
  (void)process.turn(talk.system + tokens(700, 5), tokens(710, 3), talk.ends);
  EXPECT_EQ(process.log.count("answers again"), 1) << process.log.all();
  EXPECT_GT(process.tier->stats().objects_written, 0);
  TierProcess fresh(server.address());
  EXPECT_EQ(fresh.turn(talk.system + tokens(720, 4), tokens(730, 2)).cached, 20);
}

TEST(TierRedis, AServerKilledMidRunAndRestartedLosesEntriesNotRequests) {
  RedisServer server;
  TierProcess writer(server.address());
  (void)writer.turn(talk.first, talk.reply, talk.ends);
  server.stop();  // SIGKILL: everything it held is gone
  TierProcess reader(server.address());
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 0);
  (void)writer.turn(talk.second, tokens(500, 3));  // written behind into nothing: dropped
  server.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // The writer's next session writes again what the restarted server lost (its chunks too).
  (void)writer.turn(talk.second + tokens(500, 3) + tokens(510, 4), tokens(520, 2));
  TierProcess late(server.address());
  EXPECT_EQ(
      late.turn(talk.second + tokens(500, 3) + tokens(510, 4) + tokens(520, 2) + tokens(530, 3),
                tokens(540, 2))
          .cached,
      static_cast<int64_t>(talk.second.size()) + 3 + 4 + 1);
}

TEST(TierRedis, APausedServerDelaysARequestByNoMoreThanTheTimeout) {
  RedisServer server;
  {
    TierProcess writer(server.address());
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  TierOptions options = tier_options();
  options.lookup_timeout = std::chrono::milliseconds(50);
  options.write_timeout = std::chrono::milliseconds(2000);  // a write in close would show
  options.retry_interval = std::chrono::milliseconds(200);
  TierProcess reader(server.address(), options);
  server.pause();  // SIGSTOP: connections are accepted, nothing answers
  const auto start = Clock::now();
  PrefixCache::Session session = reader.cache.begin(talk.second);
  const auto waited = Clock::now() - start;
  EXPECT_EQ(session.cached(), 0);
  // Bounds with room for a loaded (sanitizer) machine: without the timeout begin would wait as
  // long as the server is paused, and a write in close would take the write timeout.
  EXPECT_LT(waited, std::chrono::milliseconds(50 + 450)) << "begin waited on a paused store";
  EXPECT_TRUE(reader.stack.forward_and_check(session.remaining(), talk.second));
  session.prefill_done();
  const auto closing = Clock::now();
  session.close();  // written behind: close does not wait on the store
  EXPECT_LT(Clock::now() - closing, std::chrono::milliseconds(500));
  EXPECT_EQ(reader.tier->stats().timeouts, 1);
  server.resume();
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // past the retry interval
  TierProcess again(server.address(), options);
  // 31 from the writer, or more if the paused server took the reader's writes once resumed.
  EXPECT_GE(again.turn(talk.second, tokens(500, 3)).cached, 31);
}

// A lookup that times out finds a slow store, not one that lost what it held: once it answers
// again, the objects this process knows are stored are not written again.
TEST(TierRedis, ALookupThatTimesOutDoesNotMakeTheWriterWriteEverythingAgain) {
  RedisServer server;
  TierOptions options = tier_options();
  options.lookup_timeout = std::chrono::milliseconds(50);
  TierProcess writer(server.address(), options);
  (void)writer.turn(talk.first, talk.reply, talk.ends);
  const int64_t written = writer.tier->stats().objects_written;
  ASSERT_GT(written, 0);
  server.pause();
  { PrefixCache::Session miss = writer.cache.begin(tokens(6000, 30)); }  // asks the tier: late
  server.resume();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));            // past the retry interval
  { PrefixCache::Session miss = writer.cache.begin(tokens(7000, 30)); }  // it answers again
  EXPECT_GE(writer.tier->stats().timeouts, 1);
  EXPECT_EQ(writer.log.count("answers again"), 1) << writer.log.all();
  (void)writer.turn(talk.first, talk.reply);  // the same objects: all known
  EXPECT_EQ(writer.tier->stats().objects_written, written);
}

// A store that answers, but a byte at a time: the lookup timeout bounds all of a lookup's round
// trips together, not each read (the socket's timeout restarts with every byte).
TEST(TierRedis, AStoreAnsweringAByteAtATimeDelaysARequestByNoMoreThanTheTimeout) {
  RedisServer server;
  {
    TierProcess writer(server.address());
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  testing::SlowLink link(server.port(), std::chrono::milliseconds(20));
  TierOptions options = tier_options();
  options.lookup_timeout = std::chrono::milliseconds(50);
  options.write_timeout = std::chrono::milliseconds(50);
  TierProcess reader(link.address(), options);
  const auto start = Clock::now();
  PrefixCache::Session session = reader.cache.begin(talk.second);
  // The point alone is kilobytes: dripped, its reply would take minutes.
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(50 + 950));
  EXPECT_EQ(session.cached(), 0);
  EXPECT_EQ(reader.tier->stats().timeouts, 1);
  EXPECT_TRUE(reader.stack.forward_and_check(session.remaining(), talk.second));
  session.prefill_done();
  session.close();
}

// A server that closed an idle connection (its `timeout`): the next write of a batch larger than
// the socket's buffer goes out in several write()s, and the one after the server's reset fails
// with EPIPE, raising SIGPIPE — whose default action would kill the engine. It must fail that
// write only (in a child process, so the test sees how it ended), and the next one reconnects.
TEST(TierRedis, AWriteToAConnectionTheServerClosedFailsThatWriteNotTheProcess) {
  RedisServer server({.password = "", .config = {"--timeout", "1"}});
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto health = std::make_shared<detail::StoreHealth>(
        server.address(), [](const std::string&) {}, [] {});
    const std::unique_ptr<detail::Store> store =
        detail::open_store(server.address(), {.ttl = std::chrono::seconds(60),
                                              .retry_interval = std::chrono::milliseconds(0),
                                              .health = health});
    detail::WriteBatch batch;
    batch.objects = {{"kvsnap:test:small", "fits"}};
    int code = store->write(batch, Clock::now() + std::chrono::seconds(5)).objects == 0 ? 0 : 10;
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // the server closes it
    batch.objects = {{"kvsnap:test:big", std::string(size_t(64) << 20, 'x')}};
    try {
      (void)store->write(batch, Clock::now() + std::chrono::seconds(10));
    } catch (const detail::StoreFailure&) {  // the connection was closed: expected
    }
    sigset_t pending;
    sigpending(&pending);
    if (sigismember(&pending, SIGPIPE) == 1) code = 11;  // left pending
    batch.objects = {{"kvsnap:test:after", "again"}};
    if (store->write(batch, Clock::now() + std::chrono::seconds(5)).objects != 0) code = 12;
    std::_Exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(WIFSIGNALED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "exit " << WEXITSTATUS(status);
  EXPECT_EQ(server.command({"GET", "kvsnap:test:after"}), "again");
}

TEST(TierRedis, AFullWriteQueueDropsBatchesInsteadOfWaiting) {
  RedisServer server;
  TierOptions options = tier_options();
  options.write_queue = 1;
  options.lookup_timeout = std::chrono::milliseconds(20);
  options.write_timeout = std::chrono::milliseconds(3000);  // what one write would wait
  TierProcess writer(server.address(), options);
  server.pause();
  const auto start = Clock::now();
  for (int32_t i = 0; i < 4; ++i) {
    (void)run_turn(writer.cache, writer.stack, talk.system + tokens(1000 + 10 * i, 5),
                   tokens(2000, 2));
  }
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(1500));
  EXPECT_GE(writer.tier->stats().dropped_batches, 2);
  server.resume();
}

TEST(TierRedis, AFlushedServerIsRefilledAndOutputsStayExact) {
  RedisServer server;
  TierProcess writer(server.address());
  (void)writer.turn(talk.first, talk.reply, talk.ends);
  (void)server.command({"FLUSHALL"});
  TierProcess reader(server.address());
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 0);
  // The writer notices its chunks are gone at its next lookup and writes them again.
  (void)writer.turn(talk.second, tokens(500, 3));
  TierProcess late(server.address());
  EXPECT_EQ(late.turn(talk.second + tokens(500, 3) + tokens(510, 2), tokens(520, 2)).cached,
            static_cast<int64_t>(talk.second.size()) + 2);
}

TEST(TierRedis, EvictionAtMaxmemoryOnlyShortensMatches) {
  RedisServer server({.password = "", .config = {"--maxmemory-policy", "allkeys-lru"}});
  const int64_t used = server.info("used_memory");
  (void)server.command({"CONFIG", "SET", "maxmemory", std::to_string(used + 600 * 1024)});
  std::vector<testing::Tokens> prompts;
  {
    TierProcess writer(server.address());
    for (int32_t c = 0; c < 60; ++c) {
      prompts.push_back(tokens(3000 + 200 * c, 120));
      (void)writer.turn(prompts.back(), tokens(9000, 3));
    }
  }
  EXPECT_GT(server.info("evicted_keys"), 0) << "the test needs the server to evict";
  // Redis's LRU clock ticks once a second, so which of these keys went is close to random; from
  // here on nothing is evicted, and one more conversation is certainly complete.
  (void)server.command({"CONFIG", "SET", "maxmemory", "0"});
  prompts.push_back(tokens(20000, 120));
  {
    TierProcess writer(server.address());
    (void)writer.turn(prompts.back(), tokens(9000, 3));
  }
  TierProcess reader(server.address());
  int64_t restored = 0, last = 0;  // every output is checked against recomputation (run_turn)
  for (const testing::Tokens& prompt : prompts) {
    last = reader.turn(prompt, tokens(9100, 2)).cached;
    restored += last;
  }
  EXPECT_EQ(last, 119);
  EXPECT_LT(restored, 61 * 119);  // evictions shortened matches
}

TEST(TierRedis, PasswordDatabaseAndTimeToLive) {
  RedisServer server({.password = "s3cret:pass", .config = {}});
  {
    TierProcess writer(server.address(3));
    (void)writer.turn(talk.first, talk.reply, talk.ends);
    EXPECT_EQ(writer.tier->address().find("s3cret"), std::string::npos);
  }
  EXPECT_EQ(server.command({"DBSIZE"}), "0");  // written to database 3
  TierProcess reader(server.address(3));
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 31);
  // Every key carries the TTL (a day by default).
  const std::string keys = server.command({"EVAL",
                                           "redis.call('SELECT', 3) local n = 0 for _, k in "
                                           "ipairs(redis.call('KEYS', 'kvsnap:*')) do local t = "
                                           "redis.call('TTL', k) if t <= 0 or t > 86400 then "
                                           "return -1 end n = n + 1 end return n",
                                           "0"});
  EXPECT_GT(std::stoll(keys), 5);
  TierProcess wrong("redis://:wrong@127.0.0.1:" + std::to_string(server.port()) + "/3");
  EXPECT_EQ(wrong.turn(talk.second, tokens(500, 3)).cached, 0);
  EXPECT_GE(wrong.log.count("AUTH refused"), 1) << wrong.log.all();
}

// A server that refuses every command (here no password where one is needed: NOAUTH) is a
// store that is unavailable, and the log says why — not a store where every key is missing and
// every write silently refused.
TEST(TierRedis, AServerThatRefusesEveryCommandIsUnavailableAndTheLogSaysWhy) {
  RedisServer server({.password = "s3cret", .config = {}});
  TierProcess process("redis://127.0.0.1:" + std::to_string(server.port()));
  for (int32_t turn = 0; turn < 4; ++turn) {  // each past the retry interval (20 ms)
    (void)process.turn(talk.first + tokens(600 + 10 * turn, 3), talk.reply);
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
  }
  // One outage, said once: not "answers again" and lost on every round trip.
  EXPECT_EQ(process.log.count("is unavailable"), 1) << process.log.all();
  EXPECT_GE(process.log.count("refused: NOAUTH"), 1) << process.log.all();
  EXPECT_EQ(process.log.count("answers again"), 0) << process.log.all();
  EXPECT_EQ(process.tier->stats().objects_written, 0);
  EXPECT_GE(process.tier->stats().store_errors, 1);
}

// A server out of memory with eviction off refuses writes but answers lookups: that is said
// once (not as the store coming and going), lookups go on, and writes resume when it takes them.
TEST(TierRedis, AServerThatRefusesOnlyWritesIsSaidOnceAndLookupsGoOn) {
  RedisServer server({.password = "", .config = {"--maxmemory-policy", "noeviction"}});
  {
    TierProcess writer(server.address());
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  const int64_t used = server.info("used_memory");
  (void)server.command({"CONFIG", "SET", "maxmemory", std::to_string(used + 1024)});
  TierProcess process(server.address());
  // The first turn's prefix can only come from the store (this process's trie is empty).
  EXPECT_GT(process.turn(talk.first + tokens(600, 40), talk.reply).cached, 0);
  for (int32_t turn = 1; turn < 3; ++turn) {
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    (void)process.turn(talk.first + tokens(600 + 10 * turn, 40), talk.reply);
  }
  EXPECT_EQ(process.log.count("refuses writes"), 1) << process.log.all();
  EXPECT_GE(process.log.count("OOM"), 1) << process.log.all();
  EXPECT_EQ(process.log.count("is unavailable"), 0) << process.log.all();
  EXPECT_GE(process.tier->stats().dropped_batches, 1);
  (void)server.command({"CONFIG", "SET", "maxmemory", "0"});
  (void)process.turn(talk.first + tokens(700, 40), talk.reply);
  EXPECT_EQ(process.log.count("takes writes again"), 1) << process.log.all();
  EXPECT_GT(process.tier->stats().objects_written, 0);
}

// A read-only replica (here a server made the replica of an unreachable one, which keeps
// serving what it holds) refuses GETEX and EXPIRE, which refresh lifetimes: lookups read with
// GET and EXISTS instead and still find what it holds, and the store is not unavailable.
TEST(TierRedis, AReadOnlyReplicaServesLookups) {
  RedisServer server;
  {
    TierProcess writer(server.address());
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  (void)server.command({"REPLICAOF", "127.0.0.1", "1"});
  TierProcess process(server.address());
  EXPECT_GT(process.turn(talk.first + tokens(600, 40), talk.reply).cached, 0) << process.log.all();
  std::this_thread::sleep_for(std::chrono::milliseconds(40));  // past the retry interval
  EXPECT_GT(process.turn(talk.first + tokens(700, 40), talk.reply).cached, 0) << process.log.all();
  EXPECT_EQ(process.log.count("is unavailable"), 0) << process.log.all();
  EXPECT_EQ(process.log.count("refuses writes"), 1) << process.log.all();
  EXPECT_EQ(process.log.count("READONLY"), 1) << process.log.all();
  EXPECT_EQ(process.tier->stats().objects_written, 0);
  // Writable again: past the retry interval, lookups refresh what they read again.
  (void)server.command({"REPLICAOF", "NO", "ONE"});
  const std::vector<std::string> chunks = server.keys("kvsnap:c:*");
  ASSERT_FALSE(chunks.empty());
  for (const std::string& key : chunks) (void)server.command({"EXPIRE", key, "1000"});
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  const int64_t limit = static_cast<int64_t>(talk.first.size()) - 1;
  EXPECT_GT(process.tier->lookup(talk.first, limit).offset, 0) << process.log.all();
  int64_t refreshed = 0;
  for (const std::string& key : chunks) {
    refreshed += std::stoll(server.command({"TTL", key})) > 1000 ? 1 : 0;
  }
  EXPECT_GT(refreshed, 0);
}

// A probe says how large each object is (STRLEN beside EXPIRE, in the same round trip): what a
// lookup plans its bytes with. Missing, and a key of another type (which GET would not hand
// back), read as -1.
TEST(TierRedis, AProbeSaysEachObjectsSize) {
  RedisServer server;
  auto health = std::make_shared<detail::StoreHealth>(
      server.address(), [](const std::string&) {}, [] {});
  const std::unique_ptr<detail::Store> store =
      detail::open_store(server.address(), {.ttl = std::chrono::seconds(60), .health = health});
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:c:a", std::string(100, 'a')}, {"kvsnap:c:b", std::string(70000, 'b')}};
  ASSERT_EQ(store->write(batch, Clock::now() + std::chrono::seconds(5)).objects, 0);
  (void)server.command({"SADD", "kvsnap:c:set", "member"});
  const std::vector<std::string> keys{"kvsnap:c:a", "kvsnap:c:none", "kvsnap:c:b", "kvsnap:c:set"};
  std::vector<std::vector<std::string>> members;
  std::vector<int64_t> sizes;
  store->probe({}, keys, Clock::now() + std::chrono::seconds(5), members, sizes);
  EXPECT_EQ(sizes, (std::vector<int64_t>{100, -1, 70000, -1}));
}

}  // namespace
}  // namespace kvsnap
