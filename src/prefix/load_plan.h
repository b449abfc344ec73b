// Internal: which of a saved trie's nodes a load under a budget keeps, decided from the file's
// node table before any snapshot's data is read — the nodes the eviction that follows a load
// (evict_to_budget, nothing live) would remove are never read (trie_file.cc).
#pragma once

#include <cstdint>
#include <vector>

namespace kvsnap::detail {

// A node as the file lists it: parents before children.
struct PlannedNode {
  int64_t parent = -1;  // an earlier node, -1 for the root
  bool user = false;
  int64_t last_used = 0;
  int64_t bytes = 0;  // its snapshots' sizes
  // Whether it holds a whole-state snapshot (a restore point: Trie::merge_into_child keeps it
  // apart from its child).
  bool restore_point = false;
};

struct LoadPlan {
  std::vector<bool> doomed;  // per node: removed by the eviction (never read)
  int64_t evicted = 0;       // leaves the eviction removes (as evicted_nodes counts them)
};

// Evicts leaves from a trie of `nodes` until its bytes are at most `budget`, as evict_to_budget
// does with no slot live: non-user leaves before user ones, each least recently used first (ties
// in file order), a parent left with one child merged into it when Trie::merge_into_child would
// (not a user node, no restore point; every KV range is present in a file) — the child then
// carries the parent's bytes and the later of their last uses, and whatever is evicted with it.
// O(n log n) time, O(n) memory (a file lists up to hundreds of thousands of nodes).
LoadPlan plan_load(const std::vector<PlannedNode>& nodes, int64_t budget);

}  // namespace kvsnap::detail
