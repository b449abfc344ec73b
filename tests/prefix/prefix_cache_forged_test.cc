// Forged prefix-cache files: a saved trie taken apart, changed and resealed (the checksum detects
// damage, not tampering: anyone who can write the file can recompute it). Each is rejected whole
// with a kvsnap::Error naming the file, and the cache that refused it is unchanged.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <kvsnap/prefix_cache.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "persist/files.h"
#include "persist/safetensors.h"
#include "support/conversation.h"
#include "support/delegating_cache.h"

namespace kvsnap {
namespace {

using Json = nlohmann::json;
using testing::HybridStack;
using testing::throws_error;
using testing::warm_up;

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class ForgedTrie : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            ("kvsnap_forged_trie_" + std::to_string(::getpid())))
               .string();
    std::filesystem::remove_all(dir_);
    HybridStack stack;
    PrefixCache cache(stack.layers());
    warm_up(cache, stack);
    cache.save(dir_, "m");
    path_ = dir_ + "/prefix_cache.safetensors";
    file_ = detail::decode_safetensors(read(path_), path_);
    nodes_ = Json::parse(file_.metadata.at("nodes"));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes the file back with `nodes_`, sealed; each `marker` string in the metadata text is
  // replaced by the raw JSON text it maps to (nesting too deep to build as a value).
  void rewrite(const std::map<std::string, std::string>& raw = {}) {
    file_.metadata["nodes"] = nodes_.dump();
    for (auto& [key, text] : file_.metadata) {
      for (const auto& [marker, replacement] : raw) {
        const size_t at = text.find('"' + marker + '"');
        if (at != std::string::npos) text.replace(at, marker.size() + 2, replacement);
      }
    }
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << detail::encode_sealed(file_);
  }
  // Expects a warm cache's load to throw an Error with every fragment and change nothing: under
  // the default budget, and under one that keeps no node (whose load reads no node's data, but
  // checks every node all the same).
  void expect_rejected(std::initializer_list<const char*> fragments) {
    for (const int64_t budget : {PrefixCache::Options{}.max_paged_out_bytes, int64_t{1}}) {
      HybridStack stack;
      PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget});
      warm_up(cache, stack);
      const std::string before = cache.debug_string();
      EXPECT_TRUE(throws_error([&] { cache.load(dir_, "m"); }, fragments)) << budget;
      EXPECT_EQ(cache.debug_string(), before);
      EXPECT_EQ(cache.check_invariants(), "");
    }
  }
  // The first node with a snapshot on layer `layer`.
  size_t node_with(size_t layer) const {
    for (size_t n = 0; n < nodes_.size(); ++n) {
      if (!nodes_[n]["snapshots"][layer].is_null()) return n;
    }
    ADD_FAILURE() << "no node has a snapshot on layer " << layer;
    return 0;
  }

  std::string dir_, path_;
  detail::SafetensorsFile file_;
  Json nodes_;
};

TEST_F(ForgedTrie, TheUnchangedFileResealedLoads) {
  rewrite();
  HybridStack stack;
  PrefixCache cache(stack.layers());
  cache.load(dir_, "m");
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_GT(cache.node_count(), 0);
}

// Layer 2 of the HybridStack is stateless: a snapshot there (kind "none") is not a trie's.
TEST_F(ForgedTrie, ASnapshotOnAStatelessLayerIsRejected) {
  const size_t n = node_with(3);
  const Json recurrent = nodes_[n]["snapshots"][3];
  nodes_[n]["snapshots"][2] = {
      {"kind", "none"}, {"from", recurrent["to"]}, {"to", recurrent["to"]}};
  for (const char* part : {"a", "b"}) {
    const std::string node = "node." + std::to_string(n);
    file_.tensors.emplace_back(node + ".layer.2." + part,
                               file_.at(node + ".layer.3." + part, "test").clone());
  }
  rewrite();
  const std::string named = "node " + std::to_string(n);
  expect_rejected({"prefix_cache.safetensors", named.c_str(), "layer 2", "stateless"});
}

// Every node's edge must be covered by every KV layer (a restore through it needs the data).
TEST_F(ForgedTrie, AMissingKVSnapshotIsRejected) {
  nodes_[0]["snapshots"][0] = nullptr;
  std::erase_if(file_.tensors,
                [](const auto& t) { return t.first.starts_with("node.0.layer.0."); });
  rewrite();
  expect_rejected({"prefix_cache.safetensors", "node 0", "layer 0", "no KV snapshot"});
}

TEST_F(ForgedTrie, DeeplyNestedJsonIsRejectedCleanly) {
  Json layers = Json::parse(file_.metadata.at("layers"));
  layers[0] = "DEEP";
  file_.metadata["layers"] = layers.dump();
  rewrite({{"DEEP", std::string(100000, '[') + std::string(100000, ']')}});
  expect_rejected({"prefix_cache.safetensors", "\"layers\"", "deeper than"});
  SetUp();
  nodes_[0]["snapshots"][0] = "DEEP";
  rewrite({{"DEEP", std::string(100000, '[') + std::string(100000, ']')}});
  expect_rejected({"prefix_cache.safetensors", "\"nodes\"", "deeper than"});
}

// A snapshot entry that does not fit its layer is described briefly, however long it is.
TEST_F(ForgedTrie, AnOverlongSnapshotEntryIsDescribedBriefly) {
  nodes_[0]["snapshots"][0] = Json::array();
  for (int i = 0; i < 100000; ++i) nodes_[0]["snapshots"][0].push_back(i);
  rewrite();
  HybridStack stack;
  PrefixCache cache(stack.layers());
  try {
    cache.load(dir_, "m");
    ADD_FAILURE() << "loaded";
  } catch (const Error& error) {
    EXPECT_LT(std::string(error.what()).size(), 500u) << std::string(error.what()).substr(0, 500);
  }
}

// "layers" and "nodes" are JSON in the metadata, never parsed whole into more values than the
// trie takes: "layers" is refused unparsed when it holds more than its layers' descriptions
// take, "nodes" is read node by node, each of at most its fields and one snapshot entry a layer
// (plus a little). Here padding in a field the loader ignores: without the bound the file loads,
// and a forged one of 100 MiB costs GBs to parse.
TEST_F(ForgedTrie, MetadataJsonIsReadWithinWhatTheTrieTakes) {
  nodes_[0]["padding"] = Json::array();
  for (int i = 0; i < 100000; ++i) nodes_[0]["padding"].push_back(0);
  rewrite();
  expect_rejected({"prefix_cache.safetensors",
                   "metadata \"nodes\" has an element of more than 86 JSON values"});
  SetUp();
  Json layers = Json::parse(file_.metadata.at("layers"));
  layers.push_back(Json::array());
  for (int i = 0; i < 1000; ++i) layers.back().push_back(0);
  file_.metadata["layers"] = layers.dump();
  rewrite();
  expect_rejected({"prefix_cache.safetensors", "metadata \"layers\" holds 1"});
}

TEST_F(ForgedTrie, TheClockIsParsedStrictly) {
  for (const char* clock : {"7xyz", "-5", "+5", " 5", "", "5 ", "0x10", "9223372036854775807",
                            "4611686018427387904", "99999999999999999999"}) {
    file_.metadata["clock"] = clock;
    rewrite();
    expect_rejected({"prefix_cache.safetensors", "\"clock\""});
  }
  // A node used later than the clock says (the clock orders uses: the next one would be older).
  int64_t latest = 0;
  for (const Json& node : nodes_) latest = std::max(latest, node["used"].get<int64_t>());
  file_.metadata["clock"] = std::to_string(latest);
  nodes_[0]["used"] = latest + 1;
  rewrite();
  expect_rejected({"prefix_cache.safetensors", "node 0", "\"used\""});
  nodes_[0]["used"] = -1;
  rewrite();
  expect_rejected({"prefix_cache.safetensors", "node 0", "\"used\""});
  nodes_[0]["used"] = latest;  // the clock exactly at the latest use loads
  rewrite();
  HybridStack stack;
  PrefixCache cache(stack.layers());
  cache.load(dir_, "m");
  EXPECT_EQ(cache.check_invariants(), "");
}

// Integers past int64 are refused, not wrapped: a parent of 2^64 - 1 would read as -1 (the root)
// and a snapshot "to" of 2^63 as a negative offset.
TEST_F(ForgedTrie, IntegersPastInt64AreRefusedNotWrapped) {
  const Json original = nodes_;
  size_t child = 0;  // a node whose parent is the root
  while (child < nodes_.size() && nodes_[child]["parent"].get<int64_t>() != -1) ++child;
  ASSERT_LT(child, nodes_.size());
  nodes_[child]["parent"] = std::numeric_limits<uint64_t>::max();
  rewrite();
  const std::string named = "node " + std::to_string(child) + " has fields of the wrong type";
  expect_rejected({"prefix_cache.safetensors", named.c_str()});
  nodes_ = original;
  nodes_[0]["snapshots"][0]["to"] = uint64_t{1} << 63;
  rewrite();
  expect_rejected({"prefix_cache.safetensors", "node 0 layer 0", "does not fit"});
}

// A file far larger than the machine's memory (sparse: it takes no disk) is refused before a
// byte of it is read or reserved.
TEST_F(ForgedTrie, AFileTooLargeToLoadIsRefusedBeforeItIsRead) {
  const int fd = ::open(path_.c_str(), O_WRONLY | O_TRUNC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, off_t(1) << 40), 0);
  ::close(fd);
  expect_rejected({"PrefixCache::load", "prefix_cache.safetensors", "1099511627776 bytes"});
}

// A file whose KV snapshots are of another layout (here one head, not two: saved from caches of
// another dtype, head count or depth under the same model id) is refused by a cache whose trie
// holds the layout its caches serve. (A fresh one has none to compare: the model id must name
// what shapes the state.)
TEST_F(ForgedTrie, SnapshotsOfAnotherLayoutThanTheTrieHoldsAreRejected) {
  for (auto& [name, tensor] : file_.tensors) {
    if (name.find(".layer.0.") != std::string::npos) tensor = tensor.slice(1, 0, 1).contiguous();
  }
  rewrite();
  expect_rejected({"prefix_cache.safetensors", "layer 0", "f32[1, 1, *, 4]",
                   "does not fit what this cache's trie holds", "f32[1, 2, *, 4]"});
  HybridStack stack;
  PrefixCache fresh(stack.layers());
  EXPECT_NO_THROW(fresh.load(dir_, "m"));
}

// The check above reads the layouts a warm trie holds: of contiguous and paged KV snapshots,
// windows and recurrent states alike, they are the file's when the caches are the same.
TEST_F(ForgedTrie, AWarmCacheLoadsAFileOfItsLayout) {
  for (const bool paged : {false, true}) {
    HybridStack stack(testing::StackOptions{.paged = paged});
    PrefixCache cache(stack.layers());
    warm_up(cache, stack);
    EXPECT_NO_THROW(cache.load(dir_, "m")) << (paged ? "paged" : "contiguous");
    EXPECT_GT(cache.node_count(), 0);
  }
}

// A layer of a cache kind kvsnap does not know (restored as a whole state, by its own rules): a
// trie holding its snapshots cannot be saved, as no load could give them back to it, and a file
// that claims such a layer's snapshots is refused.
TEST_F(ForgedTrie, ALayerOfAnUnknownKindIsNeitherSavedNorLoaded) {
  HybridStack stack;
  testing::DelegatingCache unknown(stack.recurrent);
  std::vector<Cache*> layers = stack.layers();
  layers[3] = &unknown;
  {
    PrefixCache cache(layers);
    warm_up(cache, stack);
    EXPECT_TRUE(throws_error([&] { cache.save(dir_ + "/unknown", "m"); },
                             {"PrefixCache::save", "layer 3", "does not know", "cannot be saved"}));
    EXPECT_FALSE(PrefixCache::saved_in(dir_ + "/unknown"));
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/unknown"));  // refused before anything made
  }
  Json described = Json::parse(file_.metadata.at("layers"));
  described[3] = {{"kind", "other"}};
  file_.metadata["layers"] = described.dump();
  for (Json& node : nodes_) {
    if (!node["snapshots"][3].is_null()) node["snapshots"][3]["kind"] = "other";
  }
  rewrite();
  PrefixCache cache(layers);
  EXPECT_TRUE(throws_error([&] { cache.load(dir_, "m"); },
                           {"prefix_cache.safetensors", "layer 3", "does not know"}));
  EXPECT_EQ(cache.node_count(), 0);
}

}  // namespace
}  // namespace kvsnap
