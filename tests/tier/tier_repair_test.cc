// The shared tier repairs what the store lost or holds damaged, against a real redis-server: a
// flushed server is refilled by processes that already wrote its entries, index sets live as long
// as the points they name are used, and a store call with a state of the wrong kind is refused
// before anything is written or learned. (A damaged object deleted and written again:
// tier_store_test.cc, both backends.)
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

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

}  // namespace
}  // namespace kvsnap
