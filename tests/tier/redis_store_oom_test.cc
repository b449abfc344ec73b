// A Redis connection whose AUTH or SELECT did not complete is never kept, nor one holding half a
// round trip's commands: every allocation of a first write on a new connection fails in turn,
// and the write after it still lands in the address's database, as its user.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "support/failing_allocation.h"
#include "support/redis_server.h"
#include "tier/store.h"

namespace kvsnap::redis_store_oom_test {
namespace {

TEST(RedisStoreOom, AConnectionWhoseSetupRanOutIsNotKept) {
  const testing::RedisServer server({.password = "s3cret", .config = {}});
  const auto deadline = [] { return std::chrono::steady_clock::now() + std::chrono::seconds(5); };
  const auto in_database = [&](int database, const std::string& key) {
    return server.command({"EVAL",
                           "redis.call('SELECT', ARGV[1]) return redis.call('EXISTS', KEYS[1])",
                           "1", key, std::to_string(database)});
  };
  int64_t setups_failed = 0;
  const int64_t runs = testing::sweep([&] {
    (void)server.command({"FLUSHALL"});
    const auto health = std::make_shared<detail::StoreHealth>(
        "store", [](const std::string&) {}, [] {});
    const std::unique_ptr<detail::Store> store =
        detail::open_store(server.address(2), {.ttl = std::chrono::seconds(60), .health = health});
    detail::WriteBatch first, second;
    first.doomed = {"kvsnap:test:gone"};  // DEL, then SET: commands of two lengths queued
    first.objects = {{"kvsnap:test:first", "one"}};
    second.objects = {{"kvsnap:test:second", "two"}};
    if (!testing::armed_call([&] { (void)store->write(first, deadline()); })) ++setups_failed;
    testing::disarm();
    (void)store->write(second, deadline());  // on the connection the first left, if any
    EXPECT_EQ(in_database(2, "kvsnap:test:second"), "1");
    EXPECT_EQ(in_database(0, "kvsnap:test:second"), "0");
  });
  EXPECT_GT(runs, 1);
  EXPECT_GT(setups_failed, 0);
}

}  // namespace
}  // namespace kvsnap::redis_store_oom_test
