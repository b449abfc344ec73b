// Internal: a PrefixCache and its tier (kvsnap/tier.h) — a restore point the tier found becomes
// trie nodes, which begin then plans over like any other; the restore points a closed session
// made go to the tier.
#pragma once

#include <functional>
#include <span>

#include "kvsnap/tier.h"
#include "prefix/trie.h"

namespace kvsnap::detail {

// Inserts the segments of `match` (found for `prompt`) as trie nodes, one at a time, calling
// `evict` after each: the trie passes its budget by one segment at most, not by the whole match.
// Stops where the trie no longer holds the path a segment starts from (evicted since the lookup,
// or by `evict`); returns whether it inserted any.
bool insert_from_tier(Trie& trie, std::span<const int32_t> prompt, TierMatch match,
                      const std::function<void()>& evict);

// Stores the restore points on the trie path of `tokens` — nodes where every whole-state layer
// holds its state — with the KV data of slot `slot`'s live caches, which must hold exactly
// `tokens`. Those the tier knows it holds are skipped there; the others (new, or lost by a store
// that was restarted or flushed) are written. Never throws for the tier's sake (Tier::offer: a
// store the tier refuses is counted and logged there); may run out of memory itself.
void store_to_tier(Tier& tier, Trie& trie, SeqId slot, std::span<const int32_t> tokens);

}  // namespace kvsnap::detail
