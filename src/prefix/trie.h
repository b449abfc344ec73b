// Internal: the compressed token trie of PrefixCache and its snapshot bookkeeping.
//
// Invariants: sibling edges never share a first token; a node's KV snapshots span exactly its
// edge [start, end); whole-state snapshots hold the state at its end; `bytes()` equals the sum
// of `size()` over every snapshot held (materialize hooks keep it exact).
//
// A node may lack a KV snapshot: a split or merge that ran out of memory consumed it (see
// Cache::split). Restores stop at such a gap (restore_limit), saves leave out what lies at
// and below it, and an insert of the same tokens fills it again.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "kvsnap/cache.h"

namespace kvsnap::detail {

// Length of the longest common prefix of two token sequences.
int64_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b);

// The bytes a trie's snapshots own and the most they have been since the last reset_peak:
// materialize hooks add to both from any thread.
struct ByteCount {
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> peak{0};
  void add(int64_t delta) noexcept {
    raise_peak(bytes.fetch_add(delta, std::memory_order_relaxed) + delta);
  }
  // The peak starts again from the bytes now. A hook's add running meanwhile is never lost: the
  // peak is raised to the bytes read after the store.
  void reset_peak() noexcept {
    peak.store(bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
    raise_peak(bytes.load(std::memory_order_relaxed));
  }
  void raise_peak(int64_t now) noexcept {
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
};

struct Node;
// Leaves in eviction order: (user, last use, node).
using LeafOrder = std::set<std::tuple<bool, int64_t, Node*>>;

struct Node {
  Node* parent = nullptr;
  std::vector<int32_t> edge;  // tokens [start(), end)
  int64_t end = 0;
  std::vector<std::unique_ptr<Node>> children;
  std::vector<SnapshotPtr> snapshots;  // one slot per layer
  int64_t last_used = 0;
  bool user = false;
  // The eviction pass that found the node on a slot's active path (see evict_to_budget): a
  // pass marks the paths once, then asks of each node in constant time.
  uint64_t pinned_in = 0;
  // The node's entry in the eviction order, allocated with the node and held here while the
  // node is not a leaf: entering and leaving the order never allocates, so no change to the
  // trie fails halfway for lack of memory there. Empty for the root, which is never a leaf.
  LeafOrder::node_type order_entry;

  Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;
  // Frees the subtree without recursing (a trie may be a chain as deep as it has nodes: every
  // restore point of a long conversation, or a file's) and without allocating (it walks down
  // and back up through the parent links): each node's snapshots before its children's, as a
  // recursive destruction would.
  ~Node();

  int64_t start() const { return end - static_cast<int64_t>(edge.size()); }
};

// What a layer is, for planning: stateless, ranged (KV) or whole state with a rewind limit.
struct LayerInfo {
  Cache* cache = nullptr;  // null: stateless
  RestoreRule rule;
  bool ranged() const { return cache != nullptr && rule.kind == RestoreRule::Kind::ranges; }
  bool whole_state() const {
    return cache != nullptr && rule.kind == RestoreRule::Kind::whole_state;
  }
};

class Trie {
 public:
  explicit Trie(std::vector<LayerInfo> layers);
  ~Trie();
  Trie(const Trie&) = delete;
  Trie& operator=(const Trie&) = delete;

  Node& root() { return root_; }
  const std::vector<LayerInfo>& layers() const { return layers_; }
  // Bytes the trie's snapshots own (materialize hooks add to it from any thread).
  int64_t bytes() const { return bytes_->bytes.load(std::memory_order_relaxed); }
  // The most bytes() has been since the trie was made or reset_peak() last ran.
  int64_t peak_bytes() const { return bytes_->peak.load(std::memory_order_relaxed); }
  void reset_peak() { bytes_->reset_peak(); }
  int64_t recount_bytes() const;
  int64_t node_count() const { return node_count_; }
  // Changes whenever a node or a snapshot is added, removed, replaced or used — except a KV
  // range replaced by another (replace), which changes no restore plan.
  uint64_t version() const { return version_; }
  // A number no earlier call returned, never 0: an eviction pass's mark (Node::pinned_in).
  uint64_t new_pass() { return ++passes_; }
  // A fresh last-use time, later than every earlier one.
  int64_t tick() { return ++clock_; }
  // Marks `node` used now.
  void touch(Node& node);

  struct Match {
    std::vector<Node*> path;  // nodes entered, the last possibly only partly matched
    int64_t length = 0;       // tokens matched
  };
  Match match(std::span<const int32_t> tokens);
  // The deepest offset a restore for a prompt of `prompt_length` tokens may plan along `found`:
  // within the match, before the first node that lacks a KV snapshot (a gap), and leaving one
  // prompt token to evaluate.
  int64_t restore_limit(const Match& found, int64_t prompt_length) const;
  // Whether `node` lacks one of its KV snapshots (a gap).
  bool lacks_range(const Node& node) const;

  // Makes the path tokens[0, to) exist, splitting nodes where it diverges, and returns the node
  // ending at `to`. `ranged[i]` holds layer i's KV data for [from, to) (or null): it fills the
  // edges of new nodes; the parts covering existing nodes are dropped. `whole[i]` is layer
  // i's state at `to`, kept if the node has none. Requires the path [0, from) to exist.
  Node& insert(std::span<const int32_t> tokens, int64_t from, int64_t to,
               std::vector<SnapshotPtr> ranged, std::vector<SnapshotPtr> whole, bool user);

  // Swaps layer `layer`'s snapshot of `node` for `replacement` (accounting for both). A ranged
  // layer's snapshot replaced by a non-null one must hold the same tokens.
  void replace(Node& node, size_t layer, SnapshotPtr replacement);

  // Splits `node` at `at` (start < at < end); returns the new upper node, [start, at). `node`
  // keeps [at, end), its children, user flag and whole-state snapshots. When splitting a
  // layer's snapshot fails (it is consumed), the split still completes, without that layer's
  // halves, and then the failure is rethrown.
  Node& split(Node& node, int64_t at);

  // Removes leaf `node` and its snapshots; merges its parent into a lone remaining child when
  // that loses nothing (see merge_into_child). `keep(n)` protects nodes from merging.
  void remove_leaf(Node& node, const std::function<bool(const Node&)>& keep);

  // The leaf to evict first — non-user leaves before user ones, each least recently used
  // first — skipping those `keep` protects; null when none is left. O(log n) per leaf looked at.
  Node* eviction_candidate(const std::function<bool(const Node&)>& keep) const;
  // Every node but the root, parents before children.
  void preorder(std::vector<const Node*>& out) const;

  // Removes every node (and its snapshots), allocating nothing.
  void clear() noexcept;
  // Appends a child of `parent` as loaded from a file (no invariant checks beyond accounting).
  Node& add_child(Node& parent, std::vector<int32_t> edge, std::vector<SnapshotPtr> snapshots,
                  bool user, int64_t last_used);
  // Replaces every node by `fresh`'s (a trie of the same layers, built aside), leaving it
  // empty: nothing is allocated, so a load that fails while building leaves this trie whole.
  void take_nodes(Trie& fresh) noexcept;
  int64_t clock() const { return clock_; }
  void set_clock(int64_t clock) { clock_ = clock; }

  std::string debug_string() const;
  // Empty when every invariant holds, else the first violation found.
  std::string check_invariants() const;

 private:
  // Checks node's children (not further down).
  void check_children(const Node& node, std::string& problem) const;
  void attach(Node& node, size_t layer, SnapshotPtr snapshot);
  SnapshotPtr detach(Node& node, size_t layer);
  // Joins a non-user node with its only child when no whole-state snapshot (a restore point)
  // would be lost and every KV range is present.
  void merge_into_child(Node& node, const std::function<bool(const Node&)>& keep);
  Node* child(Node& node, int32_t first);
  SnapshotPtr drop_front(size_t layer, SnapshotPtr snapshot, int64_t at);
  void dump_node(const Node& node, int depth, std::string& out) const;
  // The leaves, in eviction order; every change to a node's children, user flag or last use
  // goes through these two.
  void unindex(Node& node);
  void index(Node& node);

  std::unique_ptr<Node> new_node() const;

  std::vector<LayerInfo> layers_;
  Node root_;
  // Its own allocation, which the snapshots' materialize hooks point at: take_nodes hands it
  // over with the nodes instead of re-pointing every hook.
  std::unique_ptr<ByteCount> bytes_ = std::make_unique<ByteCount>();
  int64_t node_count_ = 0;
  int64_t clock_ = 0;
  uint64_t version_ = 0;
  uint64_t passes_ = 0;
  LeafOrder leaves_;
};

}  // namespace kvsnap::detail
