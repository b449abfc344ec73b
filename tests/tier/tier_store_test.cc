// What a tier does over either backend (a folder, a real redis-server): another process restores
// what one stored, chunks are shared, a restore point needs every layer, damaged and foreign
// objects are rejected and counted, and outputs always equal recomputation (run_turn).
#include <gtest/gtest.h>

#include "support/tier_support.h"

namespace kvsnap {
namespace {

using testing::Conversation;
using testing::ObjectNames;
using testing::tier_options;
using testing::TierProcess;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

class TierStore : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    store = testing::make_store(GetParam(),
                                ::testing::UnitTest::GetInstance()->current_test_info()->name());
    names = std::make_unique<ObjectNames>(tier_options(), store->address());
  }
  // A process that runs the conversation's first turn, so the store holds points 20, 26, 31.
  void store_first_turn() {
    TierProcess writer(store->address());
    EXPECT_EQ(writer.turn(talk.first, talk.reply, talk.ends).cached, 0);
  }
  std::unique_ptr<testing::TestStore> store;
  Conversation talk;
  std::unique_ptr<ObjectNames> names;  // of the store's objects
};

TEST_P(TierStore, AnotherProcessContinuesWhereOneStopped) {
  store_first_turn();
  TierProcess next(store->address());
  EXPECT_EQ(next.turn(talk.second, tokens(500, 3)).cached, 31);  // what the reply evaluated
  TierProcess again(store->address());
  EXPECT_EQ(again.turn(talk.first, tokens(600, 2)).cached, 26);  // a regeneration: all but one
  const TierStats stats = next.tier->stats();
  EXPECT_EQ(stats.hits, 1);
  EXPECT_EQ(stats.restored_tokens, 31);
  EXPECT_GT(stats.bytes_read, 0);
  EXPECT_EQ(stats.rejected, 0);
  // A caller that holds 26 tokens already: a point past it adds what lies between.
  const TierMatch more = next.tier->lookup(talk.second, 40, 26);
  EXPECT_GT(more.offset, 26);
  EXPECT_EQ(next.tier->stats().restored_tokens, 31 + (more.offset - 26));
}

TEST_P(TierStore, ChunksAreStoredOnceForEveryPromptThatSharesThem) {
  store_first_turn();
  // 31 tokens evaluated: chunks [0, 8), [8, 16), [16, 24).
  EXPECT_EQ(store->keys("kvsnap:c:").size(), 3u);
  TierProcess other(store->address());
  // Another user message on the same system prompt: [16, 24) differs (tokens 20..23 are new).
  (void)other.turn(talk.system + tokens(700, 7), talk.reply);
  EXPECT_EQ(store->keys("kvsnap:c:").size(), 4u);
}

TEST_P(TierStore, ARestorePointCountsOnlyWithEveryLayerAtThatOffset) {
  store_first_turn();
  store->remove(names->point(talk.second, 31));  // the window and recurrent states at 31
  TierProcess without_31(store->address());
  EXPECT_EQ(without_31.turn(talk.second, tokens(500, 3)).cached, 26);
  store->remove(names->chunk(talk.second, 2));  // KV of [16, 24): points 26 and 31 need it
  TierProcess without_chunk(store->address());
  EXPECT_EQ(without_chunk.turn(talk.second, tokens(500, 3)).cached, 20);
  EXPECT_EQ(without_chunk.tier->stats().rejected, 0);  // missing is not damaged
}

TEST_P(TierStore, DamagedObjectsAreRejectedCountedAndLoggedNeverRestored) {
  store_first_turn();
  const std::string point = names->point(talk.second, 31);
  std::string bytes = store->get(point);
  bytes[bytes.size() / 2] ^= 0x01;  // one flipped bit in the data
  store->set(point, bytes);
  TierProcess flipped(store->address());
  EXPECT_EQ(flipped.turn(talk.second, tokens(500, 3)).cached, 26);
  EXPECT_EQ(flipped.tier->stats().rejected, 1);
  EXPECT_EQ(flipped.log.count("rejected " + point), 1) << flipped.log.all();
  EXPECT_EQ(flipped.log.count("checksum"), 1) << flipped.log.all();

  const std::string chunk = names->chunk(talk.second, 2);
  const std::string whole = store->get(chunk);
  store->set(chunk, whole.substr(0, whole.size() - 5));  // truncated
  TierProcess truncated(store->address());
  EXPECT_EQ(truncated.turn(talk.second, tokens(500, 3)).cached, 20);
  EXPECT_GE(truncated.tier->stats().rejected, 1);
  EXPECT_GE(truncated.log.count("rejected " + chunk), 1) << truncated.log.all();
}

// The process that rejects an object deletes it; the process that wrote it finds it gone at its
// next session and writes it whole at the one after.
TEST_P(TierStore, ADamagedObjectIsDeletedByItsReaderAndWrittenAgainByItsWriter) {
  TierProcess writer(store->address());
  (void)writer.turn(talk.first, talk.reply, talk.ends);
  const std::string point = names->point(talk.first, 20);
  std::string bytes = store->get(point);
  bytes[bytes.size() / 2] ^= 0x01;
  store->set(point, bytes);
  {
    TierProcess reader(store->address());
    EXPECT_EQ(reader.turn(talk.system + tokens(720, 12), tokens(735, 2)).cached, 0);
    EXPECT_EQ(reader.tier->stats().rejected, 1);
  }
  const std::vector<std::string> points = store->keys("kvsnap:p:");
  EXPECT_EQ(std::count(points.begin(), points.end(), point), 0) << "the reader deletes it";
  for (int32_t r = 0; r < 2; ++r) {
    (void)writer.turn(talk.system + tokens(1000 + 40 * r, 12), tokens(1015 + 40 * r, 2), {20});
  }
  EXPECT_EQ(writer.log.count("the store lost objects this process wrote or read"), 1)
      << writer.log.all();
  TierProcess late(store->address());
  EXPECT_EQ(late.turn(talk.system + tokens(2000, 12), tokens(2015, 2)).cached, 20);
  EXPECT_EQ(late.tier->stats().rejected, 0);
}

TEST_P(TierStore, ObjectsOfAnotherVersionAreRejected) {
  store_first_turn();
  const std::string point = names->point(talk.second, 31);
  std::string bytes = store->get(point);
  const size_t at = bytes.find("\"version\":\"1\"");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 11] = '9';  // a later format, same length
  store->set(point, bytes);
  TierProcess reader(store->address());
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 26);
  EXPECT_EQ(reader.log.count("version \"9\""), 1) << reader.log.all();
}

TEST_P(TierStore, AnotherTenantOrModelNeverHits) {
  store_first_turn();
  TierProcess tenant(store->address(), tier_options("another tenant"));
  EXPECT_EQ(tenant.turn(talk.second, tokens(500, 3)).cached, 0);
  TierOptions model = tier_options();
  model.model_fingerprint = "another model";
  TierProcess other_model(store->address(), model);
  EXPECT_EQ(other_model.turn(talk.second, tokens(500, 3)).cached, 0);
  TierOptions chunks = tier_options();
  chunks.chunk_tokens = 4;
  TierProcess other_chunks(store->address(), chunks);
  EXPECT_EQ(other_chunks.turn(talk.second, tokens(500, 3)).cached, 0);
  EXPECT_EQ(tenant.tier->stats().rejected + other_model.tier->stats().rejected, 0);
}

TEST_P(TierStore, ObjectsCopiedFromAnotherModelAreRejected) {
  TierOptions model = tier_options();
  model.model_fingerprint = "another model";
  {
    TierProcess writer(store->address(), model);
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  store_first_turn();
  // Its objects over this model's (a confused or malicious writer of the store).
  const ObjectNames theirs(model, store->address());
  store->set(names->point(talk.second, 31), store->get(theirs.point(talk.second, 31)));
  for (int64_t j = 0; j < 3; ++j) {
    store->set(names->chunk(talk.second, j), store->get(theirs.chunk(talk.second, j)));
  }
  TierProcess reader(store->address());
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 0);
  EXPECT_GE(reader.tier->stats().rejected, 1);
  EXPECT_GE(reader.log.count("another model, layer layout, tenant or key"), 1) << reader.log.all();
}

TEST_P(TierStore, TheTrieIsAskedFirstAndTheTierOnlyBeyondIt) {
  store_first_turn();
  TierProcess reader(store->address());
  (void)reader.turn(talk.system + tokens(800, 3), tokens(900, 2));  // the system prompt: a hit
  EXPECT_EQ(reader.tier->stats().hits, 1);
  // The same process continues the stored conversation: its trie holds [0, 20), the tier the
  // rest; chunks before 20 are not fetched again.
  const int64_t read = reader.tier->stats().bytes_read;
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 31);
  const int64_t chunk_bytes = static_cast<int64_t>(store->get(names->chunk(talk.second, 0)).size());
  const int64_t point_bytes =
      static_cast<int64_t>(store->get(names->point(talk.second, 31)).size());
  EXPECT_LE(reader.tier->stats().bytes_read - read, point_bytes + 2 * chunk_bytes);
  // A prompt the trie restores fully (a regeneration) does not ask the tier.
  const int64_t lookups = reader.tier->stats().lookups;
  (void)reader.turn(talk.second, tokens(500, 3));
  EXPECT_EQ(reader.tier->stats().lookups, lookups);
}

// An object larger than max_object_bytes (a store's limit: Redis closes the connection on a
// value past its proto-max-bulk-len) is not written: the session's other objects still are
// (those before a chunk too large), said once, counted as store errors.
TEST_P(TierStore, ObjectsOverMaxObjectBytesAreNotWritten) {
  store_first_turn();
  size_t largest_chunk = 0, largest = 0, smallest_chunk = SIZE_MAX;
  for (const std::string& key : store->keys("kvsnap:")) {
    if (key.starts_with("kvsnap:i:")) continue;  // index sets
    const size_t size = store->get(key).size();
    largest = std::max(largest, size);
    if (key.starts_with("kvsnap:c:")) {
      largest_chunk = std::max(largest_chunk, size);
      smallest_chunk = std::min(smallest_chunk, size);
    }
  }
  ASSERT_GT(largest_chunk, 0u);
  ASSERT_GT(largest, largest_chunk);  // a restore point's object is larger than any chunk
  const auto run = [&](int64_t max_object_bytes, const std::string& key = "") {
    auto other = testing::make_store(
        GetParam(), "max_" + std::to_string(max_object_bytes) + (key.empty() ? "" : "_keyed"));
    TierOptions limited = tier_options("", key);
    limited.max_object_bytes = max_object_bytes;
    TierProcess writer(other->address(), limited);
    (void)writer.turn(talk.first, talk.reply, talk.ends);
    size_t biggest = 0;
    for (const std::string& key : other->keys("kvsnap:")) {
      if (!key.starts_with("kvsnap:i:")) biggest = std::max(biggest, other->get(key).size());
    }
    EXPECT_LE(biggest, static_cast<size_t>(max_object_bytes));
    const TierStats stats = writer.tier->stats();
    const size_t tag = key.empty() ? 0 : 32;  // an authenticated tier's MAC, appended
    const bool all = static_cast<size_t>(max_object_bytes) >= largest + tag;
    EXPECT_EQ(stats.store_errors > 0, !all) << max_object_bytes;
    EXPECT_EQ(writer.log.count("are not written (max_object_bytes"), all ? 0 : 1)
        << writer.log.all();
    return std::pair(stats.objects_written, other->keys("kvsnap:c:").size());
  };
  const auto [everything, chunks] = run(static_cast<int64_t>(largest));
  const auto [fewer, same_chunks] = run(static_cast<int64_t>(largest) - 1);  // chunks fit
  EXPECT_LT(fewer, everything);
  EXPECT_EQ(same_chunks, chunks);  // only restore points were too large
  const auto [none, no_chunks] = run(static_cast<int64_t>(smallest_chunk) - 1);
  EXPECT_EQ(none, 0);
  EXPECT_EQ(no_chunks, 0u);
  // With a key every object goes out 32 bytes longer: the limit counts them (the largest object
  // went out over it).
  const std::string key = "0123456789abcdef0123456789abcdef";
  EXPECT_LT(run(static_cast<int64_t>(largest), key).first, everything);
  EXPECT_EQ(run(static_cast<int64_t>(largest) + 32, key).first, everything);
}

// A lookup holds at most max_lookup_bytes of objects (or its caller's budget: a prefix cache's),
// counted as the store sends them: a restore point that needs more is passed over for a
// shallower one that fits — said once, counted as a store error — never read whole first.
TEST_P(TierStore, ALookupHoldsAtMostMaxLookupBytes) {
  store_first_turn();
  const auto size = [&](const std::string& key) {
    return static_cast<int64_t>(store->get(key).size());
  };
  const int64_t chunks = size(names->chunk(talk.second, 0)) + size(names->chunk(talk.second, 1));
  const int64_t for_20 = chunks + size(names->point(talk.second, 20));  // [0, 16) and [16, 20)
  const int64_t for_26 =
      chunks + size(names->chunk(talk.second, 2)) + size(names->point(talk.second, 26));
  const int64_t for_31 =
      for_26 - size(names->point(talk.second, 26)) + size(names->point(talk.second, 31));
  ASSERT_LT(for_20, for_26);
  ASSERT_LT(for_26, for_31);
  // The tier's bound, and the call's.
  for (const bool tiers : {true, false}) {
    TierOptions options = tier_options();
    int64_t errors = 0;
    for (const auto& [bytes, offset] : std::vector<std::pair<int64_t, int64_t>>{
             {for_31, 31}, {for_31 - 1, 26}, {for_26 - 1, 20}, {for_20, 20}, {for_20 - 1, 0}}) {
      if (tiers) options.max_lookup_bytes = bytes;
      TierProcess reader(store->address(), options);
      const int64_t call = tiers ? int64_t(1) << 40 : bytes;
      EXPECT_EQ(reader.tier->lookup(talk.second, 37, 0, call).offset, offset) << bytes;
      const TierStats stats = reader.tier->stats();
      EXPECT_LE(stats.bytes_read, bytes);
      EXPECT_EQ(stats.store_errors, offset == 31 ? 0 : 1) << bytes;  // once for the lookup
      EXPECT_EQ(reader.log.count("a lookup may hold (max_lookup_bytes"), offset == 31 ? 0 : 1)
          << reader.log.all();
      errors += stats.store_errors;
      (void)reader.tier->lookup(talk.second, 37, 0, call);
      EXPECT_EQ(reader.tier->stats().store_errors, 2 * stats.store_errors);
      EXPECT_LE(reader.log.count("max_lookup_bytes"), 1) << reader.log.all();  // said once
    }
    EXPECT_EQ(errors, 4);
  }
  // A prefix cache passes its budget: more would be evicted as it is inserted.
  {
    TierProcess reader(store->address(), tier_options(), /*budget=*/for_31 - 1);
    EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 26);
  }
  // Points whose objects are gone: the chunks the deepest one fetched that the next does not
  // need are let go of, so the next has the bytes they took.
  store->remove(names->point(talk.second, 31));
  store->remove(names->point(talk.second, 26));
  {
    TierProcess reader(store->address());
    EXPECT_EQ(reader.tier->lookup(talk.second, 37, 0, for_20).offset, 20);
    EXPECT_EQ(reader.tier->lookup(talk.second, 37, 0, 0).offset, 0);  // nothing to hold: not asked
    EXPECT_EQ(reader.tier->stats().lookups, 1);
  }
}

// The probe says how large the chunks are: a point whose chunks alone would pass the bytes a
// lookup may hold is never fetched — on Redis, no reply is cut off mid-way, so the connection
// stays open for the next lookup (before, each such lookup read up to the bound, dropped the
// connection and made the next one connect again).
TEST_P(TierStore, ChunksThatCannotFitAreNeverFetched) {
  store_first_turn();
  const int64_t chunks = static_cast<int64_t>(store->get(names->chunk(talk.second, 0)).size() +
                                              store->get(names->chunk(talk.second, 1)).size());
  auto* redis = dynamic_cast<testing::RedisStore*>(store.get());
  const auto connections = [&] {
    return redis != nullptr ? redis->server.info("total_connections_received") : 0;
  };
  TierProcess reader(store->address());
  EXPECT_EQ(reader.tier->lookup(talk.second, 37, 0, int64_t{1} << 40).offset, 31);  // connected
  const TierStats first = reader.tier->stats();
  const int64_t before = connections();
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(reader.tier->lookup(talk.second, 37, 0, chunks - 1).offset, 0);
  EXPECT_EQ(connections() - before, redis != nullptr ? 1 : 0);  // the count's own
  const TierStats stats = reader.tier->stats();
  EXPECT_EQ(stats.bytes_read, first.bytes_read);
  EXPECT_EQ(stats.store_errors, first.store_errors + 3);  // once a lookup
  EXPECT_EQ(reader.log.count("a lookup may hold (max_lookup_bytes"), 1) << reader.log.all();
  // The chunks fit, the point objects not: their index members say so, nothing is fetched.
  EXPECT_EQ(reader.tier->lookup(talk.second, 37, 0, chunks).offset, 0);
  EXPECT_EQ(reader.tier->stats().store_errors, first.store_errors + 4);
  EXPECT_EQ(reader.tier->stats().bytes_read, first.bytes_read);
  EXPECT_EQ(connections() - before, redis != nullptr ? 2 : 0);
}

// Each index member says its restore point's offset and the size of its object as stored, MAC
// tag included ("31:4096"): a point whose object cannot fit is passed over before it is fetched
// (on Redis no reply is cut off, so no lookup connects again). Members without a size, as earlier
// versions wrote them, still restore within the bytes; a planted member saying more does not hide
// a point, and one saying less is caught as the bytes arrive.
TEST_P(TierStore, IndexMembersSayTheirPointsSizes) {
  for (const std::string key : {"", "0123456789abcdef0123456789abcdef"}) {
    auto own = testing::make_store(GetParam(), "sizes" + std::to_string(key.size()));
    const ObjectNames named(tier_options("", key), own->address());
    TierProcess(own->address(), tier_options("", key)).turn(talk.first, talk.reply, talk.ends);
    const auto member = [&](int64_t t) {
      return std::to_string(t) + ":" + std::to_string(own->get(named.point(talk.second, t)).size());
    };
    EXPECT_EQ(own->members(named.index(talk.second, 2)), std::vector<std::string>{member(20)});
    EXPECT_EQ(own->members(named.index(talk.second, 3)),
              (std::vector<std::string>{member(26), member(31)}));
  }
  store_first_turn();
  const auto size = [&](const std::string& key) {
    return static_cast<int64_t>(store->get(key).size());
  };
  const int64_t for_26 = size(names->chunk(talk.second, 0)) + size(names->chunk(talk.second, 1)) +
                         size(names->chunk(talk.second, 2)) + size(names->point(talk.second, 26));
  const int64_t for_31 =
      for_26 - size(names->point(talk.second, 26)) + size(names->point(talk.second, 31));
  const std::string index = names->index(talk.second, 3);
  const std::vector<std::string> sized = store->members(index);
  auto* redis = dynamic_cast<testing::RedisStore*>(store.get());
  const auto connections = [&] {
    return redis != nullptr ? redis->server.info("total_connections_received") : 0;
  };
  // What a reader finds with the bytes of point 31, one less, and point 31's again (each within
  // its bytes), then the connections the last two lookups made (and the count its own).
  const auto lookups = [&](const std::vector<std::string>& members) {
    store->set_members(index, members);
    TierProcess reader(store->address());
    std::vector<int64_t> found;
    int64_t before = 0;
    for (const int64_t bytes : {for_31, for_31 - 1, for_31}) {
      if (found.size() == 1) before = connections();
      const int64_t read = reader.tier->stats().bytes_read;
      found.push_back(reader.tier->lookup(talk.second, 37, 0, bytes).offset);
      EXPECT_LE(reader.tier->stats().bytes_read - read, bytes);
    }
    found.push_back(connections() - before);
    return found;
  };
  // On Redis, the count's own connection, and one more after a reply cut off.
  const int64_t count = redis != nullptr ? 1 : 0, cut_off = count + count;
  EXPECT_EQ(lookups(sized), (std::vector<int64_t>{31, 26, 31, count}));
  EXPECT_EQ(lookups({"26", "31"}), (std::vector<int64_t>{31, 26, 31, cut_off}));
  EXPECT_EQ(lookups({sized[0], sized[1], "31:" + std::to_string(int64_t{1} << 60)}),
            (std::vector<int64_t>{31, 26, 31, count}));
  EXPECT_EQ(lookups({sized[0], "31:1"}), (std::vector<int64_t>{31, 26, 31, cut_off}));
  // A bare member beside a sized one (an earlier version wrote the point, this one again): the
  // size counts.
  EXPECT_EQ(lookups({sized[0], sized[1], "26", "31"}), (std::vector<int64_t>{31, 26, 31, count}));
}

// A prefix cache restoring from the tier inserts what it found one segment at a time, evicting
// after each: its trie passes the budget by one segment at most (the restore point's object, the
// largest), not by all the chunks and the point at once (as it did: 83672 bytes held at the peak,
// against this bound of 75888).
TEST_P(TierStore, ARestoreFromTheTierPassesTheBudgetByOneSegmentAtMost) {
  const Tokens prompt = tokens(100, 165);  // 20 chunks of 8 tokens, and a point at 164
  TierProcess(store->address()).turn(prompt, tokens(300, 2), {160});
  const int64_t point = static_cast<int64_t>(store->get(names->point(prompt, 164)).size());
  // Prompts of their own (the tier's misses) fill a trie: as full as a budget of what they leave
  // in a roomy one lets them.
  const auto fill = [&](TierProcess& process) {
    for (int i = 0; i < 24; ++i) (void)process.turn(tokens(3000 + 100 * i, 30), tokens(9000, 2));
    return process.cache.paged_out_bytes();
  };
  TierProcess roomy(store->address());
  const int64_t budget = fill(roomy);
  TierProcess reader(store->address(), tier_options(), budget);
  EXPECT_LE(fill(reader), budget);
  reader.cache.reset_peak_paged_out_bytes();
  {
    PrefixCache::Session session = reader.cache.begin(prompt + tokens(400, 3));
    EXPECT_EQ(session.cached(), 164);
  }
  EXPECT_LE(reader.cache.peak_paged_out_bytes(), budget + point);
  EXPECT_LE(reader.cache.paged_out_bytes(), budget);
}

// A tier over layers that hold no KV ranges (a window and a recurrent layer): every restore point
// is one object, and there are no chunks to probe or to fit the bytes. Another process finds the
// deepest point within its limits.
TEST_P(TierStore, ATierOverWholeStateLayersOnlyFindsItsPoints) {
  testing::HybridStack stack;
  const Tokens prompt = tokens(1, 37);
  std::vector<SnapshotPtr> states;
  std::vector<TierPoint> points;
  for (int64_t from = 0; const int64_t end : {10, 20, 30}) {
    ASSERT_TRUE(stack.forward_and_check(std::span(prompt).subspan(from, end - from),
                                        Tokens(prompt.begin(), prompt.begin() + end)));
    states.push_back(stack.window.snapshot(0, 0));
    states.push_back(stack.recurrent.snapshot(0, 0));
    points.push_back({end, {states[states.size() - 2].get(), states.back().get()}});
    from = end;
  }
  TierOptions options = tier_options();
  options.log = [](const std::string&) {};  // trusted-store mode, said by each
  {
    const std::shared_ptr<Tier> writer =
        Tier::open(store->address(), {&stack.window, &stack.recurrent}, options);
    writer->store(prompt, std::vector<const Snapshot*>(2), points);
    ASSERT_TRUE(writer->flush());
  }
  testing::HybridStack other;
  const std::shared_ptr<Tier> reader =
      Tier::open(store->address(), {&other.window, &other.recurrent}, options);
  EXPECT_EQ(reader->lookup(prompt, 37).offset, 30);
  EXPECT_EQ(reader->lookup(prompt, 25).offset, 20);
  EXPECT_EQ(reader->lookup(prompt, 37, 20).offset, 30);
  EXPECT_EQ(reader->lookup(prompt, 37, 30).offset, 0);
  EXPECT_EQ(reader->lookup(prompt, 37, 0, 1).offset, 0);  // no point object fits one byte
  EXPECT_EQ(reader->stats().rejected, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, TierStore, ::testing::Values("dir", "redis"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kvsnap
