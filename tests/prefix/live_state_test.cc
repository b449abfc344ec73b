// LiveState, the prefix cache's record of what a slot's live caches hold: the active path it
// finds for them, and pointing that path's KV ranges at the live caches.
#include "prefix/live_state.h"

#include <gtest/gtest.h>
#include <kvsnap/kv_cache.h>
#include <kvsnap/rotating_kv_cache.h>

#include <cstdint>
#include <vector>

#include "prefix/trie.h"
#include "support/cache_support.h"

namespace kvsnap::live_state_test {
namespace {

using testing::column_ids;
using testing::id_range;
using testing::TokenKV;

std::vector<int32_t> ids32(const std::vector<int64_t>& ids) { return {ids.begin(), ids.end()}; }

// The live caches hold a prompt that ends inside another prompt's node and leaves its edge
// before its end (the prompt's own nodes were never inserted: its captures were lost). That node
// is not on the active path: repointing must not split it at the prompt's end and point its head
// at the live caches, which hold this prompt's tokens where the node's edge has the other's.
TEST(LiveState, ANodeThePromptLeavesIsNotOnTheActivePath) {
  KVCache kv;
  detail::Trie trie({detail::LayerInfo{&kv, kv.restore_rule()}});
  const TokenKV tags;
  // The other prompt: 80 shared tokens, then 40 of its own; its node holds its keys and values.
  std::vector<int64_t> other = id_range(100, 80), own = id_range(500, 40);
  other.insert(other.end(), own.begin(), own.end());
  testing::write(kv, tags, other);
  std::vector<SnapshotPtr> ranged;
  ranged.push_back(kv.snapshot(0));
  detail::Node& node =
      trie.insert(ids32(other), 0, 120, std::move(ranged), std::vector<SnapshotPtr>(1), false);
  // This prompt: the 80 shared tokens, then 20 of its own over the other's (copied out first).
  ASSERT_TRUE(kv.restore(nullptr, 80));
  testing::write(kv, tags, id_range(700, 20));
  std::vector<int64_t> prompt = id_range(100, 80), mine = id_range(700, 20);
  prompt.insert(prompt.end(), mine.begin(), mine.end());

  detail::LiveState live(trie, 0);
  live.set_tokens(ids32(prompt));
  EXPECT_TRUE(live.active_path().empty());  // the node's edge leaves the prompt at 80
  EXPECT_FALSE(live.on_active_path(node));
  live.repoint_ranges();
  EXPECT_EQ(trie.check_invariants(), "");
  // The trie still gives back the other prompt's keys and values.
  const detail::Trie::Match match = trie.match(ids32(other));
  ASSERT_EQ(match.length, 120);
  KVCache fresh;
  for (detail::Node* n : match.path) ASSERT_TRUE(fresh.restore(n->snapshots[0].get(), n->end));
  EXPECT_EQ(column_ids(fresh.view(Batch{})), other);
}

// A prompt that follows a node's edge to its own end, inside the node, does stand on it: the
// node is split there and its head points at the live caches (lazily: no bytes of its own).
TEST(LiveState, ANodeThePromptFollowsIsSplitAtItsEnd) {
  KVCache kv;
  detail::Trie trie({detail::LayerInfo{&kv, kv.restore_rule()}});
  const TokenKV tags;
  const std::vector<int64_t> other = id_range(100, 120);
  testing::write(kv, tags, other);
  std::vector<SnapshotPtr> ranged;
  ranged.push_back(kv.snapshot(0));
  (void)trie.insert(ids32(other), 0, 120, std::move(ranged), std::vector<SnapshotPtr>(1), false);
  ASSERT_TRUE(kv.restore(nullptr, 100));
  detail::LiveState live(trie, 0);
  live.set_tokens(ids32(id_range(100, 100)));
  ASSERT_EQ(live.active_path().size(), 1u);
  live.repoint_ranges();
  EXPECT_EQ(trie.check_invariants(), "");
  ASSERT_EQ(live.active_path().size(), 1u);
  EXPECT_EQ(live.active_path().front()->end, 100);
}

// Pointing an active path's ranges at the live caches again changes no restore plan: the trie's
// version stays, so a begin waiting for the trie to settle after its eviction (which repoints
// whenever leaves alone cannot meet the budget) is not sent round again for nothing (every such
// begin evicted three times, and switched with a plan it had not reserved for). Replacing a
// whole-state snapshot, or dropping one, does change it.
TEST(LiveState, RepointingRangesChangesNoVersion) {
  KVCache kv;
  RotatingKVCache state(8);
  detail::Trie trie(
      {detail::LayerInfo{&kv, kv.restore_rule()}, detail::LayerInfo{&state, state.restore_rule()}});
  const TokenKV tags;
  const std::vector<int64_t> prompt = id_range(100, 40);
  testing::write(kv, tags, prompt);
  testing::write(state, tags, prompt);
  std::vector<SnapshotPtr> ranged(2), whole(2);
  ranged[0] = kv.snapshot(0);
  whole[1] = state.snapshot(0, 0);
  detail::Node& node =
      trie.insert(ids32(prompt), 0, 40, std::move(ranged), std::move(whole), false);
  detail::LiveState live(trie, 0);
  live.set_tokens(ids32(prompt));
  const uint64_t version = trie.version();
  live.repoint_ranges();
  live.repoint_ranges();
  EXPECT_EQ(trie.version(), version);
  EXPECT_EQ(trie.check_invariants(), "");
  EXPECT_EQ(node.snapshots[0]->size(), 0);  // lazy over the live cache: it was repointed
  trie.replace(node, 1, state.snapshot(0, 0));
  EXPECT_NE(trie.version(), version);
  const uint64_t replaced = trie.version();
  trie.replace(node, 1, nullptr);
  EXPECT_NE(trie.version(), replaced);
}

}  // namespace
}  // namespace kvsnap::live_state_test
