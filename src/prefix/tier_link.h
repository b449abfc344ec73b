// Internal: a PrefixCache and its tier (kvsnap/tier.h) — a restore point the tier found becomes
// trie nodes, which begin then plans over like any other; the restore points a closed session
// made go to the tier.
#pragma once

#include <span>

#include "kvsnap/tier.h"
#include "prefix/trie.h"

namespace kvsnap::detail {

// Inserts the segments of `match` (found for `prompt`) as trie nodes. Returns false, inserting
// nothing, when the trie no longer holds the path the first segment starts from (evicted since
// the lookup).
bool insert_from_tier(Trie& trie, std::span<const int32_t> prompt, TierMatch match);

// Stores the restore points on the trie path of `tokens` — nodes where every whole-state layer
// holds its state — with the KV data of slot `slot`'s live caches, which must hold exactly
// `tokens`. Those the tier knows it holds are skipped there; the others (new, or lost by a store
// that was restarted or flushed) are written.
void store_to_tier(Tier& tier, Trie& trie, SeqId slot, std::span<const int32_t> tokens);

}  // namespace kvsnap::detail
