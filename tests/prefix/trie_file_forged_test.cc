// Trie files whose structure breaks the trie's rules (trie.h): a saved trie taken apart, its
// node list, edges or tensors changed and the file resealed (the checksum detects damage, not
// tampering). Each is refused whole by PrefixCache::load with an Error naming what is wrong, and
// the cache that refused it is left exactly as it was. Then Trie::check_invariants, which the
// tests rely on to find a broken trie, shown to report each rule a trie built by hand breaks.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvsnap/kv_cache.h>
#include <kvsnap/prefix_cache.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cache/snapshot_record.h"
#include "persist/files.h"
#include "persist/safetensors.h"
#include "prefix/trie.h"
#include "support/conversation.h"

namespace kvsnap::trie_file_forged_test {
namespace {

using Json = nlohmann::json;
using testing::HybridStack;
using testing::kWarmSystem;
using testing::tokens;
using testing::Tokens;
using testing::operator+;

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A cache that served other conversations than the saved one's (and one of them too): a load
// that went through would change what it holds.
void warm_otherwise(PrefixCache& cache, HybridStack& stack) {
  testing::run_turn(cache, stack, tokens(1000, 9), tokens(1100, 3), {9});
  testing::run_turn(cache, stack, kWarmSystem + tokens(800, 7), tokens(900, 2));
  testing::run_turn(cache, stack, tokens(1000, 9) + tokens(1200, 4), tokens(1300, 2));
}

// Prompts of the saved conversations and of warm_otherwise's.
std::vector<Tokens> probes() {
  return {kWarmSystem + tokens(200, 6) + tokens(300, 4) + tokens(400, 5) + tokens(500, 3),
          kWarmSystem + tokens(800, 7) + tokens(900, 2), kWarmSystem + tokens(200, 3),
          tokens(1000, 9) + tokens(1100, 3), tokens(1000, 9) + tokens(1200, 4) + tokens(1300, 2)};
}

// What a cache holds, as its public calls tell it.
struct Held {
  int64_t nodes = 0, paged_out = 0;
  std::string dump;
  std::vector<int64_t> matches;
};
Held held(const PrefixCache& cache) {
  Held out{cache.node_count(), cache.paged_out_bytes(), cache.debug_string(), {}};
  for (const Tokens& prompt : probes()) out.matches.push_back(cache.match(prompt));
  return out;
}

// warm_up's file (7 nodes: the system prompt [0, 12), under it [12, 17) -> [17, 21) -> [21, 26)
// -> [26, 29) and [12, 18) -> [18, 20); every node holds layers 0, 1 and 3), decoded.
class TrieFileForged : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            ("kvsnap_trie_file_forged_" + std::to_string(::getpid())))
               .string();
    std::filesystem::remove_all(dir_);
    HybridStack stack;
    PrefixCache cache(stack.layers());
    testing::warm_up(cache, stack);
    cache.save(dir_, "m");
    path_ = dir_ + "/prefix_cache.safetensors";
    file_ = detail::decode_safetensors(read(path_), path_);
    nodes_ = Json::parse(file_.metadata.at("nodes"));
    edges_ = file_.at("edges", "test").to_ints();
    ASSERT_EQ(nodes_.size(), 7u);
    ASSERT_EQ(nodes_[5]["parent"], 0);  // node 1's sibling
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes the file back, sealed, with `nodes_` and `edges_`.
  void rewrite() {
    file_.metadata["nodes"] = nodes_.dump();
    for (auto& [name, tensor] : file_.tensors) {
      if (name == "edges") tensor = Array::from_ints(edges_, {static_cast<int64_t>(edges_.size())});
    }
    file_.index.clear();  // tensors may have been added or removed
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << detail::encode_sealed(file_);
  }
  // The position in `edges_` of node n's first token.
  size_t edge_of(size_t n) const {
    size_t at = 0;
    for (size_t i = 0; i < n; ++i) at += nodes_[i]["length"].get<size_t>();
    return at;
  }
  void drop_tensors_of(size_t n) {
    const std::string prefix = fmt::format("node.{}.", n);
    std::erase_if(file_.tensors, [&](const auto& t) { return t.first.starts_with(prefix); });
  }

  // Expects a warm cache's load to throw an Error naming the file and saying `what`, and to
  // change nothing: under the default budget, and under one that keeps no node (whose load
  // reads no node's data, but checks every node all the same).
  void expect_rejected(const std::string& what) {
    for (const int64_t budget : {PrefixCache::Options{}.max_paged_out_bytes, int64_t{1}}) {
      SCOPED_TRACE(fmt::format("budget {}, expecting \"{}\"", budget, what));
      HybridStack stack;
      PrefixCache cache(stack.layers(), {.max_paged_out_bytes = budget});
      warm_otherwise(cache, stack);
      const Held before = held(cache);
      ASSERT_GT(before.nodes, 0);
      try {
        cache.load(dir_, "m");
        ADD_FAILURE() << "the forged file loaded";
      } catch (const Error& error) {
        const std::string message = error.what();
        EXPECT_NE(message.find(path_ + ": "), std::string::npos) << message;
        EXPECT_NE(message.find(what), std::string::npos) << message;
      }
      const Held after = held(cache);
      EXPECT_EQ(after.nodes, before.nodes);
      EXPECT_EQ(after.paged_out, before.paged_out);
      EXPECT_EQ(after.dump, before.dump);
      EXPECT_EQ(after.matches, before.matches);
      EXPECT_EQ(cache.check_invariants(), "");
      // And it still serves what it held (under the default budget, the whole prompt but the
      // token it leaves to evaluate).
      const Tokens prompt = tokens(1000, 9) + tokens(1100, 3);
      const int64_t reusable = cache.match(0, prompt);
      if (budget != 1) {
        EXPECT_EQ(reusable, static_cast<int64_t>(prompt.size()) - 1);
      }
      EXPECT_EQ(testing::run_turn(cache, stack, prompt, tokens(1400, 2)).cached, reusable);
    }
  }
  // Expects a fresh cache to load the file with `nodes` nodes, every invariant holding.
  void expect_loads(int64_t nodes) {
    HybridStack stack;
    PrefixCache cache(stack.layers());
    EXPECT_NO_THROW(cache.load(dir_, "m"));
    EXPECT_EQ(cache.node_count(), nodes);
    EXPECT_EQ(cache.check_invariants(), "");
  }

  std::string dir_, path_;
  detail::SafetensorsFile file_;
  Json nodes_;
  std::vector<int32_t> edges_;
};

// The forgeries below change one thing each: unchanged, the resealed file loads.
TEST_F(TrieFileForged, TheUnchangedFileResealedLoads) {
  rewrite();
  expect_loads(7);
}

// Node 5 ([12, 18), first token 800) made to start as its sibling node 1 does (200): a match of
// 200 could follow either.
TEST_F(TrieFileForged, SiblingsThatShareAFirstTokenAreRejected) {
  const std::vector<int32_t> original = edges_;
  ASSERT_EQ(edges_[edge_of(1)], 200);
  edges_[edge_of(5)] = 200;
  rewrite();
  expect_rejected("node 5 shares its first token 200 with a sibling");
  // The same first token under another parent is no sibling's: node 6, node 5's only child.
  edges_ = original;
  edges_[edge_of(6)] = 200;
  rewrite();
  expect_loads(7);
}

// A KV snapshot spans its node's edge exactly: node 1 is [12, 17).
TEST_F(TrieFileForged, AKVSnapshotOfOtherTokensThanItsNodesEdgeIsRejected) {
  const Json original = nodes_;
  for (const auto& [from, to] : {std::pair{13, 18}, std::pair{11, 16}, std::pair{12, 16}}) {
    nodes_ = original;
    nodes_[1]["snapshots"][0]["from"] = from;
    nodes_[1]["snapshots"][0]["to"] = to;
    rewrite();
    expect_rejected(fmt::format(
        "node 1 [12, 17) layer 0: snapshot range [{}, {}) does not match the node", from, to));
  }
}

// A whole-state snapshot (the window, the recurrent layer) is the state at its node's end.
TEST_F(TrieFileForged, AWholeStateSnapshotOffItsNodesEndIsRejected) {
  const Json original = nodes_;
  for (const int layer : {1, 3}) {
    nodes_ = original;
    nodes_[1]["snapshots"][layer]["from"] = 16;
    nodes_[1]["snapshots"][layer]["to"] = 16;
    rewrite();
    expect_rejected(fmt::format(
        "node 1 [12, 17) layer {}: snapshot range [16, 16) does not match the node", layer));
  }
}

// Nodes are listed parents first: a parent is -1 (the root) or a node listed earlier.
TEST_F(TrieFileForged, ANodeWhoseParentIsNotAnEarlierNodeIsRejected) {
  const Json original = nodes_;
  for (const auto& [node, parent] : {std::pair{2, 2}, std::pair{2, 3}, std::pair{2, 6},
                                     std::pair{2, 7}, std::pair{2, -2}, std::pair{0, 0}}) {
    nodes_ = original;
    nodes_[node]["parent"] = parent;
    rewrite();
    expect_rejected(fmt::format("node {} names parent {}, not an earlier node", node, parent));
  }
}

// Every edge token is some node's.
TEST_F(TrieFileForged, EdgeTokensThatBelongToNoNodeAreRejected) {
  edges_.push_back(7);
  rewrite();
  expect_rejected("1 edge tokens belong to no node");
  // The last node left out of the list, its tensors too: its edge stays.
  edges_.pop_back();
  nodes_.erase(6);
  drop_tensors_of(6);
  rewrite();
  expect_rejected("2 edge tokens belong to no node");
  edges_.resize(edges_.size() - 2);  // and without its edge, the rest loads
  rewrite();
  expect_loads(6);
}

// Every tensor is a node's snapshot (or the edges).
TEST_F(TrieFileForged, TensorsThatBelongToNoNodeAreRejected) {
  const std::vector<std::pair<std::string, Array>> original = file_.tensors;
  file_.tensors.emplace_back("stray", file_.at("node.0.layer.3.a", "test").clone());
  rewrite();
  expect_rejected("1 tensors belong to no node");
  // Node 6's recurrent snapshot left out of the list, its tensors kept.
  file_.tensors = original;
  nodes_[6]["snapshots"][3] = nullptr;
  rewrite();
  expect_rejected("2 tensors belong to no node");
  // Without them the node loads: a node may lack a restore point.
  std::erase_if(file_.tensors,
                [](const auto& t) { return t.first.starts_with("node.6.layer.3."); });
  rewrite();
  expect_loads(7);
}

TEST_F(TrieFileForged, AnUnknownFormatVersionIsRejected) {
  for (const char* version : {"1", "3", "02", "2.0", " 2", ""}) {
    file_.metadata["version"] = version;
    rewrite();
    expect_rejected(
        fmt::format("version {} is unknown (this build reads version 2)", Json(version).dump()));
  }
  // Sealed as this build seals: another version, not damage — the message says no more.
  HybridStack stack;
  PrefixCache cache(stack.layers());
  try {
    cache.load(dir_, "m");
    ADD_FAILURE() << "a file of version \"\" loaded";
  } catch (const Error& error) {
    EXPECT_TRUE(std::string(error.what()).ends_with("(this build reads version 2)"))
        << error.what();
  }
  file_.metadata.erase("version");
  rewrite();
  expect_rejected("metadata \"version\" is missing");
}

// A version damaged in place (the seal not made again) may be damage, not another version: the
// message says both.
TEST_F(TrieFileForged, ADamagedVersionSaysTheFileMayBeDamaged) {
  rewrite();
  std::string bytes = read(path_);
  const size_t at = bytes.find("\"version\":\"2\"");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 11] = '3';
  std::ofstream(path_, std::ios::binary | std::ios::trunc) << bytes;
  expect_rejected(
      "version \"3\" is unknown (this build reads version 2), or the file is damaged: its "
      "checksum does not match either");
}

// So is one in "format": in its value, or in its key (then the format reads as missing).
TEST_F(TrieFileForged, ADamagedFormatSaysTheFileMayBeDamaged) {
  rewrite();
  const std::string saved = read(path_);
  const size_t at = saved.find("\"format\":\"kvsnap-prefix-cache\"");
  ASSERT_NE(at, std::string::npos);
  for (const auto& [flipped, said] :
       {std::pair{at + 21, "format \"kvsnap-prefjx-cache\" is not kvsnap-prefix-cache"},
        std::pair{at + 3, "metadata \"format\" is missing"}}) {
    std::string bytes = saved;
    bytes[flipped] = static_cast<char>(bytes[flipped] ^ 3);
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << bytes;
    expect_rejected(std::string(said) +
                    ", or the file is damaged: its checksum does not match either");
  }
}

// A KV layer's snapshot of tokens [from, from + length): one head, two values a token.
SnapshotPtr kv_range(int64_t from, int64_t length) {
  return detail::make_kv_snapshot(Array::zeros(DType::f32, {1, 1, length, 2}),
                                  Array::zeros(DType::f32, {1, 1, length, 2}), from);
}

// A trie of one KV layer, built as a load builds one (add_child checks nothing): [0, 2) of
// tokens 1 2, under it [2, 4) of 3 4 (left) and of 5 6 (right); beside it [0, 1) of 7.
struct SmallTrie {
  KVCache kv;
  detail::Trie trie{{detail::LayerInfo{&kv, kv.restore_rule()}}};
  int64_t used = 0;
  detail::Node* head = &add(trie.root(), {1, 2});
  detail::Node* left = &add(*head, {3, 4});
  detail::Node* right = &add(*head, {5, 6});
  detail::Node* beside = &add(trie.root(), {7});

  detail::Node& add(detail::Node& parent, std::vector<int32_t> edge) {
    std::vector<SnapshotPtr> snapshots;
    snapshots.push_back(kv_range(parent.end, static_cast<int64_t>(edge.size())));
    return trie.add_child(parent, std::move(edge), std::move(snapshots), false, ++used);
  }
};

TEST(TrieInvariants, ASoundTrieHasNoProblem) {
  SmallTrie small;
  EXPECT_EQ(small.trie.check_invariants(), "");
  EXPECT_EQ(small.trie.node_count(), 4);
}

// What a load would build from a file with siblings that share a first token, unchecked.
TEST(TrieInvariants, SiblingsThatShareAFirstTokenAreReported) {
  SmallTrie small;
  small.add(*small.head, {3, 9});
  EXPECT_EQ(small.trie.check_invariants(), "siblings under offset 2 share first token 3");
}

TEST(TrieInvariants, AnEdgeThatDoesNotStartWhereItsParentEndsIsReported) {
  SmallTrie small;
  small.left->edge.push_back(9);  // [1, 4) now, its parent ending at 2
  EXPECT_EQ(small.trie.check_invariants(), "node [1, 4) does not start where its parent ends (2)");
  small.left->edge.pop_back();
  EXPECT_EQ(small.trie.check_invariants(), "");
}

TEST(TrieInvariants, AKVSnapshotOfOtherTokensThanItsNodeIsReported) {
  SmallTrie small;
  SnapshotPtr shifted = kv_range(3, 2);  // as large as the right node's own, one token later
  std::swap(small.right->snapshots[0], shifted);
  EXPECT_EQ(small.trie.check_invariants(), "layer 0 snapshot [3, 5) does not span node [2, 4)");
  std::swap(small.right->snapshots[0], shifted);
  EXPECT_EQ(small.trie.check_invariants(), "");
}

TEST(TrieInvariants, AWrongParentAndAnEmptyEdgeAreReported) {
  SmallTrie small;
  small.left->parent = small.right;
  EXPECT_EQ(small.trie.check_invariants(), "node [2, 4) has a wrong parent");
  small.left->parent = small.head;
  EXPECT_EQ(small.trie.check_invariants(), "");
  small.trie.add_child(small.trie.root(), {}, {}, false, 0);
  EXPECT_EQ(small.trie.check_invariants(), "node ending at 0 has an empty edge");
}

// A snapshot taken off a node behind the trie's back (not through detach): the byte counter
// still counts it.
TEST(TrieInvariants, AByteCounterOffTheSnapshotsIsReported) {
  SmallTrie small;
  const int64_t bytes = small.trie.bytes();
  SnapshotPtr taken = std::move(small.left->snapshots[0]);
  ASSERT_GT(taken->size(), 0);
  EXPECT_EQ(small.trie.check_invariants(),
            fmt::format("byte counter {} differs from the sum of snapshot sizes {}", bytes,
                        bytes - taken->size()));
  small.left->snapshots[0] = std::move(taken);
  EXPECT_EQ(small.trie.check_invariants(), "");
}

// A leaf's last use changed without re-entering it in the eviction order.
TEST(TrieInvariants, ALeafMissingFromTheEvictionOrderIsReported) {
  SmallTrie small;
  const int64_t used = small.left->last_used;
  small.left->last_used = 100;
  EXPECT_EQ(small.trie.check_invariants(), "leaf [2, 4) is missing from the eviction order");
  small.left->last_used = used;
  EXPECT_EQ(small.trie.check_invariants(), "");
}

}  // namespace
}  // namespace kvsnap::trie_file_forged_test
