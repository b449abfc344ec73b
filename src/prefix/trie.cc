#include "prefix/trie.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>

#include "cache/state_snapshot.h"

namespace kvsnap::detail {
int64_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

Trie::Trie(std::vector<LayerInfo> layers) : layers_(std::move(layers)) {
  root_.snapshots.resize(layers_.size());
}

// Snapshots unlink from their caches as they go; the hooks they hold point at the byte counter,
// so clear() takes them off first in case a cache materializes something during teardown.
Trie::~Trie() { clear(); }

namespace {
// Frees `top`'s descendants without recursing and without allocating: down to the last child of
// the last child ..., then back up through the parent links. `going(node)` runs on each before
// its children (a node's snapshots go before its children's, as a recursive destruction would),
// the node itself goes once it has no children left.
template <class Going>
void free_descendants(Node& top, Going&& going) noexcept {
  Node* at = &top;
  while (true) {
    if (!at->children.empty()) {
      Node* last = at->children.back().get();
      if (last != nullptr) going(*last);  // null: moved out (a merge takes the only child first)
      if (last == nullptr || last->children.empty()) {
        at->children.pop_back();
      } else {
        at = last;
      }
      continue;
    }
    if (at == &top) return;
    at = at->parent;
  }
}

// Room for one more child, allocated before the trie changes: growing geometrically, as
// push_back would (reserving one more each time would move every child on every add).
void room_for_child(Node& node) {
  std::vector<std::unique_ptr<Node>>& children = node.children;
  if (children.size() == children.capacity()) {
    children.reserve(std::max<size_t>(2, 2 * children.capacity()));
  }
}
}  // namespace

std::unique_ptr<Node> Trie::new_node() const {
  auto node = std::make_unique<Node>();
  node->snapshots.resize(layers_.size());
  LeafOrder entry;
  entry.insert({false, 0, node.get()});
  node->order_entry = entry.extract(entry.begin());
  return node;
}

void Trie::unindex(Node& node) {
  ++version_;
  if (&node == &root_ || !node.children.empty()) return;
  if (LeafOrder::node_type entry = leaves_.extract({node.user, node.last_used, &node})) {
    node.order_entry = std::move(entry);
  }
}

void Trie::index(Node& node) {
  ++version_;
  if (&node == &root_ || !node.children.empty() || node.order_entry.empty()) return;
  node.order_entry.value() = {node.user, node.last_used, &node};
  leaves_.insert(std::move(node.order_entry));  // a node of its own: allocates nothing
}

void Trie::touch(Node& node) {
  unindex(node);
  node.last_used = tick();
  index(node);
}

Node* Trie::eviction_candidate(const std::function<bool(const Node&)>& keep) const {
  for (const auto& [user, last_used, node] : leaves_) {
    if (!keep(*node)) return node;
  }
  return nullptr;
}

void Trie::attach(Node& node, size_t layer, SnapshotPtr snapshot) {
  if (snapshot == nullptr) return;
  ++version_;
  // The hook and the size at one instant: a forward on another thread may be copying the
  // snapshot out right now.
  bytes_->add(
      hook_and_size(*snapshot, [counter = bytes_.get()](int64_t delta) { counter->add(delta); }));
  node.snapshots[layer] = std::move(snapshot);
}

SnapshotPtr Trie::detach(Node& node, size_t layer) {
  SnapshotPtr snapshot = std::move(node.snapshots[layer]);
  ++version_;
  if (snapshot != nullptr) bytes_->add(-hook_and_size(*snapshot, nullptr));
  return snapshot;
}

void Trie::replace(Node& node, size_t layer, SnapshotPtr replacement) {
  // A KV range swapped for another of the same tokens (repointed at a live cache) changes no
  // restore plan: the version stays, so a caller waiting for the trie to settle is not misled.
  const uint64_t version = version_;
  const bool same_range =
      layers_[layer].ranged() && node.snapshots[layer] != nullptr && replacement != nullptr;
  SnapshotPtr old = detach(node, layer);
  attach(node, layer, std::move(replacement));
  if (same_range) version_ = version;
}

Node* Trie::child(Node& node, int32_t first) {
  for (auto& c : node.children) {
    if (c->edge.front() == first) return c.get();
  }
  return nullptr;
}

Trie::Match Trie::match(std::span<const int32_t> tokens) {
  Match result;
  Node* node = &root_;
  while (result.length < static_cast<int64_t>(tokens.size())) {
    Node* next = child(*node, tokens[static_cast<size_t>(result.length)]);
    if (next == nullptr) break;
    const int64_t k = common_prefix(next->edge, tokens.subspan(static_cast<size_t>(result.length)));
    result.path.push_back(next);
    result.length += k;
    if (k < static_cast<int64_t>(next->edge.size())) break;
    node = next;
  }
  return result;
}

Node& Trie::split(Node& node, int64_t at) {
  // Everything the new node needs is allocated before the trie changes.
  std::unique_ptr<Node> upper = new_node();
  Node& u = *upper;
  const auto cut = static_cast<size_t>(at - node.start());
  u.edge.assign(node.edge.begin(), node.edge.begin() + static_cast<std::ptrdiff_t>(cut));
  u.end = at;
  u.parent = node.parent;
  u.last_used = node.last_used;
  u.children.reserve(1);
  std::exception_ptr failure;
  ++version_;  // the trie's shape changes, whatever the layers hold here
  for (size_t i = 0; i < layers_.size(); ++i) {
    // A layer with nothing here has nothing to split (Cache::split is not asked about null).
    if (layers_[i].cache == nullptr || node.snapshots[i] == nullptr) continue;
    // KV ranges split in two; whole-state snapshots stay with the lower (later) half. A split
    // that fails has consumed the snapshot: the layer is left without one here (a gap).
    try {
      auto [before, after] = layers_[i].cache->split(detach(node, i), at);
      attach(u, i, std::move(before));
      attach(node, i, std::move(after));
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  node.edge.erase(node.edge.begin(), node.edge.begin() + static_cast<std::ptrdiff_t>(cut));
  Node* parent = node.parent;
  auto slot = std::find_if(parent->children.begin(), parent->children.end(),
                           [&](const auto& c) { return c.get() == &node; });
  std::unique_ptr<Node> lower = std::move(*slot);
  lower->parent = &u;
  u.children.push_back(std::move(lower));
  *slot = std::move(upper);
  ++node_count_;
  if (failure) std::rethrow_exception(failure);
  return u;
}

SnapshotPtr Trie::drop_front(size_t layer, SnapshotPtr snapshot, int64_t at) {
  if (snapshot == nullptr || snapshot->from() >= at) return snapshot;
  return layers_[layer].cache->split(std::move(snapshot), at).second;
}

Node& Trie::insert(std::span<const int32_t> tokens, int64_t from, int64_t to,
                   std::vector<SnapshotPtr> ranged, std::vector<SnapshotPtr> whole, bool user) {
  ranged.resize(layers_.size());
  whole.resize(layers_.size());
  Node* node = &root_;
  int64_t position = 0;
  while (position < to) {
    Node* next = child(*node, tokens[static_cast<size_t>(position)]);
    if (next == nullptr) {
      if (position < from) {
        throw Error(
            fmt::format("PrefixCache: internal error: path [0, {}) missing from the trie "
                        "while inserting [{}, {})",
                        position, from, to));
      }
      // Everything allocated, the ranges cut to the leaf's edge, before the leaf is attached:
      // a failure here leaves the trie as it was.
      std::unique_ptr<Node> leaf = new_node();
      leaf->edge.assign(tokens.begin() + position, tokens.begin() + to);
      leaf->end = to;
      leaf->parent = node;
      room_for_child(*node);
      for (size_t i = 0; i < layers_.size(); ++i) {
        if (layers_[i].ranged()) ranged[i] = drop_front(i, std::move(ranged[i]), position);
      }
      for (size_t i = 0; i < layers_.size(); ++i) {
        if (layers_[i].ranged()) attach(*leaf, i, std::move(ranged[i]));
      }
      next = leaf.get();
      unindex(*node);
      node->children.push_back(std::move(leaf));
      index(*next);
      ++node_count_;
    } else {
      const int64_t k = common_prefix(
          next->edge,
          tokens.subspan(static_cast<size_t>(position), static_cast<size_t>(to - position)));
      if (k < static_cast<int64_t>(next->edge.size())) next = &split(*next, position + k);
      // An existing node inside [from, to): its own KV ranges stay; ours for it are dropped,
      // unless it lacks one.
      for (size_t i = 0; i < layers_.size(); ++i) {
        if (!layers_[i].ranged() || next->end <= from) continue;
        SnapshotPtr rest = drop_front(i, std::move(ranged[i]), next->start());
        if (rest == nullptr) continue;
        auto [covering, after] = layers_[i].cache->split(std::move(rest), next->end);
        const SnapshotPtr& existing = next->snapshots[i];
        // Keep ours when the node has none, or when ours is a lazy view of the live cache and
        // the node's holds (some) bytes of the same tokens: that gives those bytes back.
        if (covering != nullptr && covering->from() == next->start() &&
            (existing == nullptr || (existing->size() > 0 && covering->size() == 0))) {
          replace(*next, i, std::move(covering));
        }
        ranged[i] = std::move(after);
      }
    }
    node = next;
    position = node->end;
    touch(*node);
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!layers_[i].whole_state() || node == &root_ || whole[i] == nullptr) continue;
    const SnapshotPtr& existing = node->snapshots[i];
    if (existing == nullptr ||
        (existing->size() > 0 && whole[i]->size() == 0 && whole[i]->is_lazy())) {
      replace(*node, i, std::move(whole[i]));
    }
  }
  if (user && node != &root_) {
    unindex(*node);
    node->user = true;
    index(*node);
  }
  return *node;
}

void Trie::merge_into_child(Node& node, const std::function<bool(const Node&)>& keep) {
  if (&node == &root_ || node.user || node.children.size() != 1) return;
  Node& only = *node.children.front();
  if (keep(node) || keep(only)) return;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].whole_state() && node.snapshots[i] != nullptr) return;  // a restore point
    if (layers_[i].ranged() && (node.snapshots[i] == nullptr || only.snapshots[i] == nullptr)) {
      return;
    }
  }
  only.edge.reserve(node.edge.size() + only.edge.size());  // before anything changes
  std::exception_ptr failure;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!layers_[i].ranged()) continue;
    SnapshotPtr parent_part = detach(node, i);
    SnapshotPtr child_part = detach(only, i);
    // A merge that fails has consumed both parts: the joined node is left without the layer's
    // range (a gap), and the join completes.
    try {
      attach(only, i, layers_[i].cache->merge(std::move(parent_part), std::move(child_part)));
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  only.edge.insert(only.edge.begin(), node.edge.begin(), node.edge.end());
  unindex(only);
  only.last_used = std::max(only.last_used, node.last_used);
  index(only);
  Node* grandparent = node.parent;
  std::unique_ptr<Node> kept = std::move(node.children.front());
  kept->parent = grandparent;
  auto slot = std::find_if(grandparent->children.begin(), grandparent->children.end(),
                           [&](const auto& c) { return c.get() == &node; });
  *slot = std::move(kept);  // destroys `node` (now without snapshots)
  --node_count_;
  if (failure) std::rethrow_exception(failure);
}

void Trie::remove_leaf(Node& node, const std::function<bool(const Node&)>& keep) {
  Node* parent = node.parent;
  for (size_t i = 0; i < layers_.size(); ++i) (void)detach(node, i);
  unindex(node);
  std::erase_if(parent->children, [&](const auto& c) { return c.get() == &node; });
  index(*parent);
  --node_count_;
  merge_into_child(*parent, keep);
}

void Trie::preorder(std::vector<const Node*>& out) const {
  std::vector<const Node*> stack;
  for (auto it = root_.children.rbegin(); it != root_.children.rend(); ++it)
    stack.push_back(it->get());
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    out.push_back(node);
    for (auto it = node->children.rbegin(); it != node->children.rend(); ++it)
      stack.push_back(it->get());
  }
}

void Trie::clear() noexcept {
  // Each snapshot detached (its hook off, its bytes counted out) before its node goes.
  const auto detach_all = [this](Node& node) {
    for (size_t i = 0; i < node.snapshots.size(); ++i) (void)detach(node, i);
  };
  detach_all(root_);
  free_descendants(root_, detach_all);
  leaves_.clear();
  node_count_ = 0;
}

Node& Trie::add_child(Node& parent, std::vector<int32_t> edge, std::vector<SnapshotPtr> snapshots,
                      bool user, int64_t last_used) {
  std::unique_ptr<Node> node = new_node();
  node->parent = &parent;
  node->end = parent.end + static_cast<int64_t>(edge.size());
  node->edge = std::move(edge);
  node->user = user;
  node->last_used = last_used;
  room_for_child(parent);
  for (size_t i = 0; i < layers_.size() && i < snapshots.size(); ++i)
    attach(*node, i, std::move(snapshots[i]));
  Node& added = *node;
  unindex(parent);
  parent.children.push_back(std::move(node));
  index(added);
  ++node_count_;
  return added;
}

void Trie::take_nodes(Trie& fresh) noexcept {
  clear();
  root_.children = std::move(fresh.root_.children);
  fresh.root_.children.clear();
  for (auto& child : root_.children) child->parent = &root_;
  leaves_.swap(fresh.leaves_);
  // The moved snapshots' hooks point at it; the peak is the larger of the two tries'.
  const int64_t peak = peak_bytes();
  bytes_.swap(fresh.bytes_);
  if (peak > peak_bytes()) bytes_->peak.store(peak, std::memory_order_relaxed);
  std::swap(node_count_, fresh.node_count_);
  clock_ = std::max(clock_, fresh.clock_);
  passes_ = std::max(passes_, fresh.passes_);  // no node taken holds a later pass's mark
  ++version_;
  ++fresh.version_;
}

bool Trie::lacks_range(const Node& node) const {
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].ranged() && node.snapshots[i] == nullptr) return true;
  }
  return false;
}

int64_t Trie::restore_limit(const Match& found, int64_t prompt_length) const {
  int64_t limit = std::min(found.length, prompt_length - 1);
  for (const Node* node : found.path) {
    if (node->start() >= limit) break;
    if (lacks_range(*node)) return node->start();
  }
  return limit;
}

int64_t Trie::recount_bytes() const {
  std::vector<const Node*> nodes{&root_};
  preorder(nodes);
  int64_t total = 0;
  for (const Node* node : nodes) {
    for (const SnapshotPtr& s : node->snapshots) {
      if (s != nullptr) total += s->size();
    }
  }
  return total;
}

void Trie::dump_node(const Node& node, int depth, std::string& out) const {
  if (&node == &root_) {
    out += fmt::format("root: {} nodes, {} bytes paged out\n", node_count_, bytes());
    return;
  }
  std::string tokens;
  for (size_t i = 0; i < node.edge.size() && i < 6; ++i) tokens += fmt::format(" {}", node.edge[i]);
  if (node.edge.size() > 6) tokens += " ...";
  std::string layers;
  for (const SnapshotPtr& s : node.snapshots) {
    layers += s == nullptr ? " -" : s->is_lazy() ? " lazy" : fmt::format(" {}B", s->size());
  }
  out += fmt::format("{:{}}[{}, {}){}{} |{} | used {}\n", "", 2 * (depth - 1), node.start(),
                     node.end, tokens, node.user ? " user" : "", layers, node.last_used);
}

void Trie::check_children(const Node& node, std::string& problem) const {
  std::vector<int32_t> firsts;
  for (const auto& c : node.children) {
    const Node& child = *c;
    if (child.parent != &node)
      problem = fmt::format("node [{}, {}) has a wrong parent", child.start(), child.end);
    if (child.edge.empty()) problem = fmt::format("node ending at {} has an empty edge", child.end);
    if (!problem.empty()) return;
    if (child.start() != node.end) {
      problem = fmt::format("node [{}, {}) does not start where its parent ends ({})",
                            child.start(), child.end, node.end);
      return;
    }
    if (std::find(firsts.begin(), firsts.end(), child.edge.front()) != firsts.end()) {
      problem = fmt::format("siblings under offset {} share first token {}", node.end,
                            child.edge.front());
      return;
    }
    firsts.push_back(child.edge.front());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const SnapshotPtr& s = child.snapshots[i];
      if (s == nullptr) continue;
      if (layers_[i].cache == nullptr) {
        problem = fmt::format("node [{}, {}) holds a snapshot for stateless layer {}",
                              child.start(), child.end, i);
      } else if (layers_[i].ranged() && (s->from() != child.start() || s->to() != child.end)) {
        problem = fmt::format("layer {} snapshot [{}, {}) does not span node [{}, {})", i,
                              s->from(), s->to(), child.start(), child.end);
      } else if (layers_[i].whole_state() && s->to() != child.end) {
        problem = fmt::format("layer {} state at {} is not at node end {}", i, s->to(), child.end);
      }
      if (!problem.empty()) return;
    }
  }
}

std::string Trie::check_invariants() const {
  std::string problem;
  {
    std::vector<const Node*> all{&root_};
    preorder(all);
    for (const Node* node : all) {
      check_children(*node, problem);
      if (!problem.empty()) break;
    }
  }
  int64_t total = recount_bytes();
  if (problem.empty() && total != bytes()) {
    problem =
        fmt::format("byte counter {} differs from the sum of snapshot sizes {}", bytes(), total);
  }
  std::vector<const Node*> nodes;
  preorder(nodes);
  size_t leaves = 0;
  for (const Node* node : nodes) {
    // An inner node holds its entry of the eviction order; a leaf's is in the order.
    if (problem.empty() && node->order_entry.empty() == !node->children.empty()) {
      problem = fmt::format("node [{}, {}) {} its eviction-order entry", node->start(), node->end,
                            node->children.empty() ? "holds" : "lacks");
    }
    if (!node->children.empty()) continue;
    ++leaves;
    if (problem.empty() &&
        leaves_.count({node->user, node->last_used, const_cast<Node*>(node)}) == 0) {
      problem =
          fmt::format("leaf [{}, {}) is missing from the eviction order", node->start(), node->end);
    }
  }
  if (problem.empty() && leaves != leaves_.size()) {
    problem =
        fmt::format("the eviction order holds {} leaves, the trie {}", leaves_.size(), leaves);
  }
  return problem;
}

std::string Trie::debug_string() const {
  std::string out;
  // Depth-first, children in order, without recursing (a trie may be as deep as it has nodes).
  std::vector<std::pair<const Node*, int>> stack{{&root_, 0}};
  while (!stack.empty()) {
    const auto [node, depth] = stack.back();
    stack.pop_back();
    dump_node(*node, depth, out);
    for (auto it = node->children.rbegin(); it != node->children.rend(); ++it)
      stack.emplace_back(it->get(), depth + 1);
  }
  return out;
}

Node::~Node() {
  snapshots.clear();  // before its children's, as the members' own order would have it
  free_descendants(*this, [](Node& node) { node.snapshots.clear(); });
}

}  // namespace kvsnap::detail
