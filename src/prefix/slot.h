// Internal: one sequence slot of a PrefixCache — what its live caches hold (LiveState) and its
// open session: begin plans and switches, the session schedules captures and pages its path out
// into the shared trie. The PrefixCache's lock is held around every call.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <vector>

#include "kvsnap/prefix_cache.h"
#include "kvsnap/tier.h"
#include "prefix/live_state.h"
#include "prefix/planner.h"
#include "prefix/trie.h"

namespace kvsnap::detail {

// One request's state, shared by its Session handle and the PrefixCache while it is open. The
// PrefixCache detaches it (owner = null) when destroyed first, and closing detaches it too, so
// the handle never dangles. Detaching happens under the owner's lock, which a handle's call can
// take only once it has read `owner`: an atomic, read again under the lock.
struct SessionState {
  enum class Phase {
    prefill,  // begun: the model evaluates remaining(), then prefill_done()
    decode,   // prefill attached: generated tokens are appended
    closed,
  };
  std::atomic<PrefixCacheImpl*> owner{nullptr};
  SeqId slot = 0;
  Phase phase = Phase::prefill;
  std::vector<int32_t> prompt;  // as given (remaining() views it: never reallocated)
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int64_t prompt_length = 0;
  int64_t matched = 0;               // prompt tokens found in the trie
  int64_t cached = 0;                // offset restored
  int64_t paged_end = 0;             // the trie holds the session's path up to here
  std::set<int64_t> user_offsets;    // schedule_snapshots': user nodes
  std::set<int64_t> branch_offsets;  // schedule_branch_points': ordinary nodes
  std::vector<int64_t> scheduled;    // the captures the layers were asked for, ascending
  std::vector<uint64_t> serials;     // per layer, the number of that schedule (ScheduleState)
};

// What a call changed, for the eviction after it.
enum class Change {
  own,     // the slot's own caches or session: its exposure is refreshed
  shared,  // the trie or what the caches share: every slot's exposure is refreshed
  decode,  // a decode step: as `own`, and a last resort that left the trie over the budget is
           // not retried while the trie is unchanged (it could do nothing more)
};

class Slot {
 public:
  // `evict(change)` keeps the trie under its budget (run after every change); `tier` (not owned,
  // may be null) receives the restore points of each closed session.
  Slot(Trie& trie, SeqId id, std::function<void(Change)> evict, Tier* tier = nullptr)
      : trie_(trie), id_(id), live_(trie, id), evict_(std::move(evict)), tier_(tier) {}

  SeqId id() const { return id_; }
  const LiveState& live() const { return live_; }
  LiveState& live() { return live_; }
  bool open() const { return session_ != nullptr; }
  const std::shared_ptr<SessionState>& session() const { return session_; }

  // The offset begin would restore `prompt` to on this slot, without changing anything.
  int64_t match(std::span<const int32_t> prompt) const;
  // Restores the deepest prefix of `prompt` every layer can reach and opens a session.
  std::shared_ptr<SessionState> begin(std::span<const int32_t> prompt, PrefixCacheImpl* owner,
                                      PrefixCache::Stats& stats);
  // Session::schedule_snapshots (`user`), or Session::schedule_branch_points.
  void schedule_snapshots(std::span<const int64_t> offsets, bool user);
  void prefill_done();
  void append_output(int32_t token);
  void retract_outputs(int64_t count);
  // Ends the session (also when that fails: then the slot's caches are reset and the error
  // rethrown).
  void close();
  // The PrefixCache goes while this slot's session is open: the session is detached (its calls
  // throw, closing it does nothing), and in prefill the captures it scheduled on the layers are
  // cancelled, so the layers serve their callers as if no session had begun (restores and new
  // schedules are refused while captures are scheduled). A layer's schedule that is not the
  // session's (a Speculation round's, after prefill_done) stays; what the layers hold stays.
  void detach() noexcept;

  // Throws Error (nothing changed) when a layer holds captures scheduled for the slot: with no
  // session open they are someone else's (an open Speculation round's). begin checks it first,
  // and load (`call` names the caller).
  void require_no_schedule(const char* call = "PrefixCache::begin") const;

 private:
  void close_session();
  // A session that cannot go on (a begin or close that failed midway): it ends, and the slot's
  // caches are reset, as what they hold may match no record. Never throws.
  void abandon() noexcept;
  // Resets the slot's caches whose contents match no record (moved outside the prefix cache,
  // driven past what a closing session knows, or left by a failed call), within the budget: what
  // the reset copies into the trie's lazy snapshots is evicted for first. Leaves the slot
  // unwritable.
  void reset_moved_caches();
  // The offset every layer stands at, as the session needs it (-1 never matches an offset).
  int64_t layer_offset() const { return live_.offset().value_or(-1); }
  // "offset N", or where the layers disagree "different offsets (layer 0 at 5, layer 1 at 7)".
  std::string describe_offset() const;
  // The planner's view of the live caches for a prompt cut at `limit`.
  LiveView view(std::span<const int32_t> prompt, int64_t limit) const {
    return {static_cast<int64_t>(live_.tokens().size()),
            common_prefix(live_.tokens(), prompt.subspan(0, static_cast<size_t>(limit)))};
  }
  bool complete_boundary(const std::vector<Node*>& path, int64_t offset) const;
  // Schedules `offsets` on every layer (the session's schedule then). All or nothing: one that
  // runs out puts the session's schedule back on every layer, or, when that runs out too,
  // leaves none on any (a layer whose captures were not the others' would have them inserted
  // at the wrong offsets), and rethrows.
  void prepare(std::vector<int64_t> offsets);
  std::vector<int64_t> schedule_for(const std::vector<Node*>& path) const;
  void attach_captures();

  Trie& trie_;
  const SeqId id_;
  LiveState live_;
  std::function<void(Change)> evict_;
  Tier* tier_;
  std::shared_ptr<SessionState> session_;  // the open session, if any
};

}  // namespace kvsnap::detail
