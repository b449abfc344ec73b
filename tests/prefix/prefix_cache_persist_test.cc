#include <gtest/gtest.h>
#include <kvsnap/prefix_cache.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "support/conversation.h"
#include "support/memory_limit.h"

namespace kvsnap::prefix_cache_persist_test {
namespace {

using testing::HybridStack;
using testing::run_turn;
using testing::throws_error;
using testing::Tokens;
using testing::tokens;
using testing::warm_up;
using testing::operator+;

const Tokens& kSystem = testing::kWarmSystem;

std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvsnap_trie_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

// Saves a warmed-up cache (warm_up) to `dir` as "model-a" from a process of its own; returns its
// node count.
int64_t save_warm(const std::string& dir, bool paged = false) {
  HybridStack stack(testing::StackOptions{.paged = paged});
  PrefixCache cache(stack.layers());
  warm_up(cache, stack);
  cache.save(dir, "model-a");
  return cache.node_count();
}

// Saves to `dir` as "big" the trie of a cache over one KVCache (8 heads x 128 f16) that served
// `count` prompts of `length` tokens, each on its own first token; returns its node count.
int64_t save_prompts(const std::string& dir, int32_t count, int64_t length) {
  KVCache attention;
  PrefixCache cache({&attention});
  for (int32_t p = 0; p < count; ++p) {
    PrefixCache::Session session =
        cache.begin(tokens(1 + p * static_cast<int32_t>(length), static_cast<int32_t>(length)));
    const Array keys = Array::zeros(DType::f16, {1, 8, length, 128});
    (void)attention.update(Batch::uniform(1, length, 0), keys, keys);
    session.prefill_done();
    session.close();
  }
  cache.save(dir, "big");
  return cache.node_count();
}

// Over contiguous or paged attention caches (whose nodes' KV data is written from their blocks,
// never gathered whole first).
class PrefixCachePersistWarm : public ::testing::TestWithParam<bool> {};

TEST_P(PrefixCachePersistWarm, ARestartedCacheContinuesWarm) {
  const bool paged = GetParam();
  const std::string dir = scratch(paged ? "warm_paged" : "warm");
  const int64_t nodes = save_warm(dir, paged);
  ASSERT_TRUE(PrefixCache::saved_in(dir));
  HybridStack stack(testing::StackOptions{.paged = paged});  // a fresh process: empty caches
  PrefixCache cache(stack.layers());
  cache.load(dir, "model-a");
  EXPECT_EQ(cache.node_count(), nodes);
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
  // Each continues where it left off; outputs equal recomputation (run_turn checks them).
  EXPECT_EQ(run_turn(cache, stack,
                     kSystem + tokens(200, 6) + tokens(300, 4) + tokens(400, 5) + tokens(500, 3) +
                         tokens(600, 2),
                     tokens(700, 2))
                .cached,
            12 + 6 + 4 + 5 + 2);
  EXPECT_EQ(run_turn(cache, stack, kSystem + tokens(850, 3), tokens(900, 2)).cached, 12);
  EXPECT_EQ(
      run_turn(cache, stack, kSystem + tokens(800, 7) + tokens(900, 2), tokens(910, 2)).cached,
      12 + 7 + 1);
  std::filesystem::remove_all(dir);
}
INSTANTIATE_TEST_SUITE_P(AttentionStorage, PrefixCachePersistWarm, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "paged" : "contiguous"; });

// A cache loaded under a smaller budget evicts at once; its stats say how many nodes the file
// held and how many the budget evicted.
TEST(PrefixCachePersist, ALoadUnderASmallerBudgetSaysWhatItLoadedAndEvicted) {
  const std::string dir = scratch("budget");
  const int64_t nodes = save_warm(dir);
  HybridStack stack;
  PrefixCache cache(stack.layers(), {.max_paged_out_bytes = 1});
  EXPECT_EQ(cache.stats().loaded_nodes, 0);
  cache.load(dir, "model-a");
  EXPECT_EQ(cache.stats().loaded_nodes, nodes);
  EXPECT_GT(cache.stats().evicted_nodes, 0);
  EXPECT_LT(cache.node_count(), nodes);
  EXPECT_LE(cache.paged_out_bytes(), 1);
  EXPECT_LE(cache.peak_paged_out_bytes(), 1);  // nothing was built: every node was passed over
  // Under half of what the file holds: the most recently used nodes that fit, and never more
  // than the budget held (the load reads only the nodes it keeps).
  PrefixCache whole(stack.layers());
  whole.load(dir, "model-a");
  const int64_t half = whole.paged_out_bytes() / 2;
  PrefixCache halved(stack.layers(), {.max_paged_out_bytes = half});
  halved.load(dir, "model-a");
  EXPECT_GT(halved.node_count(), 0);
  EXPECT_LT(halved.node_count(), nodes);
  EXPECT_LE(halved.peak_paged_out_bytes(), half);
  EXPECT_EQ(halved.paged_out_bytes(), halved.recount_paged_out_bytes());
  EXPECT_EQ(halved.check_invariants(), "");
  EXPECT_EQ(halved.stats().loaded_nodes, nodes);
  // What it kept restores the most recently used conversation (outputs equal recomputation).
  HybridStack fresh;
  PrefixCache restoring(fresh.layers(), {.max_paged_out_bytes = half});
  restoring.load(dir, "model-a");
  EXPECT_GT(
      run_turn(restoring, fresh, kSystem + tokens(800, 7) + tokens(900, 2), tokens(910, 2)).cached,
      0);
  std::filesystem::remove_all(dir);
}

// A load under a smaller budget than the saving cache's reads the data of only the nodes it
// keeps: the rest are hashed as they pass. Four prompts of 16 MiB each loaded under a budget
// that keeps one, in a child whose address space may grow by 40 MiB: reading them all (and
// evicting afterwards) runs out.
TEST(PrefixCachePersist, ALoadUnderASmallBudgetReadsOnlyWhatItKeeps) {
  if (testing::kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer ignores RLIMIT_AS";
  if (testing::kThreadSanitizer) GTEST_SKIP() << "ThreadSanitizer's allocations fail under it";
  const std::string dir = scratch("small_budget");
  constexpr int64_t kTokens = 4096;             // 8 heads x 128 f16: 8 MiB of keys, 8 of values
  ASSERT_EQ(save_prompts(dir, 4, kTokens), 8);  // each prompt's first 4095 tokens, its last
  ASSERT_GT(std::filesystem::file_size(dir + "/prefix_cache.safetensors"), uint64_t{64} << 20);
  KVCache attention;
  PrefixCache fresh({&attention}, {.max_paged_out_bytes = int64_t{20} << 20});
  const int status = testing::run_with_headroom(int64_t{40} << 20, [&] {
    try {
      fresh.load(dir, "big");
    } catch (const Error&) {
      return 1;  // out of memory
    }
    // The most recently used prompt, restored in place of recomputing it.
    const Tokens last = tokens(1 + 3 * kTokens, kTokens) + Tokens{7};
    if (fresh.node_count() != 2 || fresh.peak_paged_out_bytes() > (int64_t{20} << 20) ||
        fresh.match(last) != kTokens) {
      return 2;
    }
    return 0;
  });
  EXPECT_EQ(status, 0) << "1: the load ran out of memory within 40 MiB; 2: it kept other nodes";
  std::filesystem::remove_all(dir);
}

TEST(PrefixCachePersist, AnotherLayerConfigurationIsRejectedAndNothingChanges) {
  const std::string dir = scratch("config");
  (void)save_warm(dir);
  KVCache attention;
  RotatingKVCache window(16);  // not the 8 it was saved with
  PrefixCache other({&attention, &window, nullptr});
  EXPECT_TRUE(throws_error([&] { other.load(dir, "model-a"); },
                           {"prefix_cache.safetensors", "holds 4 layers, this cache has 3"}));
  HybridStack stack;
  auto layers = stack.layers();
  RotatingKVCache wide(16);
  layers[1] = &wide;
  PrefixCache mismatched(layers);
  EXPECT_TRUE(throws_error([&] { mismatched.load(dir, "model-a"); },
                           {"layer 1", "\"max_size\":8", "\"max_size\":16"}));
  EXPECT_EQ(mismatched.node_count(), 0);
  PrefixCache same(stack.layers());
  EXPECT_TRUE(throws_error([&] { same.load(dir, "model-b"); },
                           {"saved for model \"model-a\"", "\"model-b\""}));
  EXPECT_EQ(same.node_count(), 0);
  std::filesystem::remove_all(dir);
}

TEST(PrefixCachePersist, ADamagedFileIsRejectedWhole) {
  const std::string dir = scratch("damaged");
  HybridStack stack;
  PrefixCache cache(stack.layers());
  warm_up(cache, stack);
  cache.save(dir);
  const std::string path = dir + "/prefix_cache.safetensors";
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  HybridStack fresh;
  PrefixCache other(fresh.layers());
  // Under a budget that keeps nothing, every tensor is passed over, not read: a flip anywhere in
  // their data is still found by the seal.
  PrefixCache keeps_nothing(fresh.layers(), {.max_paged_out_bytes = 1});
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), sizeof header);  // little-endian, as x86 and ARM read it
  for (size_t at = 8 + header; at < bytes.size(); at += 211) {
    std::string damaged = bytes;
    damaged[at] ^= 0x01;
    { std::ofstream(path, std::ios::binary | std::ios::trunc) << damaged; }
    EXPECT_TRUE(throws_error([&] { keeps_nothing.load(dir); }, {"the file is damaged"}))
        << "byte " << at;
  }
  { std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes; }
  EXPECT_NO_THROW(keeps_nothing.load(dir));  // the file undamaged: loaded, every node evicted
  EXPECT_EQ(keeps_nothing.node_count(), 0);
  EXPECT_GT(keeps_nothing.stats().evicted_nodes, 0);
  bytes[bytes.size() / 2] ^= 0x01;
  { std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes; }
  EXPECT_TRUE(throws_error([&] { other.load(dir); }, {"prefix_cache.safetensors"}));
  EXPECT_EQ(other.node_count(), 0);
  EXPECT_TRUE(throws_error([&] { other.load(scratch("missing")); }, {"cannot open"}));
  std::filesystem::remove_all(dir);
}

// A load reads the file a tensor at a time into the arrays it builds: it holds what it decodes,
// not the file's bytes as well (it took twice the file). Loaded in a child whose address space
// may grow by 1.5x the file: reading the whole file first and decoding it runs out.
TEST(PrefixCachePersist, ALoadHoldsWhatItDecodesNotTheFileAsWell) {
  if (testing::kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer ignores RLIMIT_AS";
  if (testing::kThreadSanitizer) GTEST_SKIP() << "ThreadSanitizer's allocations fail under it";
  const std::string dir = scratch("memory");
  constexpr int64_t kTokens = 8192;  // 8 heads x 128 f16: 16 MiB of keys, 16 of values
  const int64_t nodes = save_prompts(dir, 1, kTokens);
  const auto file =
      static_cast<int64_t>(std::filesystem::file_size(dir + "/prefix_cache.safetensors"));
  ASSERT_GT(file, int64_t{16} << 20);
  KVCache attention;
  PrefixCache fresh({&attention});
  const int status = testing::run_with_headroom(file * 3 / 2, [&] {
    try {
      fresh.load(dir, "big");
    } catch (const Error&) {
      return 1;  // out of memory
    }
    return fresh.node_count() == nodes ? 0 : 2;
  });
  EXPECT_EQ(status, 0) << "1: the load ran out of memory within 1.5x the file's " << file
                       << " bytes";
  std::filesystem::remove_all(dir);
}

TEST(PrefixCachePersist, AFlipInTheHeaderPaddingIsRejected) {
  const std::string dir = scratch("padding");
  HybridStack stack;
  PrefixCache cache(stack.layers());
  warm_up(cache, stack);
  cache.save(dir);
  const std::string path = dir + "/prefix_cache.safetensors";
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i)
    length |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  // The padding after the header's JSON: a tab there is still valid JSON of the same meaning.
  const size_t json_end = bytes.rfind('}', 8 + length - 1) + 1;
  ASSERT_LT(json_end, 8 + length) << "the header should end in padding";
  for (size_t at = json_end; at < 8 + length; ++at) {
    std::string damaged = bytes;
    damaged[at] = '\t';
    { std::ofstream(path, std::ios::binary | std::ios::trunc) << damaged; }
    HybridStack fresh;
    PrefixCache other(fresh.layers());
    EXPECT_THROW(other.load(dir), Error) << "byte " << at;
    EXPECT_EQ(other.node_count(), 0);
  }
  std::filesystem::remove_all(dir);
}

TEST(PrefixCachePersist, LoadingDuringASessionIsAnError) {
  const std::string dir = scratch("session");
  HybridStack stack;
  PrefixCache cache(stack.layers());
  warm_up(cache, stack);
  cache.save(dir);
  auto session = cache.begin(kSystem);
  EXPECT_TRUE(throws_error([&] { cache.load(dir); }, {"PrefixCache::load", "session is open"}));
  std::filesystem::remove_all(dir);
}

// A model_id is any bytes (the CLI's holds a file path): one that is not UTF-8 is kept exactly,
// and a load compares the same bytes, so neither its UTF-8 spelling nor a lossy rendering of it
// matches.
TEST(PrefixCachePersist, AModelIdThatIsNotUtf8IsKeptExactly) {
  const std::string dir = scratch("latin1");
  const std::string latin1 = "model-\xe9t\xe9";  // Latin-1 "model-été"
  HybridStack stack;
  PrefixCache cache(stack.layers());
  warm_up(cache, stack);
  cache.save(dir, latin1);
  HybridStack fresh;
  PrefixCache other(fresh.layers());
  other.load(dir, latin1);
  EXPECT_EQ(other.node_count(), cache.node_count());
  PrefixCache wrong(fresh.layers());
  for (const std::string& id :
       {std::string("model-\xc3\xa9t\xc3\xa9"), std::string("model-\xef\xbf\xbdt\xef\xbf\xbd"),
        std::string("model-\\xe9t\\xe9"), std::string("model-")}) {
    EXPECT_TRUE(throws_error([&] { wrong.load(dir, id); }, {"saved for model"})) << id;
    EXPECT_EQ(wrong.node_count(), 0);
  }
  // A UTF-8 id is written as it is (files of earlier versions load as before).
  cache.save(dir, "model-\xc3\xa9t\xc3\xa9");
  std::string bytes;
  {
    std::ifstream in(dir + "/prefix_cache.safetensors", std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  EXPECT_NE(bytes.find("\"model\":\"model-\xc3\xa9t\xc3\xa9\""), std::string::npos);
  EXPECT_TRUE(throws_error([&] { wrong.load(dir, latin1); }, {"saved for model"}));
  // Ids that begin alike (a model's configuration, then its weights' digest) are told apart
  // where they differ, not only by the beginnings shown.
  const std::string config(60, 'c');
  cache.save(dir, config + "-digest-one");
  EXPECT_TRUE(throws_error([&] { wrong.load(dir, config + "-digest-two"); },
                           {"(they first differ at byte 68: \"one\" in the file, \"two\" here)"}));
  // Counted in the bytes saved, not in the escaped form an id that is not UTF-8 is shown in.
  cache.save(dir, config + "\xe9-one");
  EXPECT_TRUE(throws_error([&] { wrong.load(dir, config + "\xe9-two"); },
                           {"(they first differ at byte 62: \"one\" in the file, \"two\" here)"}));
  std::filesystem::remove_all(dir);
}

TEST(PrefixCachePersist, AnEmptyTrieRoundTrips) {
  const std::string dir = scratch("empty");
  HybridStack stack;
  PrefixCache cache(stack.layers());
  cache.save(dir);
  PrefixCache other(stack.layers());
  other.load(dir);
  EXPECT_EQ(other.node_count(), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvsnap::prefix_cache_persist_test
