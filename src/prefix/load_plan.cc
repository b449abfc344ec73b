// Which of a saved trie's nodes a load keeps (load_plan.h): the trie's eviction replayed on the
// node table, O(n log n) in time and O(n) in memory.
#include "prefix/load_plan.h"

#include <algorithm>
#include <set>
#include <tuple>

namespace kvsnap::detail {

LoadPlan plan_load(const std::vector<PlannedNode>& nodes, int64_t budget) {
  const auto n = static_cast<int64_t>(nodes.size());
  LoadPlan plan{std::vector<bool>(nodes.size(), false), 0};
  int64_t total = 0;
  for (const PlannedNode& node : nodes) total += node.bytes;
  if (total <= budget) return plan;

  // Each node as the eviction finds it: merges move a parent's tokens, bytes and last use into
  // its only child, which stands in its place (`parent` is then the merged parent's parent).
  struct Live {
    int64_t parent, last_used, bytes, children = 0;
  };
  std::vector<Live> live;
  live.reserve(nodes.size());
  for (const PlannedNode& node : nodes) live.push_back({node.parent, node.last_used, node.bytes});
  // The node each one was merged into (always a descendant: a later index), -1 for none: it is
  // evicted with that one.
  std::vector<int64_t> into(nodes.size(), -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = live[static_cast<size_t>(i)].parent;
    if (p >= 0) ++live[static_cast<size_t>(p)].children;
  }
  // Children counts alone do not say which child is left: kept per parent as the sum of its
  // children's indices, less each one removed (the last one left is what remains).
  std::vector<int64_t> child_sum(nodes.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = live[static_cast<size_t>(i)].parent;
    if (p >= 0) child_sum[static_cast<size_t>(p)] += i;
  }
  using Key = std::tuple<bool, int64_t, int64_t>;  // user, last use, file order
  std::set<Key> leaves;
  const auto key = [&](int64_t i) {
    return Key{nodes[static_cast<size_t>(i)].user, live[static_cast<size_t>(i)].last_used, i};
  };
  for (int64_t i = 0; i < n; ++i) {
    if (live[static_cast<size_t>(i)].children == 0) leaves.insert(key(i));
  }
  // Trie::merge_into_child of `p`, left with one child.
  const auto merge = [&](int64_t p) {
    const PlannedNode& node = nodes[static_cast<size_t>(p)];
    Live& parent = live[static_cast<size_t>(p)];
    if (node.user || node.restore_point || parent.children != 1) return;
    const int64_t c = child_sum[static_cast<size_t>(p)];
    Live& only = live[static_cast<size_t>(c)];
    const bool leaf = only.children == 0;
    if (leaf) leaves.erase(key(c));
    only.bytes += parent.bytes;
    only.last_used = std::max(only.last_used, parent.last_used);
    into[static_cast<size_t>(p)] = c;
    only.parent = parent.parent;
    if (only.parent >= 0) child_sum[static_cast<size_t>(only.parent)] += c - p;
    if (leaf) leaves.insert(key(c));
  };
  while (total > budget && !leaves.empty()) {
    const int64_t victim = std::get<2>(*leaves.begin());
    leaves.erase(leaves.begin());
    Live& gone = live[static_cast<size_t>(victim)];
    ++plan.evicted;
    total -= gone.bytes;
    plan.doomed[static_cast<size_t>(victim)] = true;
    const int64_t p = gone.parent;
    if (p < 0) continue;
    Live& parent = live[static_cast<size_t>(p)];
    --parent.children;
    child_sum[static_cast<size_t>(p)] -= victim;
    if (parent.children == 0) {
      leaves.insert(key(p));
    } else {
      merge(p);
    }
  }
  // A merged node goes with the one it was merged into (later in the file: decided first).
  for (int64_t i = n - 1; i >= 0; --i) {
    const int64_t c = into[static_cast<size_t>(i)];
    if (c >= 0) plan.doomed[static_cast<size_t>(i)] = plan.doomed[static_cast<size_t>(c)];
  }
  return plan;
}

}  // namespace kvsnap::detail
