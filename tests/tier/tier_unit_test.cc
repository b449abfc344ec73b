// The tier's parts: addresses, key names, the contract of Tier::open / store and its place
// under a PrefixCache.
#include <gtest/gtest.h>
#include <kvsnap/speculation.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "persist/safetensors.h"
#include "support/cache_support.h"
#include "support/delegating_cache.h"
#include "support/loopback.h"
#include "support/tier_support.h"
#include "tier/object.h"
#include "tier/redis_store.h"
#include "tier/store.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::id_range;
using testing::throws_error;
using testing::tier_options;
using testing::TokenKV;
using testing::tokens;
using testing::operator+;
using testing::kNoLimit;

TEST(TierAddress, RedisAddressesParse) {
  const detail::RedisAddress plain = detail::parse_redis_address("redis://cache.local:7000");
  EXPECT_EQ(plain.host, "cache.local");
  EXPECT_EQ(plain.port, 7000);
  EXPECT_EQ(plain.password, "");
  EXPECT_EQ(plain.database, 0);
  const detail::RedisAddress full =
      detail::parse_redis_address("redis://:p%40ss:w@10.0.0.5:6380/2");
  EXPECT_EQ(full.password, "p@ss:w");
  EXPECT_EQ(full.user, "");
  EXPECT_EQ(full.host, "10.0.0.5");
  EXPECT_EQ(full.port, 6380);
  EXPECT_EQ(full.database, 2);
  const detail::RedisAddress user = detail::parse_redis_address("redis://alice:pw@[::1]/1");
  EXPECT_EQ(user.user, "alice");
  EXPECT_EQ(user.host, "::1");
  EXPECT_EQ(user.port, 6379);
  EXPECT_NO_THROW(Tier::check_address("dir:/var/cache/kvsnap"));
}

TEST(TierAddress, MalformedAddressesAreRefusedWithoutShowingThePassword) {
  const auto refused = [](const std::string& address, const char* rule) {
    return throws_error([&] { Tier::check_address(address); }, {"tier address", rule});
  };
  EXPECT_TRUE(refused("http://host:1", "does not start with redis://"));
  EXPECT_TRUE(refused("redis://host:99999", "port \"99999\""));
  // A database that is not digits is not shown: it may be the rest of a password with a '/'.
  EXPECT_TRUE(refused("redis://host:6379/x", "database (not shown) is not a number"));
  EXPECT_TRUE(refused("redis://host:6379/99999999", "database \"99999999\""));
  EXPECT_TRUE(refused("redis://:6379", "the host is empty"));
  EXPECT_TRUE(refused("redis://:@host:1", "password after ':' is empty"));
  EXPECT_TRUE(refused("dir:", "folder after dir: is empty"));
  try {
    Tier::check_address("redis://:hunter2@host:bad");
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("hunter2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(":***@host"), std::string::npos) << e.what();
  }
  // Other schemes, spacing, case, and credentials without a ':': nothing before the '@' but a
  // user name is shown.
  for (const std::string address :
       {"rediss://:hunter2@h:6379", " redis://:hunter2@h", "REDIS://:hunter2@h",
        "redis://hunter2@h:6379", "redis://alice:hunter2@h:x", "redis://:p@hunter2@h:bad"}) {
    try {
      Tier::check_address(address);
      ADD_FAILURE() << address << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find("hunter2"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("***@h"), std::string::npos) << e.what();
    }
  }
  // Without an '@', a password stands where the port would: only digits are shown there.
  // So does one with a '/' in it, where the database would (before the '/' or after it).
  for (const std::string address : {"redis://:hunter2", "redis://default:hunter2/1",
                                    "redis://alice:pw/hunter2", "redis://alice:123/hunter2"}) {
    try {
      Tier::check_address(address);
      ADD_FAILURE() << address << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find("hunter2"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(detail::redact_address("redis://host:6379/2"), "redis://host:6379/2");
  EXPECT_EQ(detail::redact_address("redis://[::1]:6379/2"), "redis://[::1]:6379/2");
  EXPECT_EQ(detail::redact_address("redis://[::1]/2"), "redis://[::1]/2");
  EXPECT_EQ(detail::redact_address("redis://alice:pw/secret"), "redis://alice:***");
  EXPECT_EQ(detail::redact_address("redis://alice:123/secret"), "redis://alice:123/***");
  EXPECT_EQ(detail::redact_address("dir:/srv/me@corp/tier"), "dir:/srv/me@corp/tier");  // a path
}

TEST(TierKeys, PromptsThatShareAPrefixShareItsChunkNames) {
  const testing::ObjectNames names;
  const auto a = tokens(1, 20), b = tokens(1, 16) + tokens(90, 4);
  EXPECT_EQ(names.chunk(a, 0), names.chunk(b, 0));
  EXPECT_EQ(names.chunk(a, 1), names.chunk(b, 1));
  EXPECT_NE(names.point(a, 18), names.point(b, 18));  // the tail differs
  EXPECT_EQ(names.point(a, 16), names.point(b, 16));
  // A chunk's name depends on everything before it, not only on its own tokens.
  EXPECT_NE(names.chunk(tokens(1, 8) + tokens(50, 8), 1),
            names.chunk(tokens(2, 8) + tokens(50, 8), 1));
}

TEST(TierKeys, TheRootSeparatesTenantsModelsLayersAndChunkSizes) {
  const auto prompt = tokens(1, 20);
  const std::string base = testing::ObjectNames().chunk(prompt, 0);
  TierOptions options = tier_options("tenant");
  EXPECT_NE(testing::ObjectNames(options).chunk(prompt, 0), base);
  options = tier_options();
  options.model_fingerprint += " ";
  EXPECT_NE(testing::ObjectNames(options).chunk(prompt, 0), base);
  HybridStack stack;
  const std::string layers = detail::tier_layer_configuration(stack.layers());
  HybridStack wider(true, 16);
  EXPECT_NE(detail::tier_layer_configuration(wider.layers()), layers);
  const detail::TierKeys four("f", layers, "", 4, ""), eight("f", layers, "", 8, "");
  EXPECT_NE(four.root_hex(), eight.root_hex());
  // Keyed processes name their objects apart from each other's and from processes without a key.
  const std::string key = "0123456789abcdef0123456789abcdef";
  EXPECT_NE(testing::ObjectNames(tier_options("", key)).chunk(prompt, 0), base);
  EXPECT_NE(
      testing::ObjectNames(tier_options("", key)).chunk(prompt, 0),
      testing::ObjectNames(tier_options("", "fedcba9876543210fedcba9876543210")).chunk(prompt, 0));
  EXPECT_EQ(testing::ObjectNames(tier_options("", key)).chunk(prompt, 0),
            testing::ObjectNames(tier_options("", key)).chunk(prompt, 0));
  // Without a key, a dir: store's names are this user's (it trusts only this user's files);
  // with one, every store's names are the key's.
  EXPECT_NE(testing::ObjectNames(tier_options(), "dir:/shared").chunk(prompt, 0), base);
  EXPECT_EQ(testing::ObjectNames(tier_options("", key), "dir:/shared").chunk(prompt, 0),
            testing::ObjectNames(tier_options("", key)).chunk(prompt, 0));
}

TEST(TierContract, LookupsWaitAtMost50MsByDefault) {
  EXPECT_EQ(TierOptions{}.lookup_timeout, std::chrono::milliseconds(50));
  EXPECT_GE(TierOptions{}.write_queue, 1);
}

TEST(TierContract, OpenRefusesWhatCannotWork) {
  HybridStack stack;
  TierOptions options = tier_options();
  options.model_fingerprint = "";
  EXPECT_TRUE(throws_error([&] { (void)Tier::open("dir:/tmp/x", stack.layers(), options); },
                           {"Tier::open", "model fingerprint is empty"}));
  options = tier_options("", "short");
  EXPECT_TRUE(throws_error([&] { (void)Tier::open("dir:/tmp/x", stack.layers(), options); },
                           {"Tier::open", "key of 5 bytes"}));
  options = tier_options();
  options.chunk_tokens = 0;
  EXPECT_TRUE(throws_error([&] { (void)Tier::open("dir:/tmp/x", stack.layers(), options); },
                           {"chunk_tokens 0 must be in [1, 32768]"}));
  options.chunk_tokens = 32769;  // a chunk's index could list more than a probe reads
  EXPECT_TRUE(throws_error([&] { (void)Tier::open("dir:/tmp/x", stack.layers(), options); },
                           {"Tier::open", "chunk_tokens 32769 must be in [1, 32768]"}));
  // Redis refuses an expiry past what its milliseconds hold: every command would fail.
  options = tier_options();
  options.ttl = std::chrono::seconds::max();
  EXPECT_TRUE(throws_error([&] { (void)Tier::open("dir:/tmp/x", stack.layers(), options); },
                           {"Tier::open", "ttl 9223372036854775807 s", "[1 s, 100 years]"}));
  // milliseconds::max() as "no limit" overflowed now + timeout into a deadline long past.
  options = tier_options();
  options.lookup_timeout = std::chrono::milliseconds::max();
  EXPECT_TRUE(throws_error([&] { (void)Tier::open("dir:/tmp/x", stack.layers(), options); },
                           {"Tier::open", "must be in [0, 24 h]"}));
  options = tier_options();
  options.max_object_bytes = (int64_t{512} << 20) + 1;
  EXPECT_TRUE(throws_error([&] { (void)Tier::open("dir:/tmp/x", stack.layers(), options); },
                           {"Tier::open", "max_object_bytes 536870913 must be in [1, 536870912]"}));
  options = tier_options();
  options.retry_interval = std::chrono::milliseconds(-1);
  EXPECT_TRUE(throws_error([&] { (void)Tier::open("dir:/tmp/x", stack.layers(), options); },
                           {"Tier::open", "retry_interval -1 ms"}));
  EXPECT_TRUE(
      throws_error([&] { (void)Tier::open("dir:/proc/self/x", stack.layers(), tier_options()); },
                   {"tier folder /proc/self/x"}));
}

// A begin refused for a Speculation round left open on its slot (prefix_cache.h) changes
// nothing: it asks the tier nothing and inserts nothing, and goes on once the round is gone.
TEST(TierContract, ABeginRefusedForAnOpenRoundAsksTheTierNothing) {
  const testing::FolderStore store("refused_begin");
  const testing::Conversation talk;
  {
    testing::TierProcess writer(store.address());
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  testing::TierProcess reader(store.address());
  Speculation round(reader.stack.layers());
  round.begin(2);  // the recurrent layer captures at 1 and 2
  EXPECT_TRUE(throws_error([&] { (void)reader.cache.begin(talk.first); },
                           {"PrefixCache::begin: layer", "a Speculation round still open?"}));
  EXPECT_EQ(reader.tier->stats().lookups, 0);
  EXPECT_EQ(reader.cache.node_count(), 0);
  round.cancel();
  PrefixCache::Session session = reader.cache.begin(talk.first);
  EXPECT_GT(session.cached(), 0);  // from the tier
  EXPECT_EQ(reader.tier->stats().lookups, 1);
}

// A session larger than write_queue_bytes is still stored when nothing else waits (else it,
// and every later one with its prompt, never could be); the budget must be positive.
TEST(TierContract, ASessionLargerThanTheWriteQueuesBytesIsStoredWhenNothingElseWaits) {
  const testing::FolderStore store("queue_bytes");
  TierOptions options = tier_options();
  options.write_queue_bytes = 1;
  testing::TierProcess writer(store.address(), options);
  const testing::Conversation talk;
  (void)writer.turn(talk.first, talk.reply, talk.ends);
  EXPECT_EQ(writer.tier->stats().dropped_batches, 0);
  EXPECT_GT(writer.tier->stats().objects_written, 0);
  testing::TierProcess reader(store.address(), options);
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 31);
  options.write_queue_bytes = 0;
  HybridStack stack;
  EXPECT_TRUE(throws_error([&] { (void)Tier::open(store.address(), stack.layers(), options); },
                           {"write_queue_bytes 0 must be >= 1"}));
}

TEST(TierContract, StoreRefusesDataThatDoesNotFitNamingTheRule) {
  testing::FolderStore folder("contract");
  HybridStack stack;
  const std::shared_ptr<Tier> tier = Tier::open(folder.address(), stack.layers(), tier_options());
  const auto prompt = tokens(1, 10);
  const TierPoint point{5, std::vector<const Snapshot*>(4)};
  const std::vector<const Snapshot*> ranges(4);
  EXPECT_TRUE(throws_error(
      [&] { tier->store(prompt, std::vector<const Snapshot*>(2), std::span(&point, 1)); },
      {"Tier::store", "2 ranges for 4 layers"}));
  EXPECT_TRUE(throws_error([&] { tier->store(prompt, ranges, std::span(&point, 1)); },
                           {"Tier::store", "layer 0 needs a KV snapshot covering [0, 5)"}));
  const TierPoint outside{11, std::vector<const Snapshot*>(4)};
  EXPECT_TRUE(throws_error([&] { tier->store(prompt, ranges, std::span(&outside, 1)); },
                           {"offset 11", "outside [1, 10]"}));
  EXPECT_TRUE(tier->flush());
  EXPECT_TRUE(folder.keys("kvsnap:").empty());  // nothing was written
}

// A sliding-window layer's state from a window of another size is refused before anything is
// written: every reader would find other token counts in it, reject it and delete it.
TEST(TierContract, StoreRefusesAWindowStateOfAnotherSize) {
  testing::FolderStore folder("window");
  HybridStack stack;  // a window of 8
  const std::shared_ptr<Tier> tier = Tier::open(folder.address(), stack.layers(), tier_options());
  HybridStack wider(true, 16);
  const auto prompt = tokens(1, 40);  // past both windows: each has let tokens go
  ASSERT_TRUE(wider.forward_and_check(prompt, prompt));
  const SnapshotPtr kv = wider.attention().snapshot(0, 0);
  const SnapshotPtr window = wider.window.snapshot(0, 0);
  const SnapshotPtr state = wider.recurrent.snapshot(0, 0);
  const std::vector<const Snapshot*> ranges{kv.get(), nullptr, nullptr, nullptr};
  const TierPoint point{40, {nullptr, window.get(), nullptr, state.get()}};
  EXPECT_TRUE(throws_error([&] { tier->store(prompt, ranges, std::span(&point, 1)); },
                           {"Tier::store: layer 1 at offset 40: a snapshot of a window of 16 "
                            "tokens, where the layer's is 8"}));
  EXPECT_TRUE(tier->flush());
  EXPECT_TRUE(folder.keys("kvsnap:").empty());  // nothing was written
}

// A store the tier refuses at a close (here: KV data of other shapes than the ones it learned)
// costs restores, never the request: Tier::offer counts it and logs it once, and the close
// ends as any other, the trie keeping what the session made.
TEST(TierContract, AStoreTheTierRefusesCostsTheCloseNothing) {
  testing::FolderStore folder("refused_close");
  testing::TierProcess process(folder.address());
  HybridStack alike;  // teaches the tier a KV layer of 1 head of depth 2, not the stack's 2 x 4
  const auto prompt = tokens(1, 12);
  ASSERT_TRUE(alike.forward_and_check(prompt, prompt));
  KVCache narrow;
  testing::write(narrow, TokenKV{.heads = 1, .depth = 2}, id_range(0, 12));
  const SnapshotPtr kv = narrow.snapshot(0), window = alike.window.snapshot(0, 0);
  const SnapshotPtr state = alike.recurrent.snapshot(0, 0);
  const std::vector<const Snapshot*> ranges{kv.get(), nullptr, nullptr, nullptr};
  const TierPoint point{12, {nullptr, window.get(), nullptr, state.get()}};
  process.tier->store(prompt, ranges, std::span(&point, 1));
  const int64_t errors = process.tier->stats().store_errors;
  const testing::Conversation talk;
  EXPECT_NO_THROW((void)process.turn(talk.first, talk.reply, talk.ends));
  EXPECT_EQ(process.turn(talk.second, tokens(500, 3)).cached, 31);  // from the trie
  EXPECT_EQ(process.tier->stats().store_errors, errors + 2);
  EXPECT_EQ(process.log.count("restore points not written"), 1) << process.log.all();
  EXPECT_EQ(process.log.count("where the layer's have"), 1) << process.log.all();
  EXPECT_GT(process.cache.node_count(), 0);
  // Called directly, the same store still throws.
  const SnapshotPtr own = process.stack.attention().snapshot(0, 0);
  const std::vector<const Snapshot*> own_ranges{own.get(), nullptr, nullptr, nullptr};
  EXPECT_TRUE(
      throws_error([&] { process.tier->store(talk.first, own_ranges, std::span(&point, 1)); },
                   {"Tier::store: layer 0 at offset 12: a snapshot of"}));
  EXPECT_FALSE(process.tier->offer(talk.first, std::vector<const Snapshot*>(2), {}));
  EXPECT_EQ(process.tier->stats().store_errors, errors + 3);
}

// The attention layer through a cache that, once armed, refuses to lend its whole history (a
// custom kind's snapshot(0) throwing). With a budget nothing reaches, only the tier's lazy
// snapshot at a close asks for that (an eviction lending live ranges to the trie would too).
class RefusesWholeHistory final : public testing::DelegatingCache {
 public:
  using DelegatingCache::DelegatingCache;
  SnapshotPtr snapshot(int64_t from) override {
    if (armed && from == 0) throw std::runtime_error("this cache lends no whole history");
    return inner_.snapshot(from);
  }
  bool armed = false;
};

TEST(TierContract, ACacheThatCannotLendItsHistoryCostsTheCloseNothing) {
  testing::FolderStore folder("unlent_close");
  HybridStack stack;
  RefusesWholeHistory attention(stack.attention());
  const std::vector<Cache*> layers{&attention, &stack.window, nullptr, &stack.recurrent};
  testing::LogLines log;
  TierOptions options = tier_options();
  options.log = log.sink();
  const std::shared_ptr<Tier> tier = Tier::open(folder.address(), layers, options);
  PrefixCache cache(layers, {.tier = tier});
  const testing::Conversation talk;
  (void)testing::run_turn(cache, stack, talk.first, talk.reply, talk.ends);
  ASSERT_TRUE(tier->flush());
  const int64_t written = tier->stats().objects_written, errors = tier->stats().store_errors;
  EXPECT_GT(written, 0);
  attention.armed = true;
  EXPECT_NO_THROW((void)testing::run_turn(cache, stack, talk.second, tokens(500, 3)));
  ASSERT_TRUE(tier->flush());
  EXPECT_EQ(tier->stats().store_errors, errors + 1);
  EXPECT_EQ(tier->stats().objects_written, written);
  EXPECT_EQ(log.count("this cache lends no whole history"), 1) << log.all();
  // The close ended normally: the trie holds the turn, and the slot serves on from its state.
  attention.armed = false;
  const testing::Tokens third = talk.second + tokens(500, 3) + tokens(600, 4);
  EXPECT_EQ(testing::run_turn(cache, stack, third, tokens(700, 2)).cached,
            static_cast<int64_t>(talk.second.size()) + 2);
}

TEST(TierContract, APrefixCacheRefusesATierOpenedForOtherLayers) {
  testing::FolderStore folder("layers");
  HybridStack stack, other;
  const std::shared_ptr<Tier> tier = Tier::open(folder.address(), other.layers(), tier_options());
  EXPECT_TRUE(throws_error([&] { PrefixCache cache(stack.layers(), {.tier = tier}); },
                           {"PrefixCache", "opened for other layers",
                            "layer 0 is another Cache object", "the tier's 4 layers"}));
}

// Every line reaches the log on one line (control characters in it, here from the folder's
// name, written as \xNN), and a log that throws loses its line, not the call that logged.
TEST(TierContract, LogLinesStayOneLineAndALogThatThrowsLosesOnlyItsLine) {
  testing::FolderStore folder("log\nkvsnap tier: forged");
  HybridStack stack;
  TierOptions options = tier_options();  // no key: open says trusted-store mode
  std::vector<std::string> lines;
  options.log = [&lines](const std::string& line) { lines.push_back(line); };
  (void)Tier::open(folder.address(), stack.layers(), options);
  ASSERT_EQ(lines.size(), 1U);
  EXPECT_EQ(lines[0].find('\n'), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("log\\x0Akvsnap tier: forged"), std::string::npos) << lines[0];
  // C1 controls (NEL) and U+2028 end lines for some readers too; other UTF-8 passes unchanged.
  testing::FolderStore other("log\u0085\u2028 \u00e9\u2192");
  lines.clear();
  (void)Tier::open(other.address(), stack.layers(), options);
  ASSERT_EQ(lines.size(), 1U);
  EXPECT_NE(lines[0].find("log\\xC2\\x85\\xE2\\x80\\xA8 \u00e9\u2192"), std::string::npos)
      << lines[0];
  // Bytes outside well-formed UTF-8: a lone 0x9B (CSI to a terminal reading 8-bit controls), an
  // overlong form, a truncated sequence.
  testing::FolderStore raw(
      "log\x9B"
      "2J\xC0\x80 \xE2\x82");
  lines.clear();
  (void)Tier::open(raw.address(), stack.layers(), options);
  ASSERT_EQ(lines.size(), 1U);
  EXPECT_NE(lines[0].find("log\\x9B2J\\xC0\\x80 \\xE2\\x82"), std::string::npos) << lines[0];
  options.log = [](const std::string&) { throw std::runtime_error("the log is gone"); };
  EXPECT_NO_THROW((void)Tier::open(folder.address(), stack.layers(), options));
}

}  // namespace
}  // namespace kvsnap

namespace kvsnap {
namespace {

// The token ids (TokenKV's tags) values [B, H, T, D] hold, for each row and head, in column
// order.
std::vector<int64_t> value_ids(const Array& values) {
  const std::vector<float> data = values.to_floats();
  std::vector<int64_t> ids;
  for (size_t i = 0; i < data.size(); i += static_cast<size_t>(values.dim(3))) {
    ids.push_back(static_cast<int64_t>(data[i]));
  }
  return ids;
}
std::vector<int64_t> object_ids(const std::string& bytes, const std::string& name) {
  return value_ids(detail::decode_safetensors(bytes, "object").at(name, "object"));
}

std::vector<int64_t> repeat(const std::vector<int64_t>& ids, int times) {
  std::vector<int64_t> out;
  for (int i = 0; i < times; ++i) out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

// A store takes its snapshots' records, then encodes them; in a server another thread's forward
// may run on those caches in between, copying a lazy snapshot's tokens out of the columns it
// names and then overwriting them (a window's ring shifts; a rewound range is written again).
// The object must hold the snapshot's tokens, read from wherever they lie when it is encoded.
TEST(TierObject, LiveSnapshotsAreEncodedFromWhereTheirTokensLieThen) {
  const TokenKV kv;
  KVCache range;
  RotatingKVCache window(8);
  (void)testing::write(range, kv, id_range(0, 12));
  (void)testing::write(window, kv, id_range(0, 12));
  const SnapshotPtr keys = range.snapshot(0);
  const SnapshotPtr state = window.snapshot(0);  // tokens 5..11, in the ring's columns
  std::vector<std::optional<detail::ObjectPart>> parts{
      detail::slice_part(*detail::object_part(*keys), 4, 12), detail::object_part(*state)};
  ASSERT_TRUE(parts[0]->record.live);
  ASSERT_TRUE(parts[1]->record.live);
  ASSERT_TRUE(range.restore(nullptr, 6));
  (void)testing::write(range, kv, id_range(100, 6));  // over columns 6..11
  for (int64_t id = 100; id < 106; ++id) {  // decode steps, over the ring's columns of 4..9
    (void)testing::write(window, kv, id_range(id, 1));
  }
  // The records' views show the new tokens now.
  ASSERT_NE(value_ids(parts[0]->record.second), repeat(id_range(4, 8), 2));
  ASSERT_NE(value_ids(parts[1]->record.second), repeat(id_range(5, 7), 2));
  const std::string bytes =
      detail::encode_object("k", "root", {detail::ObjectSpec::Kind::point, 4, 12}, parts);
  EXPECT_EQ(object_ids(bytes, "layer.0.b"), repeat(id_range(4, 8), 2));  // both heads
  EXPECT_EQ(object_ids(bytes, "layer.1.b"), repeat(id_range(5, 7), 2));
}

// A paged snapshot's part is an outline: making it gathers nothing (its record() would copy
// every token, for objects that each take a chunk of them), and each object copies its own
// tokens from the blocks — the same bytes as from a contiguous cache holding the same tokens.
TEST(TierObject, APagedSnapshotsObjectsCopyOnlyTheirTokensFromItsBlocks) {
  const TokenKV kv;
  KVCache contiguous;
  PagedKVCache paged({.block_tokens = 4});
  (void)testing::write(contiguous, kv, id_range(0, 14));
  (void)testing::write(paged, kv, id_range(0, 14));
  const SnapshotPtr whole = contiguous.snapshot(0), blocks = paged.snapshot(2);
  const int64_t allocations = allocation_count();
  const std::optional<detail::ObjectPart> part = detail::object_part(*blocks);
  EXPECT_EQ(allocation_count(), allocations);
  ASSERT_TRUE(part.has_value());
  EXPECT_TRUE(part->record.live);
  EXPECT_EQ(part->record.first.shape(), (Shape{1, kv.heads, 12, kv.depth}));
  for (const auto& [from, to] : {std::pair{2, 14}, {4, 12}, {5, 10}, {13, 14}}) {
    const detail::ObjectSpec spec{detail::ObjectSpec::Kind::chunk, from, to};
    EXPECT_EQ(detail::encode_object("k", "root", spec, {detail::slice_part(*part, from, to)}),
              detail::encode_object("k", "root", spec,
                                    {detail::slice_part(*detail::object_part(*whole), from, to)}))
        << from << ".." << to;
  }
}

// A server on loopback that answers every read with `reply` (what a broken or hostile store
// might send), until destroyed.
class ScriptedServer {
 public:
  explicit ScriptedServer(std::string reply) : reply_(std::move(reply)) {
    const testing::LoopbackListener listener = testing::listen_on_loopback("ScriptedServer");
    listener_ = listener.fd;
    port_ = listener.port;
    thread_ = std::thread([this] { run(); });
  }
  ~ScriptedServer() {
    stopping_ = true;
    thread_.join();
    ::close(listener_);
  }
  std::string address() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }

 private:
  void run() {
    std::vector<int> clients;
    while (!stopping_) {
      std::vector<pollfd> fds{{listener_, POLLIN, 0}};
      for (const int c : clients) fds.push_back({c, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 5) <= 0) continue;
      if (fds[0].revents & POLLIN) clients.push_back(::accept4(listener_, nullptr, nullptr, 0));
      for (size_t i = 1; i < fds.size(); ++i) {
        char buffer[1 << 16];
        if ((fds[i].revents & POLLIN) && ::read(fds[i].fd, buffer, sizeof buffer) > 0) {
          // A client that hangs up mid-reply (one refusing it) ends the write: no SIGPIPE.
          (void)::send(fds[i].fd, reply_.data(), reply_.size(), MSG_NOSIGNAL);
        }
      }
    }
    for (const int c : clients) ::close(c);
  }
  std::string reply_;
  int listener_ = -1, port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// A connection to `server` whose health lines go to `log`, reading objects of at most
// `max_object_bytes`.
std::unique_ptr<detail::Store> open_logged(
    const ScriptedServer& server, std::vector<std::string>& log,
    int64_t max_object_bytes = detail::Store::kMaximumObjectBytes) {
  const auto health = std::make_shared<detail::StoreHealth>(
      server.address(), [&log](const std::string& line) { log.push_back(line); }, [] {});
  return detail::open_store(
      server.address(),
      {.ttl = std::chrono::seconds(60), .health = health, .max_object_bytes = max_object_bytes});
}

// The StoreFailure `call` throws (a test failure when it throws none).
template <class Call>
detail::StoreFailure store_failure(Call&& call) {
  try {
    call();
  } catch (const detail::StoreFailure& failure) {
    return failure;
  }
  ADD_FAILURE() << "the call succeeded";
  return detail::StoreFailure("", detail::StoreFailure::Reason::waiting);
}

// A probe against `server` (one index, one key), failing or not.
void probe_once(detail::Store& store) {
  const std::vector<std::string> sets{"kvsnap:i:x"}, keys{"kvsnap:p:x"};
  std::vector<std::vector<std::string>> members;
  std::vector<int64_t> sizes;
  store.probe(sets, keys, std::chrono::steady_clock::now() + std::chrono::seconds(5), members,
              sizes);
}

// What a probe fails with against a store that answers `reply`, reading objects of at most
// `max_object_bytes`.
detail::StoreFailure probe_failure(const std::string& reply,
                                   int64_t max_object_bytes = detail::Store::kMaximumObjectBytes) {
  const ScriptedServer server(reply);
  std::vector<std::string> log;
  const std::unique_ptr<detail::Store> store = open_logged(server, log, max_object_bytes);
  return store_failure([&] { probe_once(*store); });
}

// A bulk string reply of `bytes` bytes.
std::string bulk(size_t bytes) {
  return "$" + std::to_string(bytes) + "\r\n" + std::string(bytes, 'x') + "\r\n";
}

// An array header announcing 200 million elements would have hiredis allocate 1.6 GB of element
// pointers (and a reply object per element as they come). It is refused from its header — at
// once, not at the deadline — and the failure says why.
TEST(TierRedisReplies, AnArrayLargerThanAnIndexMayListFailsFromItsHeader) {
  const auto start = std::chrono::steady_clock::now();
  const detail::StoreFailure failure = probe_failure("*200000000\r\n");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  EXPECT_EQ(failure.reason, detail::StoreFailure::Reason::failed);
  EXPECT_NE(std::string(failure.what()).find("array of 200000000 elements, more than the 65536"),
            std::string::npos)
      << failure.what();
}

// An index listing more members, or longer ones, than the tier writes is what anyone who can
// write the store can plant (SADD): that probe fails, and nothing else — the store is not logged
// as lost (which would clear what this process knows it holds, and rewrite it all), and the next
// round trip is tried at once, not after the retry interval.
TEST(TierRedisReplies, AnIndexTooLargeFailsThatProbeOnly) {
  for (const std::string& reply : {std::string("*70000\r\n"), "*1\r\n" + bulk(100)}) {
    const ScriptedServer server(reply);
    std::vector<std::string> log;
    const std::unique_ptr<detail::Store> store = open_logged(server, log);
    for (int probe = 0; probe < 2; ++probe) {
      const detail::StoreFailure failure = store_failure([&] { probe_once(*store); });
      EXPECT_EQ(failure.reason, detail::StoreFailure::Reason::failed);
      EXPECT_TRUE(std::string(failure.what()).starts_with("an index: a reply ")) << failure.what();
    }
    EXPECT_TRUE(log.empty()) << log.front();
  }
}

// No command the tier sends is answered with an array inside an array.
TEST(TierRedisReplies, ANestedArrayFailsTheRoundTrip) {
  const detail::StoreFailure failure = probe_failure("*1\r\n*1\r\n:1\r\n");
  EXPECT_NE(std::string(failure.what()).find("nests an array"), std::string::npos)
      << failure.what();
}

// A reply larger than the largest object fails as its bytes pass that size (here 1 MiB): the
// store announces 3 MiB and sends 1.5 of them, then nothing — the round trip fails at once, not
// at its deadline, and never buffers the reply whole. One within the limit is read as before.
TEST(TierRedisReplies, AReplyLargerThanTheLargestObjectFailsBeforeItIsWhole) {
  constexpr int64_t kLimit = int64_t(1) << 20;
  const std::vector<std::string> keys{"kvsnap:p:x"};
  {
    const ScriptedServer server("$3145728\r\n" + std::string(3 << 19, 'x'));
    std::vector<std::string> log;
    const std::unique_ptr<detail::Store> store = open_logged(server, log, kLimit);
    const auto start = std::chrono::steady_clock::now();
    const detail::StoreFailure failure =
        store_failure([&] { (void)store->fetch(keys, start + std::chrono::seconds(5), kNoLimit); });
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
    EXPECT_EQ(failure.reason, detail::StoreFailure::Reason::failed);
    EXPECT_NE(
        std::string(failure.what()).find("more than the 1048576 its command's reply may hold"),
        std::string::npos)
        << failure.what();
  }
  const ScriptedServer server(bulk(kLimit));
  std::vector<std::string> log;
  const std::unique_ptr<detail::Store> store = open_logged(server, log, kLimit);
  const auto values =
      store->fetch(keys, std::chrono::steady_clock::now() + std::chrono::seconds(5), kNoLimit);
  ASSERT_EQ(values.size(), 1u);
  ASSERT_TRUE(values[0].has_value());
  EXPECT_EQ(values[0]->size(), static_cast<size_t>(kLimit));
}

// The objects' replies of one fetch hold at most the bytes it is given, counted as they arrive:
// a store announcing more than is left fails the fetch at once (FetchTooLarge, naming that
// value), not when the rest is read — and the store is well (nothing logged: no outage).
TEST(TierRedisReplies, ObjectsPastTheBytesAFetchMayHoldStopItAtOnce) {
  const std::vector<std::string> keys{"kvsnap:c:a", "kvsnap:c:b"};
  const ScriptedServer hostile(bulk(600 << 10) + "$3145728\r\n" + std::string(3 << 19, 'x'));
  std::vector<std::string> log;
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)open_logged(hostile, log)->fetch(keys, start + std::chrono::seconds(5), 1 << 20);
    ADD_FAILURE() << "the fetch held more than its bytes";
  } catch (const detail::FetchTooLarge& too_large) {
    EXPECT_EQ(too_large.index, 1u);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  EXPECT_TRUE(log.empty()) << log.front();
  const ScriptedServer server(bulk(100) + bulk(200));
  const auto values =
      open_logged(server, log)
          ->fetch(keys, std::chrono::steady_clock::now() + std::chrono::seconds(5), 300);
  ASSERT_EQ(values.size(), 2u);
  EXPECT_EQ(values[1], std::string(200, 'x'));
}

// Status or error lines sent in place of objects count as objects would (hiredis holds them as
// strings until the round trip ends); and after a fetch stopped mid-reply, the next one on the
// same store opens a new connection and reads whole.
TEST(TierRedisReplies, LinesInPlaceOfObjectsCountAndTheNextFetchReconnects) {
  const std::vector<std::string> keys{"kvsnap:c:a", "kvsnap:c:b"};
  const std::string line = "+" + std::string(600 << 10, 'x') + "\r\n";
  const ScriptedServer lines(line + line);
  std::vector<std::string> log;
  const auto deadline = [] { return std::chrono::steady_clock::now() + std::chrono::seconds(5); };
  try {
    (void)open_logged(lines, log)->fetch(keys, deadline(), 1 << 20);
    ADD_FAILURE() << "two 600 KiB lines held within 1 MiB";
  } catch (const detail::FetchTooLarge& too_large) {
    EXPECT_EQ(too_large.index, 1u);
  }
  const ScriptedServer server(bulk(100) + bulk(200));
  const std::unique_ptr<detail::Store> store = open_logged(server, log);
  EXPECT_THROW((void)store->fetch(keys, deadline(), 250), detail::FetchTooLarge);
  const auto values = store->fetch(keys, deadline(), 300);
  ASSERT_EQ(values.size(), 2u);
  EXPECT_EQ(values[0], std::string(100, 'x'));
  EXPECT_EQ(values[1], std::string(200, 'x'));
  EXPECT_TRUE(log.empty()) << log.front();
}

// What a reply may hold depends on its command: only GETEX's an object; an index's members are
// decimal offsets, and EXPIRE answers with a number or a line. A long member or a long
// answer to EXPIRE fails the round trip.
TEST(TierRedisReplies, EachReplyHoldsAtMostWhatItsCommandIsAnsweredWith) {
  const std::string member = probe_failure("*1\r\n" + bulk(100)).what();
  EXPECT_NE(member.find("a reply of 100 bytes, more than the 64"), std::string::npos) << member;
  const std::string line = probe_failure("*0\r\n" + bulk(64 << 10)).what();  // EXPIRE's reply
  EXPECT_NE(line.find("more than the 4096 its command's reply may hold"), std::string::npos)
      << line;
}

// A store that sends more replies than there were commands: every later reply on that
// connection would answer the command before it (valid objects then look damaged and are
// deleted), so the round trip fails and the connection is not used again.
TEST(TierRedisReplies, ExtraRepliesFailTheRoundTripInsteadOfAnsweringTheNextCommand) {
  const ScriptedServer server("+OK\r\n+OK\r\n");
  std::vector<std::string> log;
  const std::unique_ptr<detail::Store> store = open_logged(server, log);
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:test:one", "value"}};
  try {
    (void)store->write(batch, std::chrono::steady_clock::now() + std::chrono::seconds(5));
    ADD_FAILURE() << "the write succeeded";
  } catch (const detail::StoreFailure& failure) {
    EXPECT_NE(std::string(failure.what()).find("more replies than there were commands"),
              std::string::npos)
        << failure.what();
  }
}

// A Redis before 6.2 has no GETEX: every lookup would miss, silently. The fetch fails instead,
// saying what the tier needs (the store's health logs it once).
TEST(TierRedisReplies, AStoreWithoutGetexSaysSoInsteadOfMissingSilently) {
  const ScriptedServer server("-ERR unknown command 'GETEX'\r\n");
  std::vector<std::string> log;
  const std::unique_ptr<detail::Store> store = open_logged(server, log);
  const std::vector<std::string> keys{"kvsnap:p:x"};
  EXPECT_THROW((void)store->fetch(keys, std::chrono::steady_clock::now() + std::chrono::seconds(5),
                                  kNoLimit),
               detail::StoreFailure);
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("Redis 6.2 or later"), std::string::npos) << log[0];
}

// A resolver that answers once let_go() is called; its state outlives the test (the store's
// resolving thread may still hold it).
struct HeldResolver {
  struct State {
    std::mutex mutex;
    std::condition_variable released;
    bool release = false;
    std::atomic<int> calls{0};
  };
  std::shared_ptr<State> state = std::make_shared<State>();
  ~HeldResolver() { let_go(); }
  void let_go() const {
    {
      const std::lock_guard lock(state->mutex);
      state->release = true;
    }
    state->released.notify_all();
  }
  std::function<std::vector<std::string>(const std::string&)> resolve() const {
    return [state = state](const std::string&) {
      ++state->calls;
      std::unique_lock lock(state->mutex);
      state->released.wait(lock, [&] { return state->release; });
      return std::vector<std::string>{"127.0.0.1"};
    };
  }
};

// A store at `host`:`port` whose names `resolve` resolves (null: the system's resolver).
// `patient`: every call waits for a running resolution (the tier's writer connection).
std::unique_ptr<detail::Store> open_named(
    const std::string& host, int port,
    std::function<std::vector<std::string>(const std::string&)> resolve, bool patient = false) {
  detail::StoreOptions options{.ttl = std::chrono::seconds(60),
                               .health = std::make_shared<detail::StoreHealth>(
                                   "store", [](const std::string&) {}, [] {})};
  options.resolve = std::move(resolve);
  options.wait_for_resolution = patient;
  return detail::open_store("redis://" + host + ":" + std::to_string(port), options);
}

// A host name resolves on a thread of its own: a resolver that does not answer (a DNS server
// down) costs the call that started it its deadline, not the resolver's timeouts of seconds, and
// the calls after it nothing while it runs (none waits, none starts another). Once it answers,
// the store connects.
TEST(TierRedisAddress, AHostNameThatDoesNotResolveCostsOneDeadline) {
  const ScriptedServer server("$5\r\nhello\r\n");
  const HeldResolver resolver;
  const std::unique_ptr<detail::Store> store =
      open_named("store.example", server.port(), resolver.resolve());
  const std::vector<std::string> keys{"kvsnap:p:x"};
  for (const auto reason :
       {detail::StoreFailure::Reason::timed_out, detail::StoreFailure::Reason::waiting}) {
    const auto start = std::chrono::steady_clock::now();
    const detail::StoreFailure failure = store_failure(
        [&] { (void)store->fetch(keys, start + std::chrono::milliseconds(200), kNoLimit); });
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_LT(took, std::chrono::seconds(2));
    if (reason == detail::StoreFailure::Reason::waiting) {
      EXPECT_LT(took, std::chrono::milliseconds(150));  // it did not wait for the resolution
    } else {
      EXPECT_GE(took, std::chrono::milliseconds(190));  // it waited for it, until its deadline
    }
    EXPECT_EQ(failure.reason, reason);
    EXPECT_NE(std::string(failure.what()).find("store.example is still being resolved"),
              std::string::npos)
        << failure.what();
  }
  resolver.let_go();
  // The resolution ends on its own thread: a call connects once it has.
  std::optional<std::string> value;
  for (int attempt = 0; attempt < 200 && !value; ++attempt) {
    try {
      value =
          store->fetch(keys, std::chrono::steady_clock::now() + std::chrono::seconds(5), kNoLimit)
              .at(0);
    } catch (const detail::StoreFailure&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  EXPECT_EQ(value, "hello");
  EXPECT_EQ(resolver.state->calls.load(), 1);
}

// The writer's connection is patient: a call while the name resolves waits for the resolution
// (until its deadline) instead of failing at once, so a write batch is not dropped for it.
TEST(TierRedisAddress, APatientStoreWaitsForTheResolutionThatRuns) {
  const ScriptedServer server("$5\r\nhello\r\n");
  const HeldResolver resolver;
  const std::unique_ptr<detail::Store> store =
      open_named("store.example", server.port(), resolver.resolve(), /*patient=*/true);
  const std::vector<std::string> keys{"kvsnap:p:x"};
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(store_failure([&] {
              (void)store->fetch(keys, start + std::chrono::milliseconds(100), kNoLimit);
            }).reason,
            detail::StoreFailure::Reason::timed_out);  // it started the resolution
  start = std::chrono::steady_clock::now();
  std::thread answer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    resolver.let_go();
  });
  std::optional<std::string> value;
  try {
    value = store->fetch(keys, start + std::chrono::seconds(10), kNoLimit).at(0);
  } catch (const detail::StoreFailure& failure) {
    ADD_FAILURE() << "a call while the name resolves failed: " << failure.what();
  }
  answer.join();
  EXPECT_EQ(value, "hello");
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(250));
  EXPECT_EQ(resolver.state->calls.load(), 1);
}

// A name the system resolves (localhost, from the hosts file) reaches the store through its
// numeric address; a name that does not resolve fails saying so, naming it.
TEST(TierRedisAddress, NamesResolveOrFailNamingTheHost) {
  const ScriptedServer server("$5\r\nhello\r\n");
  const std::vector<std::string> keys{"kvsnap:p:x"};
  const auto deadline = [] { return std::chrono::steady_clock::now() + std::chrono::seconds(5); };
  EXPECT_EQ(
      open_named("localhost", server.port(), nullptr)->fetch(keys, deadline(), kNoLimit).at(0),
      "hello");
  const std::unique_ptr<detail::Store> nowhere = open_named(
      "store.example", server.port(), [](const std::string&) -> std::vector<std::string> {
        throw std::runtime_error("Name or service not known");
      });
  detail::StoreFailure failure("", detail::StoreFailure::Reason::waiting);
  for (int attempt = 0; attempt < 200; ++attempt) {  // until the resolving thread has answered
    failure = store_failure([&] { (void)nowhere->fetch(keys, deadline(), kNoLimit); });
    if (failure.reason != detail::StoreFailure::Reason::waiting) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(failure.reason, detail::StoreFailure::Reason::failed);
  EXPECT_NE(
      std::string(failure.what()).find("cannot resolve store.example (Name or service not known)"),
      std::string::npos)
      << failure.what();
}

}  // namespace
}  // namespace kvsnap
