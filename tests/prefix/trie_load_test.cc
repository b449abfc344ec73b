// A load under a budget reads only the nodes the budget keeps (read_trie_file, plan_load). The
// trie it builds must be the one a load of every node builds once the eviction that follows has
// run (the old load, kept here as the reference: decode_trie, build_trie, evict_to_budget), node
// for node — ranges, flags, last uses, snapshots and bytes — and it must never have held more
// than it keeps. Over random conversation trees of the hybrid stack (KV or paged attention, a
// window, a recurrent layer), at budgets from nothing to everything.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvsnap/kv_cache.h>
#include <kvsnap/prefix_cache.h>
#include <kvsnap/recurrent_cache.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <random>

#include "cache/snapshot_record.h"
#include "persist/files.h"
#include "prefix/live_state.h"
#include "prefix/load_plan.h"
#include "prefix/trie_file.h"
#include "support/conversation.h"

namespace kvsnap::trie_load_test {
namespace {

using testing::HybridStack;
using testing::Tokens;
using testing::operator+;

std::vector<detail::LayerInfo> layer_infos(const std::vector<Cache*>& caches) {
  std::vector<detail::LayerInfo> out;
  for (Cache* cache : caches)
    out.push_back({cache, cache != nullptr ? cache->restore_rule() : RestoreRule{}});
  return out;
}

// Every node, parents before children: its range, flags, last use and each layer's snapshot.
std::string describe(const detail::Trie& trie) {
  std::vector<const detail::Node*> nodes;
  trie.preorder(nodes);
  std::string out = fmt::format("{} nodes, {} bytes\n", trie.node_count(), trie.bytes());
  for (const detail::Node* node : nodes) {
    out += fmt::format("[{}, {}) user {} used {}:", node->start(), node->end, node->user,
                       node->last_used);
    for (const SnapshotPtr& s : node->snapshots) {
      out += s == nullptr ? std::string(" -")
                          : fmt::format(" [{}, {}) {}B", s->from(), s->to(), s->size());
    }
    out += "\n";
  }
  return out;
}

// A cache that served `turns` random requests: new conversations on shared system prompts,
// continuations, regenerations and edits, over a small vocabulary half of the time, some with
// a user restore point.
void grow(PrefixCache& cache, HybridStack& stack, uint32_t seed, int turns) {
  std::mt19937 rng(seed);
  const auto below = [&](size_t n) { return n == 0 ? size_t{0} : rng() % n; };
  int32_t next = 1000;
  const auto fresh = [&](size_t min, size_t max) {
    Tokens out(min + below(max - min + 1));
    const bool small = rng() % 2 == 0;
    for (int32_t& t : out) t = small ? 1 + static_cast<int32_t>(below(5)) : next++;
    return out;
  };
  std::vector<Tokens> seen;
  for (int t = 0; t < turns && !::testing::Test::HasFailure(); ++t) {
    Tokens prompt;
    if (seen.empty() || rng() % 4 == 0) {
      prompt = (rng() % 2 == 0 ? testing::tokens(100, 9) : Tokens{7}) + fresh(1, 8);
    } else {
      const Tokens& base = seen[below(seen.size())];
      const size_t cut = 1 + below(base.size());
      prompt = Tokens(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(cut)) + fresh(0, 6);
      if (prompt.size() == base.size() && rng() % 2 == 0) prompt = prompt + fresh(1, 3);
    }
    std::vector<int64_t> marks;  // a user restore point at the prompt's end
    if (rng() % 2 == 0) marks.push_back(static_cast<int64_t>(prompt.size()));
    const Tokens reply = fresh(1, 4);
    testing::run_turn(cache, stack, prompt, reply, marks);
    seen.push_back(prompt + reply);
  }
}

// plan_load against the trie's own eviction, over random trie shapes built directly (the
// conversations above rarely leave a user leaf beside a newer one, where a merged node's later
// last use decides what goes next): random parents, edge lengths (the sizes), user flags,
// restore points (a recurrent snapshot), distinct last uses (ties go by address in the trie), and
// random budgets. The same nodes must go: a node survives when its whole path still matches.
TEST(PlanLoad, EvictsWhatTheTrieEvicts) {
  KVCache kv;
  RecurrentCache recurrent(RecurrentCache::Dims{});
  const std::vector<detail::LayerInfo> layers = layer_infos({&kv, &recurrent});
  int64_t merged = 0;
  testing::for_each_seed(300, [&](uint32_t seed) {
    std::mt19937 rng(seed);
    const auto below = [&](int64_t n) { return static_cast<int64_t>(rng() % n); };
    const int64_t n = 1 + below(30);
    std::vector<int64_t> used(static_cast<size_t>(n));
    std::iota(used.begin(), used.end(), 1);
    std::shuffle(used.begin(), used.end(), rng);
    detail::Trie trie(layers);
    std::vector<detail::Node*> made;
    std::vector<detail::PlannedNode> planned;
    std::vector<Tokens> paths;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t parent = below(i + 1) - 1;
      detail::Node& above = parent < 0 ? trie.root() : *made[static_cast<size_t>(parent)];
      Tokens edge(static_cast<size_t>(1 + below(4)));
      for (size_t k = 0; k < edge.size(); ++k) edge[k] = static_cast<int32_t>(i * 10 + k);
      const int64_t start = above.end, end = start + static_cast<int64_t>(edge.size());
      std::vector<SnapshotPtr> snapshots(2);
      snapshots[0] =
          detail::make_kv_snapshot(Array::zeros(DType::f32, {1, 1, end - start, 2}),
                                   Array::zeros(DType::f32, {1, 1, end - start, 2}), start);
      const bool restore_point = below(3) == 0;
      if (restore_point) {
        snapshots[1] = detail::make_recurrent_snapshot(Array::zeros(DType::f32, {1, 0, 1}),
                                                       Array::zeros(DType::f32, {1, 1, 1, 1}), end);
      }
      const bool user = below(4) == 0;
      int64_t bytes = 0;
      for (const SnapshotPtr& snapshot : snapshots) bytes += snapshot ? snapshot->size() : 0;
      planned.push_back({parent, user, used[static_cast<size_t>(i)], bytes, restore_point});
      paths.push_back((parent < 0 ? Tokens{} : paths[static_cast<size_t>(parent)]) + edge);
      made.push_back(&trie.add_child(above, std::move(edge), std::move(snapshots), user,
                                     used[static_cast<size_t>(i)]));
    }
    const int64_t budget = below(trie.bytes() + 2);
    const detail::LoadPlan plan = detail::plan_load(planned, budget);
    const int64_t before = trie.node_count();
    int64_t evicted = 0, dropped = 0;
    uint64_t futile = ~uint64_t{0};
    detail::evict_to_budget(trie, {}, budget, evicted, dropped, false, futile);
    EXPECT_EQ(plan.evicted, evicted) << "seed " << seed;
    merged += before - evicted - trie.node_count();
    int64_t kept_bytes = 0;
    for (int64_t i = 0; i < n; ++i) {
      const Tokens& path = paths[static_cast<size_t>(i)];
      const bool survives = trie.match(path).length == static_cast<int64_t>(path.size());
      EXPECT_EQ(!plan.doomed[static_cast<size_t>(i)], survives) << "seed " << seed << " node " << i;
      if (!plan.doomed[static_cast<size_t>(i)]) kept_bytes += planned[static_cast<size_t>(i)].bytes;
    }
    EXPECT_EQ(kept_bytes, trie.bytes()) << "seed " << seed;
  });
  EXPECT_GT(merged, 100);  // merges ran, often
}

// A long conversation regenerated at every turn, the oldest alternatives evicted first: each
// eviction merges the chain's head into the next node down, so the last node comes to carry
// every one above it. Planned in linear memory (a list of carried nodes per node copied along
// the chain had taken n^2 / 2 entries: ~10^10 here).
TEST(PlanLoad, AChainOfMergesIsPlannedInLinearMemory) {
  constexpr int64_t kChain = 100'000;
  std::vector<detail::PlannedNode> nodes;  // x0, then x_i and b_i (both children of x_{i-1})
  std::vector<int64_t> chain{0};
  nodes.push_back({-1, false, 2 * kChain, 1, false});
  for (int64_t i = 1; i < kChain; ++i) {
    const int64_t parent = chain.back();
    chain.push_back(static_cast<int64_t>(nodes.size()));
    nodes.push_back({parent, false, 2 * kChain + i, 1, false});  // x_i: used after every b
    nodes.push_back({parent, false, i, 1, false});               // b_i: the older, the higher up
  }
  detail::LoadPlan plan = detail::plan_load(nodes, kChain);  // every b goes
  EXPECT_EQ(plan.evicted, kChain - 1);
  for (size_t i = 0; i < nodes.size(); ++i) {
    const bool branch = i > 0 && nodes[i].last_used < 2 * kChain;
    ASSERT_EQ(plan.doomed[i], branch) << i;
  }
  plan = detail::plan_load(nodes, kChain - 1);  // and then the chain, merged into its last node
  EXPECT_EQ(plan.evicted, kChain);
  EXPECT_TRUE(std::all_of(plan.doomed.begin(), plan.doomed.end(), [](bool d) { return d; }));
}

class TrieLoad : public ::testing::TestWithParam<bool> {};

TEST_P(TrieLoad, KeepsWhatTheEvictionAfterAWholeLoadKeepsAndReadsNothingMore) {
  const bool paged = GetParam();
  const std::string dir = (std::filesystem::temp_directory_path() /
                           fmt::format("kvsnap_trie_load_{}_{}", ::getpid(), paged))
                              .string();
  const detail::PrivacyRule rule{.call = "TrieLoad", .override_with = ""};
  int64_t compared = 0, evicting = 0;
  testing::for_each_seed(6, [&](uint32_t seed) {
    std::filesystem::remove_all(dir);
    HybridStack stack(testing::StackOptions{.paged = paged});
    {
      PrefixCache cache(stack.layers());
      grow(cache, stack, seed, 20);
      cache.save(dir, "m");
    }
    const std::vector<detail::LayerInfo> layers = layer_infos(stack.layers());
    const std::string path = dir + "/prefix_cache.safetensors";
    const std::string bytes = detail::read_file(path);
    const int64_t total =
        detail::build_trie(layers, detail::decode_trie(bytes, "t", layers, "m"))->bytes();
    std::mt19937 rng(seed);
    std::vector<int64_t> budgets{0, 1, total / 4, total / 2, total - 1, total, total + 1};
    for (int i = 0; i < 6; ++i) budgets.push_back(static_cast<int64_t>(rng() % (total + 1)));
    for (const int64_t budget : budgets) {
      // The reference: every node built, then evicted as the load's eviction evicts.
      const std::unique_ptr<detail::Trie> whole =
          detail::build_trie(layers, detail::decode_trie(bytes, "t", layers, "m"));
      int64_t evicted = 0, dropped = 0;
      uint64_t futile = ~uint64_t{0};
      detail::evict_to_budget(*whole, {}, budget, evicted, dropped, false, futile);
      EXPECT_EQ(dropped, 0);
      // Only the nodes the budget keeps, read: an array for each of their tensors and the
      // edges, none for the others'.
      const int64_t allocations = allocation_count();
      detail::LoadedTrie loaded = detail::read_trie(
          [&](const detail::TensorFilter& keep) {
            return detail::read_sealed_file(path, rule, detail::loadable_bytes(), keep);
          },
          path, layers, "m", {}, budget);
      int64_t snapshots = 0;
      for (const detail::LoadedNode& node : loaded.nodes) {
        for (const SnapshotPtr& s : node.snapshots) snapshots += s != nullptr ? 1 : 0;
      }
      EXPECT_LE(allocation_count() - allocations, 2 * snapshots + 1) << "budget " << budget;
      EXPECT_EQ(loaded.evicted, evicted) << "budget " << budget;
      const std::unique_ptr<detail::Trie> kept = detail::build_trie(layers, std::move(loaded));
      EXPECT_EQ(describe(*kept), describe(*whole)) << "budget " << budget << " of " << total;
      EXPECT_EQ(kept->check_invariants(), "");
      EXPECT_EQ(kept->bytes(), kept->recount_bytes());
      EXPECT_LE(kept->bytes(), budget);
      // Never more than it keeps (the whole load held every node first).
      EXPECT_EQ(kept->peak_bytes(), kept->bytes()) << "budget " << budget;
      ++compared;
      if (evicted > 0) ++evicting;
    }
    std::filesystem::remove_all(dir);
  });
  EXPECT_GT(evicting, compared / 2);  // most budgets evicted something
}
INSTANTIATE_TEST_SUITE_P(AttentionStorage, TrieLoad, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "paged" : "contiguous"; });

}  // namespace
}  // namespace kvsnap::trie_load_test
