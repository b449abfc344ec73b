#include "prefix/planner.h"

#include <algorithm>

namespace kvsnap::detail {

std::optional<WholeStateStep> whole_state_step(const LayerInfo& layer, size_t index,
                                               const std::vector<Node*>& path, int64_t target,
                                               const LiveView& live) {
  using Kind = WholeStateStep::Kind;
  const int64_t rewind_limit = layer.rule.rewind_limit;
  if (target == live.length && live.shared >= live.length) return WholeStateStep{Kind::stay};
  if (rewind_limit > 0 && live.length <= rewind_limit &&
      target <= std::min(live.length, live.shared)) {
    return WholeStateStep{Kind::live_rewind};
  }
  if (target == 0) return WholeStateStep{Kind::reset};
  for (Node* node : path) {
    if (node->snapshots[index] == nullptr) continue;
    if (node->end == target || (node->end > target && node->end <= rewind_limit)) {
      return WholeStateStep{Kind::snapshot, node};
    }
  }
  return std::nullopt;
}

Plan plan_restore(const std::vector<LayerInfo>& layers, const std::vector<Node*>& path,
                  int64_t limit, const LiveView& live) {
  // Candidate offsets, deepest first: the limit, every node end, the shared live prefix, 0.
  std::vector<int64_t> candidates{limit, 0};
  for (const Node* node : path) candidates.push_back(std::min(node->end, limit));
  candidates.push_back(std::min({live.length, live.shared, limit}));
  std::sort(candidates.rbegin(), candidates.rend());
  Plan plan;
  for (int64_t target : candidates) {
    plan.target = target;
    plan.steps.assign(layers.size(), WholeStateStep{});
    bool everyone = true;
    for (size_t i = 0; i < layers.size() && everyone; ++i) {
      if (!layers[i].whole_state()) continue;
      const std::optional<WholeStateStep> step = whole_state_step(layers[i], i, path, target, live);
      everyone = step.has_value();
      if (everyone) plan.steps[i] = *step;
    }
    if (everyone) return plan;  // 0 always succeeds: reset
  }
  return plan;
}

}  // namespace kvsnap::detail
