#include "prefix/live_state.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

namespace kvsnap::detail {

void LiveState::set_tokens(std::span<const int32_t> tokens) {
  // Both made before either changes: running out of memory leaves the recorded tokens and the
  // tip (what protects the path from eviction) as they were.
  std::vector<int32_t> next(tokens.begin(), tokens.end());
  Node* const tip = tip_for(next);
  tokens_.swap(next);
  tip_ = tip;
}

void LiveState::find_tip() { tip_ = tip_for(tokens_); }

Node* LiveState::tip_for(std::span<const int32_t> tokens) const {
  Node* tip = &trie_.root();
  const auto live = static_cast<int64_t>(tokens.size());
  const Trie::Match match = trie_.match(tokens);
  for (Node* node : match.path) {
    // A node the tokens follow to its end or to theirs: the last one entered may be left
    // midway, where the tokens diverge (a prompt whose own nodes were never inserted, its
    // captures lost): the live caches hold other tokens there, so it is not on the path.
    if (node->start() < live && match.length >= std::min(node->end, live)) tip = node;
  }
  return tip;
}

bool LiveState::has_state() const {
  return std::any_of(trie_.layers().begin(), trie_.layers().end(),
                     [](const LayerInfo& layer) { return layer.cache != nullptr; });
}

void LiveState::refresh_exposure() {
  exposure_ = 0;
  if (!writable_) return;
  for (const LayerInfo& layer : trie_.layers()) {
    if (layer.cache == nullptr) continue;
    exposure_ += layer.ranged() && rewind_to_
                     ? layer.cache->exposed_bytes_after_rewind(slot_, *rewind_to_)
                     : layer.cache->exposed_bytes(slot_);
  }
}

void LiveState::begin_switch(Node* tip, int64_t rewind_to) {
  switching_to_ = tip;
  switching_from_ = tip->start();
  rewind_to_ = rewind_to;
  writable_ = true;
}

void LiveState::end_switch() noexcept {
  switching_to_ = nullptr;
  rewind_to_.reset();
}

void LiveState::repoint_ranges() {
  // The caches hold the recorded tokens, and in decode the outputs after them.
  const auto live = static_cast<int64_t>(tokens_.size());
  if (offset().value_or(-1) < live) return;
  // Other slots' inserts may have split the nodes we stand on since we recorded the tip.
  find_tip();
  if (tip_ != &trie_.root() && tip_->end > live) {
    // A partly live tip (a prompt that ends inside a node, or a restore to the middle of one):
    // its range cannot be pointed at our caches, which hold only its head, nor evicted (we
    // stand on it), so another slot's write would copy all of it into the trie. Split it at
    // what we hold: the head becomes the tip, the tail a leaf off the active path, evictable.
    tip_ = &trie_.split(*tip_, live);
  }
  for (Node* node : active_path()) {
    for (size_t i = 0; i < trie_.layers().size(); ++i) {
      const LayerInfo& layer = trie_.layers()[i];
      if (!layer.ranged() || node->snapshots[i] == nullptr) continue;
      // Cut at the node's end by what the snapshot holds, not by a second read of the offset:
      // the slot's own thread may rewind its caches meanwhile (below the node's end: its range
      // stays as it is).
      SnapshotPtr held = layer.cache->snapshot(slot_, node->start());
      if (held == nullptr || held->to() < node->end) continue;
      if (held->to() > node->end) {
        held = layer.cache->split(std::move(held), node->end).first;
      }
      if (held != nullptr && held->is_lazy()) trie_.replace(*node, i, std::move(held));
    }
  }
}

std::optional<int64_t> LiveState::offset() const {
  std::optional<int64_t> common;
  for (const LayerInfo& layer : trie_.layers()) {
    if (layer.cache == nullptr) continue;
    if (!common) {
      common = layer.cache->offset(slot_);
    } else if (layer.cache->offset(slot_) != *common) {
      return std::nullopt;
    }
  }
  return common ? common : static_cast<int64_t>(tokens_.size());
}

void LiveState::forget() noexcept {
  tokens_.clear();
  tip_ = &trie_.root();
  end_switch();
  incoming_ = 0;
}

void LiveState::reset() {
  forget();  // the record first: a layer that throws below must not leave a pin behind
  for (const LayerInfo& layer : trie_.layers()) {
    if (layer.cache == nullptr) continue;
    layer.cache->cancel_snapshots(slot_);
    layer.cache->reset(slot_);
  }
}

bool LiveState::on_active_path(const Node& node) const {
  // During a switch, the path the caches are about to stand on: the old one's nodes past what
  // the two share are about to be overwritten, and may be evicted to make room for that.
  for (const Node* n = switching_to_ != nullptr ? switching_to_ : tip_; n != nullptr;
       n = n->parent) {
    if (n == &node) return true;
  }
  return false;
}

void LiveState::mark_active_path(uint64_t pass) const {
  for (Node* n = switching_to_ != nullptr ? switching_to_ : tip_; n != nullptr; n = n->parent) {
    n->pinned_in = pass;
  }
}

std::vector<Node*> LiveState::active_path() const {
  std::vector<Node*> path;
  // During a switch, none: the old path's restore points are being left (their nodes are
  // evictable), and the new path's are what the switch restores from.
  if (switching_to_ != nullptr) return path;
  for (Node* n = tip_; n != nullptr && n != &trie_.root(); n = n->parent) path.push_back(n);
  return path;
}

void LiveState::switch_to(const std::vector<Node*>& path, const Plan& plan, int64_t shared) {
  const int64_t target = plan.target;
  for (size_t i = 0; i < trie_.layers().size(); ++i) {
    Cache* cache = trie_.layers()[i].cache;
    if (cache == nullptr) continue;
    bool ok = true;
    if (trie_.layers()[i].ranged()) {
      ok = page_in_ranges(i, path, target, shared);
    } else {
      const WholeStateStep& step = plan.steps[i];
      switch (step.kind) {
        case WholeStateStep::Kind::stay:
          break;
        case WholeStateStep::Kind::reset:
          cache->reset(slot_);
          break;
        case WholeStateStep::Kind::live_rewind:
          ok = cache->restore(slot_, nullptr, target);
          break;
        case WholeStateStep::Kind::snapshot:
          ok = cache->restore(slot_, step.node->snapshots[i].get(), target);
          if (ok && step.node->end == target) relazify(*step.node, i, 0);
          break;
      }
    }
    if (!ok) {
      throw Error(fmt::format(
          "PrefixCache::begin: internal error: layer {} could not reach offset {}", i, target));
    }
  }
}

bool LiveState::page_in_ranges(size_t layer, const std::vector<Node*>& path, int64_t target,
                               int64_t shared) {
  Cache& cache = *trie_.layers()[layer].cache;
  if (target <= shared) return cache.restore(slot_, nullptr, target);
  if (!cache.restore(slot_, nullptr, shared)) return false;
  for (Node* node : path) {
    if (node->end <= shared || node->start() >= target) continue;
    Snapshot* s = node->snapshots[layer].get();
    if (s == nullptr) return false;
    const int64_t to = std::min(node->end, target);
    if (!cache.restore(slot_, s, to)) return false;
    if (to == node->end) relazify(*node, layer, node->start());
  }
  return true;
}

void LiveState::relazify(Node& node, size_t layer, int64_t from) {
  if (node.snapshots[layer] == nullptr || node.snapshots[layer]->size() == 0) return;
  SnapshotPtr lazy = trie_.layers()[layer].cache->snapshot(slot_, from);
  if (lazy != nullptr && lazy->is_lazy()) trie_.replace(node, layer, std::move(lazy));
}

void evict_to_budget(Trie& trie, const std::vector<LiveState*>& live, int64_t budget,
                     int64_t& evicted_nodes, int64_t& dropped_snapshots, bool may_skip,
                     uint64_t& futile) {
  // The slots' active paths, marked once per round of evictions: keep() is then one comparison
  // (asking each slot's path of each node made evicting one node cost slots^2 x depth, with
  // idle slots' tips first in the eviction order). A round only removes unmarked nodes and
  // moves no tip, so its marks stay true; between rounds repoint_ranges may split tips.
  uint64_t pass = 0;
  const auto mark = [&] {
    pass = trie.new_pass();
    for (const LiveState* slot : live) slot->mark_active_path(pass);
  };
  const auto keep = [&](const Node& node) { return node.pinned_in == pass; };
  // The bytes the trie holds and what writes before the slots' next calls may copy out of the
  // live caches into its lazy snapshots: checked here, before those writes allocate, the budget
  // holds until the next call. Exposures first, bytes last: a write running meanwhile moves
  // bytes from the one to the other, counted twice rather than missed.
  const auto over = [&] {
    int64_t total = 0;
    for (const LiveState* slot : live) total += slot->exposure();
    return total + trie.bytes() > budget;
  };
  const auto refresh = [&] {
    for (LiveState* slot : live) slot->refresh_exposure();
  };
  const auto evict_leaves = [&] {
    mark();
    while (over()) {
      Node* victim = trie.eviction_candidate(keep);
      if (victim == nullptr) break;  // only active paths are left
      ++evicted_nodes;               // before: a merge that runs out still removed it
      trie.remove_leaf(*victim, keep);
      refresh();
    }
  };
  if (!over()) return;
  refresh();  // an eviction may lower any slot's exposure
  evict_leaves();
  if (!over() || (may_skip && trie.version() == futile)) return;
  // The active paths' KV ranges are in the live caches that stand on them: what they own, or
  // name in another slot's caches (exposed there), is given back. A tip only partly live is
  // split first: its tail, off the active paths now, is evicted like any leaf.
  for (LiveState* slot : live) slot->repoint_ranges();
  refresh();
  evict_leaves();
  if (!over()) return;
  // A begin whose pinned tip was split above: the tail it still pins may be a leaf its plan does
  // not need. It plans again (the trie changed) and evicts that first; dropping other slots'
  // restore points now would lose them for nothing.
  if (std::any_of(live.begin(), live.end(),
                  [](const LiveState* slot) { return slot->switch_tip_split(); })) {
    return;
  }
  // Last resort: the active paths cannot be evicted (live caches stand on them), but the
  // whole-state snapshots their nodes keep — owned, or lazy in a ring that will copy them — are
  // restore points for later divergence, not needed for the live states. Drop them, least
  // recently used (non-user) nodes first.
  std::vector<Node*> path;
  for (const LiveState* slot : live) {
    const std::vector<Node*> own = slot->active_path();
    path.insert(path.end(), own.begin(), own.end());
  }
  std::sort(path.begin(), path.end(), [](const Node* a, const Node* b) {
    return std::tuple(a->user, a->last_used, a) < std::tuple(b->user, b->last_used, b);
  });
  path.erase(std::unique(path.begin(), path.end()), path.end());  // paths several slots share
  for (Node* node : path) {
    for (size_t i = 0; i < trie.layers().size(); ++i) {
      if (!over()) return;
      const SnapshotPtr& s = node->snapshots[i];
      if (trie.layers()[i].whole_state() && s != nullptr && (s->size() > 0 || s->is_lazy())) {
        trie.replace(*node, i, nullptr);
        ++dropped_snapshots;
        refresh();
      }
    }
  }
  futile = trie.version();  // still over: only what the active paths need is left
}

}  // namespace kvsnap::detail
