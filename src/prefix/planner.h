// Internal: planning a request's restore — pure: which offset every layer can reach along a
// trie path, and how each whole-state layer gets there. Nothing is moved here.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "prefix/trie.h"

namespace kvsnap::detail {

// How one whole-state layer gets to the planned offset.
struct WholeStateStep {
  enum class Kind {
    stay,         // the live state is already there
    reset,        // offset 0: the empty state
    live_rewind,  // a window that has evicted nothing rewinds in place
    snapshot,     // restore `node`'s snapshot
  } kind = Kind::stay;
  Node* node = nullptr;
};

// What the live caches hold, seen from the request: `length` tokens, of which the first
// `shared` equal the prompt's.
struct LiveView {
  int64_t length = 0;
  int64_t shared = 0;
};

struct Plan {
  int64_t target = 0;  // the offset every layer is restored to
  // Per layer: the step of a whole-state layer; KV layers page in the path's ranges, stateless
  // layers do nothing (their entries are `stay`).
  std::vector<WholeStateStep> steps;
};

// The deepest offset <= limit that every layer can reach along `path` (the matched nodes, root
// excluded), never mixing offsets: KV layers reach any offset the path covers; whole-state
// layers an offset where a node holds their snapshot, or (windows that evicted nothing) any
// earlier one, or the live state where it is shared.
Plan plan_restore(const std::vector<LayerInfo>& layers, const std::vector<Node*>& path,
                  int64_t limit, const LiveView& live);

// How whole-state layer `layer` reaches offset `target`, or nullopt when it cannot.
std::optional<WholeStateStep> whole_state_step(const LayerInfo& layer, size_t index,
                                               const std::vector<Node*>& path, int64_t target,
                                               const LiveView& live);

}  // namespace kvsnap::detail
