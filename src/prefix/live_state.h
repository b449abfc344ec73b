// Internal: what the live caches hold on behalf of a PrefixCache — the tokens, the trie node
// they reach (the active path, which eviction must spare) — and moving them to a planned offset
// on another path (rewinds, restores, page-in of KV ranges).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "prefix/planner.h"
#include "prefix/trie.h"

namespace kvsnap::detail {

class LiveState {
 public:
  // The live state of sequence `slot` of every layer.
  LiveState(Trie& trie, SeqId slot) : trie_(trie), slot_(slot), tip_(&trie.root()) {}

  // The tokens the live caches hold, [0, their offset).
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Records that the caches hold `tokens` now, and finds the active path's tip.
  void set_tokens(std::span<const int32_t> tokens);

  // Whether any layer holds state (all-stateless stacks track tokens only).
  bool has_state() const;
  // Whether the caches may be written before the slot's next call: while a session is open.
  void set_writable(bool writable) { writable_ = writable; }
  bool writable() const { return writable_; }
  // What the slot's writes may copy into the trie's lazy snapshots before its next call, as of
  // the last refresh: its layers' Cache::exposed_bytes, 0 while not writable. Writes only lower
  // what of it is the trie's; other slots' calls that change the trie or what the caches share
  // (begin, prefill_done, close: trie splits can give a half-copied piece's columns back to
  // its store) may raise it, so those refresh every slot.
  int64_t exposure() const { return exposure_ + incoming_; }
  void refresh_exposure();
  // Bytes about to enter the trie from this slot (captures taken, not yet inserted), reserved
  // with the exposure until set back to 0.
  void set_incoming(int64_t bytes) { incoming_ = bytes; }
  // Before a restore that moves the caches to another path: pins that path's nodes up to
  // `tip` (instead of the active path's: what the caches hold past the part the two paths share
  // is about to be overwritten) and counts, from now on, what the switch itself may give the
  // trie — KV layers as rewound to `rewind_to` (Cache::exposed_bytes_after_rewind) — in the
  // exposure, so an eviction makes room for it before anything is copied. end_switch ends both.
  void begin_switch(Node* tip, int64_t rewind_to);
  void end_switch() noexcept;
  // Whether a split (a slot's re-pointing: another's, or this one's of its old path) moved the
  // switch's pinned tip up since begin_switch: the node pinned then now holds only the lower part
  // of it (still pinned, with the new upper node), which the plan may not need; the caller plans
  // again (the trie's version changed) and pins what it needs.
  bool switch_tip_split() const {
    return switching_to_ != nullptr && switching_to_->start() != switching_from_;
  }
  // Points the KV snapshots of the active path's nodes at the live caches that hold them (in
  // decode too), lazily: what they owned, or named in another slot's caches, is given back. A
  // tip only partly live is split first at the recorded tokens' end, so the live caches hold
  // every node of the path whole and the tail is a leaf off it (evictable). Does nothing while
  // the caches stand below the recorded tokens.
  void repoint_ranges();
  // The offset every stateful layer stands at (the token count for a stateless stack), or
  // nullopt when they disagree.
  std::optional<int64_t> offset() const;
  // Whether the caches still hold what we recorded (nobody moved them behind our back).
  bool consistent() const { return offset() == static_cast<int64_t>(tokens_.size()); }
  // Forgets the live tokens (the record: no node is pinned or named any more), leaving the
  // layers as they are.
  void forget() noexcept;
  // Forgets the live tokens, then resets every layer.
  void reset();

  // `node` and its ancestors are pinned while the live caches stand on them (during a switch:
  // while it is about to move them there).
  bool on_active_path(const Node& node) const;
  // Sets pinned_in = `pass` on the nodes on_active_path covers.
  void mark_active_path(uint64_t pass) const;
  // The active path, deepest node first (root excluded); empty during a switch (whose pinned
  // path on_active_path covers).
  std::vector<Node*> active_path() const;

  // Moves every layer to `plan.target` on `path` (see planner.h). Throws Error when a layer
  // cannot get there (an internal error: the plan said it could).
  void switch_to(const std::vector<Node*>& path, const Plan& plan, int64_t shared);

 private:
  // KV layer: rewind to what the live state shares, then write the path's ranges up to target.
  bool page_in_ranges(size_t layer, const std::vector<Node*>& path, int64_t target, int64_t shared);
  // Finds the active path's tip for the recorded tokens (the trie may have changed since): the
  // deepest node holding a live token whose edge the tokens follow to its end or to theirs.
  // Unchanged when the match runs out of memory.
  void find_tip();
  Node* tip_for(std::span<const int32_t> tokens) const;
  // After a restore put a node's data back into the live cache, the node can hold a lazy view
  // of it instead and give its bytes back.
  void relazify(Node& node, size_t layer, int64_t from);

  Trie& trie_;
  const SeqId slot_;
  std::vector<int32_t> tokens_;
  Node* tip_;                         // the deepest node holding a live token
  Node* switching_to_ = nullptr;      // begin_switch's tip
  int64_t switching_from_ = 0;        // its first token then
  std::optional<int64_t> rewind_to_;  // begin_switch's rewind_to
  bool writable_ = false;
  int64_t exposure_ = 0;
  int64_t incoming_ = 0;
};

// Evicts least recently used leaves (user nodes last, any slot's active path never) until the
// trie's bytes plus what the slots' writes may still copy into it (their exposure(), refreshed
// as it goes) are at most `budget`. When only active paths are left: re-points their KV ranges
// at the live caches (splitting off the tails of partly live tips, evicted in turn), then drops
// their whole-state snapshots that own or may come to own bytes (restore points, not needed by the
// live states). Counts into the two counters. The callers refresh their own slot's exposure first.
//
// `futile` remembers the trie's version when the last resort last left it over the budget;
// with `may_skip` (a decode step, which moves no live path) it is not tried again until the
// trie changed: it could do nothing more.
void evict_to_budget(Trie& trie, const std::vector<LiveState*>& live, int64_t budget,
                     int64_t& evicted_nodes, int64_t& dropped_snapshots, bool may_skip,
                     uint64_t& futile);

}  // namespace kvsnap::detail
