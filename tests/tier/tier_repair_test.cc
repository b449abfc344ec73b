// The shared tier repairs what the store lost or holds damaged, against a real redis-server: a
// flushed server is refilled by processes that already wrote its entries, index sets live as long
// as the points they name are used, an index set planted too large, or a key of another type in
// its place, is deleted and written again, and a store call with a state of the wrong kind is
// refused before anything is written or learned. (A damaged object deleted and written again:
// tier_store_test.cc, both backends.)
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "support/tier_support.h"

namespace kvsnap {
namespace {

using namespace kvsnap::testing;

// Prompts shorter than a chunk (the default 256 tokens) probe no chunk at lookup: only the
// writer's check of what it skips as known can notice a flush.
TEST(TierRepair, AFlushedServerIsRefilledByAProcessThatWroteItsEntriesBefore) {
  RedisServer server;
  TierOptions options = tier_options();
  options.chunk_tokens = 256;
  const Tokens system = tokens(100, 20);
  TierProcess writer(server.address(), options);
  (void)writer.turn(system + tokens(200, 7), tokens(300, 5), {20});
  (void)server.command({"FLUSHALL"});
  // The first session after the flush finds what it skipped gone; the next writes it again.
  for (int r = 0; r < 2; ++r) {
    (void)writer.turn(system + tokens(400 + 20 * r, 7), tokens(600 + 10 * r, 3), {20});
  }
  EXPECT_EQ(writer.log.count("the store lost objects this process wrote or read"), 1)
      << writer.log.all();
  TierProcess late(server.address(), options);
  EXPECT_EQ(late.turn(system + tokens(700, 5), tokens(750, 2)).cached, 20);
}

// A writer whose own trie covers its prompts never looks up, so never sees a missing chunk.
TEST(TierRepair, AFlushedServerIsRefilledByAWriterServedFromItsOwnTrie) {
  RedisServer server;
  Conversation talk;
  TierProcess writer(server.address());
  (void)writer.turn(talk.first, talk.reply, talk.ends);
  (void)server.command({"FLUSHALL"});
  for (int r = 0; r < 2; ++r) (void)writer.turn(talk.first, tokens(800 + 10 * r, 5));
  TierProcess late(server.address());
  EXPECT_EQ(late.turn(talk.system + tokens(720, 4), tokens(730, 2)).cached, 20)
      << "keys in redis: " << server.keys("kvsnap:*").size();
}

// Lookups refresh the lifetime of the index sets they read, as of the objects (GETEX).
TEST(TierRepair, IndexSetsInUseLiveAsLongAsTheirPoints) {
  RedisServer server;
  Conversation talk;
  TierOptions options = tier_options();
  options.ttl = std::chrono::seconds(2);
  {
    TierProcess writer(server.address(), options);
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  {
    TierProcess reader(server.address(), options);
    EXPECT_EQ(reader.turn(talk.system + tokens(720, 12), tokens(735, 2)).cached, 20);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // past the first 2 s
  TierProcess late(server.address(), options);
  EXPECT_EQ(late.turn(talk.system + tokens(760, 12), tokens(775, 2)).cached, 20)
      << "index sets: " << server.keys("kvsnap:i:*").size();
}

// Index sets planted by whoever can write the store: `plant` spoils every index set in `server`
// and returns them; `spoiled` tells whether one still is.
struct Planting {
  std::function<std::vector<std::string>(const RedisServer&)> plant;
  std::function<bool(const RedisServer&, const std::string&)> spoiled;
};

// 70000 members added to every set (more than any tier writes, as whoever can SADD can).
Planting too_large() {
  return {[](const RedisServer& server) {
            const std::vector<std::string> sets = server.keys("kvsnap:i:*");
            EXPECT_FALSE(sets.empty());
            for (const std::string& set : sets) {
              for (int batch = 0; batch < 70; ++batch) {
                std::vector<std::string> sadd{"SADD", set};
                for (int m = 0; m < 1000; ++m)
                  sadd.push_back(fmt::format("planted-{}-{}", batch, m));
                (void)server.command(sadd);
              }
            }
            return sets;
          },
          [](const RedisServer& server, const std::string& set) {
            return std::stoll(server.command({"SCARD", set})) > 70000;
          }};
}

// More members added to every set than a chunk of 8 tokens (tier_options) takes, 16 per offset
// (one point per offset and object size) — a probe over many chunks of such sets would
// hold megabytes each under the ceiling of any chunk size (65536 members).
Planting past_the_chunk() {
  return {[](const RedisServer& server) {
            const std::vector<std::string> sets = server.keys("kvsnap:i:*");
            EXPECT_FALSE(sets.empty());
            EXPECT_EQ(tier_options().chunk_tokens, 8);
            for (const std::string& set : sets) {
              std::vector<std::string> sadd{"SADD", set};
              for (int m = 0; m < 16 * 8 + 1; ++m) sadd.push_back(fmt::format("{}:1000", 500 + m));
              (void)server.command(sadd);
            }
            return sets;
          },
          [](const RedisServer& server, const std::string& set) {
            return std::stoll(server.command({"SCARD", set})) > 16 * 8;
          }};
}

// Every set replaced by a string: SADD cannot add to it (WRONGTYPE), and SMEMBERS lists nothing.
Planting not_a_set() {
  return {[](const RedisServer& server) {
            const std::vector<std::string> sets = server.keys("kvsnap:i:*");
            EXPECT_FALSE(sets.empty());
            for (const std::string& set : sets) (void)server.command({"SET", set, "planted"});
            return sets;
          },
          [](const RedisServer& server, const std::string& set) {
            return server.command({"TYPE", set}) == "string";
          }};
}

// The lookup that meets a planted set misses, and the set is deleted and written again with the
// points its process evaluated — instead of failing, and reconnecting, every lookup over that
// chunk from then on (too large), or missing them silently forever (not a set: each write's
// SADD refused, its EXPIRE keeping the planted key alive).
void check_a_lookup_repairs(const Planting& planting) {
  RedisServer server;
  Conversation talk;
  {
    TierProcess writer(server.address());
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  const std::vector<std::string> sets = planting.plant(server);
  // The system prompt's set goes; the other (the first conversation's own chunk) is not met.
  TierProcess reader(server.address());
  EXPECT_EQ(reader.turn(talk.system + tokens(720, 12), tokens(735, 2), talk.ends).cached, 0);
  EXPECT_EQ(reader.tier->stats().rejected, 1);
  EXPECT_EQ(reader.tier->stats().store_errors, 0);
  EXPECT_EQ(reader.log.count("rejected kvsnap:i:"), 1) << reader.log.all();
  EXPECT_EQ(reader.log.count("store lost"), 0) << reader.log.all();
  size_t planted = 0;
  for (const std::string& set : sets) planted += planting.spoiled(server, set) ? 1 : 0;
  EXPECT_EQ(planted, sets.size() - 1);
  TierProcess late(server.address());
  EXPECT_EQ(late.turn(talk.system + tokens(760, 12), tokens(775, 2)).cached, 20) << late.log.all();
  EXPECT_EQ(late.tier->stats().rejected, 0);
}

TEST(TierRepair, AnIndexPlantedTooLargeIsDeletedAndWrittenAgain) {
  check_a_lookup_repairs(too_large());
}

TEST(TierRepair, AnIndexListingMorePointsThanItsChunkHasIsDeletedAndWrittenAgain) {
  check_a_lookup_repairs(past_the_chunk());
}

TEST(TierRepair, AnIndexThatIsNotASetIsDeletedAndWrittenAgain) {
  check_a_lookup_repairs(not_a_set());
}

// The writer's check of what it skips as known meets the planted set: that set is deleted and
// the process, knowing nothing any more, writes its points again.
void check_the_writer_repairs(const Planting& planting) {
  RedisServer server;
  Conversation talk;
  TierProcess writer(server.address());
  (void)writer.turn(talk.first, talk.reply, talk.ends);
  (void)planting.plant(server);
  for (int r = 0; r < 2; ++r) (void)writer.turn(talk.first, tokens(800 + 10 * r, 5));
  EXPECT_EQ(writer.log.count("rejected kvsnap:i:"), 1) << writer.log.all();
  EXPECT_EQ(writer.log.count("store lost"), 0) << writer.log.all();
  EXPECT_EQ(writer.tier->stats().store_errors, 0);
  TierProcess late(server.address());
  EXPECT_EQ(late.turn(talk.system + tokens(720, 4), tokens(730, 2)).cached, 20) << late.log.all();
}

TEST(TierRepair, AnIndexPlantedTooLargeIsRepairedByTheWriterThatSkipsItsPoints) {
  check_the_writer_repairs(too_large());
}

TEST(TierRepair, AnIndexThatIsNotASetIsRepairedByTheWriterThatSkipsItsPoints) {
  check_the_writer_repairs(not_a_set());
}

TEST(TierRepair, AStoreWithAStateOfTheWrongKindIsRefusedAndTeachesNothing) {
  RedisServer server;
  Conversation talk;
  {
    TierProcess writer(server.address());
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  TierProcess process(server.address());
  HybridStack scratch;
  const Tokens other = tokens(5000, 12);
  ASSERT_TRUE(scratch.forward_and_check(other, other));
  const SnapshotPtr kv = scratch.attention().snapshot(0, 0);
  const SnapshotPtr window = scratch.window.snapshot(0, 0);
  const std::vector<const Snapshot*> ranges{kv.get(), nullptr, nullptr, nullptr};
  // Layer 3 (recurrent) handed the attention layer's KV snapshot.
  const TierPoint wrong{12, {nullptr, window.get(), nullptr, kv.get()}};
  try {
    process.tier->store(other, ranges, std::span(&wrong, 1));
    ADD_FAILURE() << "a KV snapshot as the recurrent layer's state was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "Tier::store: layer 3 at offset 12: a KV snapshot, where the layer takes "
                 "recurrent ones");
  }
  EXPECT_TRUE(process.tier->flush());
  EXPECT_EQ(process.tier->stats().objects_written, 0);
  // What another process wrote still fits this one's layers.
  EXPECT_EQ(process.turn(talk.system + tokens(720, 4), tokens(730, 2)).cached, 20);
  EXPECT_EQ(process.tier->stats().rejected, 0);
}

// Two points of one call whose window states have different shapes (a head less): with nothing
// learned yet, the first point's shapes are the reference and the call is refused whole — not
// both written, for every reader to reject one of them.
TEST(TierRepair, AStoreWhosePointsDisagreeOnTheirShapesIsRefusedWhole) {
  RedisServer server;
  TierProcess process(server.address());
  const Tokens other = tokens(5000, 12);
  HybridStack whole, part;
  ASSERT_TRUE(whole.forward_and_check(other, other));
  const Tokens first(other.begin(), other.begin() + 10);
  ASSERT_TRUE(part.forward_and_check(first, first));
  RotatingKVCache narrow(HybridStack::kWindow);
  const TokenKV one_head{.heads = 1, .depth = 4};
  std::vector<int64_t> ids(10);
  for (int64_t i = 0; i < 10; ++i) ids[static_cast<size_t>(i)] = i;
  (void)narrow.update(Batch::rows({{0, 0, std::vector<int32_t>(10, 1)}}), one_head.keys(ids),
                      one_head.values(ids));
  const SnapshotPtr kv = whole.attention().snapshot(0, 0);
  const SnapshotPtr window = whole.window.snapshot(0, 0),
                    recurrent = whole.recurrent.snapshot(0, 0);
  const SnapshotPtr narrow_window = narrow.snapshot(0, 0);
  const SnapshotPtr recurrent_at_10 = part.recurrent.snapshot(0, 0);
  const std::vector<const Snapshot*> ranges{kv.get(), nullptr, nullptr, nullptr};
  const TierPoint points[] = {{12, {nullptr, window.get(), nullptr, recurrent.get()}},
                              {10, {nullptr, narrow_window.get(), nullptr, recurrent_at_10.get()}}};
  try {
    process.tier->store(other, ranges, points);
    ADD_FAILURE() << "points of two window shapes were both accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::StartsWith("Tier::store: layer 1 at offset 10: a snapshot of"))
        << e.what();
  }
  EXPECT_TRUE(process.tier->flush());
  EXPECT_EQ(process.tier->stats().objects_written, 0);
}

}  // namespace
}  // namespace kvsnap
