#include "prefix/tier_link.h"

namespace kvsnap::detail {

bool insert_from_tier(Trie& trie, std::span<const int32_t> prompt, TierMatch match,
                      const std::function<void()>& evict) {
  const std::vector<LayerInfo>& layers = trie.layers();
  bool inserted = false;
  for (TierSegment& segment : match.segments) {
    if (trie.match(prompt).length < segment.from) break;
    std::vector<SnapshotPtr> ranged(layers.size()), whole(layers.size());
    for (size_t i = 0; i < layers.size() && i < segment.snapshots.size(); ++i) {
      (layers[i].ranged() ? ranged : whole)[i] = std::move(segment.snapshots[i]);
    }
    trie.insert(prompt, segment.from, segment.to, std::move(ranged), std::move(whole), false);
    inserted = true;
    evict();
  }
  return inserted;
}

void store_to_tier(Tier& tier, Trie& trie, SeqId slot, std::span<const int32_t> tokens) {
  const std::vector<LayerInfo>& layers = trie.layers();
  std::vector<TierPoint> points;
  for (const Node* node : trie.match(tokens).path) {
    if (node->end > static_cast<int64_t>(tokens.size())) continue;
    TierPoint point{node->end, std::vector<const Snapshot*>(layers.size())};
    bool complete = true;
    for (size_t i = 0; i < layers.size(); ++i) {
      if (!layers[i].whole_state()) continue;
      point.states[i] = node->snapshots[i].get();
      complete = complete && point.states[i] != nullptr;
    }
    if (complete) points.push_back(std::move(point));
  }
  if (points.empty()) return;
  // The live caches hold [0, tokens.size()): one lazy snapshot each lends the KV data (no copy).
  // Taken inside offer: a tier that refuses, or a cache that cannot lend, costs restores, not
  // the close.
  (void)tier.offer(
      tokens,
      [&] {
        std::vector<SnapshotPtr> ranges(layers.size());
        for (size_t i = 0; i < layers.size(); ++i) {
          if (layers[i].ranged()) ranges[i] = layers[i].cache->snapshot(slot, 0);
        }
        return ranges;
      },
      points);
}

}  // namespace kvsnap::detail
