// Speculation — exact rollback of a verified chunk, for every cache kind.
//
// Speculative decoding feeds the last accepted token and k draft tokens through the model in
// one forward (the verify forward), then keeps the drafts the model agrees with. A round
// returns every layer to the accepted length without recomputing anything and without copying
// any state through host memory: attention layers (and windows that have evicted nothing)
// rewind their offset; whole-state layers (a rotating window past its size, a recurrent state)
// restore the state the verify forward captured at that draft offset (scheduled capture: a
// recurrent layer's kernel hands those states to put, a window's captures are lazy views).
//
//   kvsnap::Speculation round(layers);            // once; buffers are reused round after round
//   round.begin(drafts.size());                   // schedules captures at start+1..start+k
//   auto logits = model.forward({last, d1..dk}, layers, /*all_positions=*/true);
//   int64_t a = /* how many drafts the logits confirm */;
//   round.accept(a);                              // every layer at start + a + 1
//
// Memory: while a round is open, each whole-state layer holds k captures besides its live state
// (k + 1 states); accept() and cancel() release them. After warm-up a round allocates nothing
// here or in the built-in caches (tests/cache/decode_allocation_test.cc).
//
// Prefix cache sessions: tell the session only the accepted tokens (or retract_outputs() the
// rejected drafts) — see prefix_cache.h. Not thread-safe: one thread drives a Speculation (the
// caches it calls lock themselves).
#pragma once

#include <cstdint>
#include <vector>

#include "kvsnap/cache.h"
#include "kvsnap/export.h"

namespace kvsnap {

class KVSNAP_EXPORT Speculation {
 public:
  // Rounds over sequence `seq` of `layers` (not owned; a null entry is a stateless layer). A
  // cache listed more than once (shared by several model layers) is one state: it is rolled
  // back once, and errors name the first position it has in `layers`. Throws Error for `seq`
  // outside [0, 2^20), the ids caches hold.
  explicit Speculation(std::vector<Cache*> layers, SeqId seq = 0);
  // Cancels an open round (its captures are dropped, the layers stay where they are).
  ~Speculation();
  Speculation(const Speculation&) = delete;
  Speculation& operator=(const Speculation&) = delete;

  // Opens a round before the verify forward of 1 + `drafts` tokens at the layers' common offset
  // start: schedules a capture at start+1 .. start+drafts in every layer that cannot rewind
  // there. Throws Error (nothing changed) for drafts < 0 or > kMaxDrafts, a round that would
  // end past the positions a batch holds (start + drafts + 1 > 2^31 - 1), an open round, layers
  // that disagree on their offset, or a layer, of any kind, with captures already scheduled for
  // the sequence (Cache::schedule_state). A begin that fails later (a layer's prepare out of
  // memory) cancels what it scheduled; a layer that held nothing of the sequence may then list
  // it, empty (Cache::sequences; offset 0).
  void begin(int64_t drafts);
  // The most drafts one round verifies (its offsets are held in memory: 8 MB at most).
  static constexpr int64_t kMaxDrafts = int64_t{1} << 20;
  // Closes the round after the verify forward: the first `accepted` drafts (0..drafts) were
  // confirmed, so every layer returns to start + accepted + 1 (rewind or captured state) and the
  // captures are released. Every layer is checked before any moves: throws Error, the round
  // left open and nothing changed, unless 0 <= accepted <= drafts, every layer stands at
  // start + drafts + 1, and every layer that must move can — a layer that rewinds has no
  // schedule (someone else's: take or cancel it, then accept again), a capturing layer still
  // holds the round's captures (taken or replaced by another call on the sequence, they are
  // gone: only cancel() ends the round then). Accepting every draft moves no layer and needs
  // no capture: it succeeds even when one was lost (out of memory while the verify forward made
  // it). Otherwise only the capture at the accepted offset is kept: the others are released
  // before any layer moves, and the whole-state layers restore before the others rewind. An
  // accept that fails past that point (out of memory restoring a window) may have moved some
  // whole-state layers: call accept again with the same count, which moves only the layers not
  // moved yet (any other count is refused), or cancel() the round, which leaves each layer where
  // it stands (reset the sequence then). A
  // layer of a kind that does not report its schedule (ScheduleState::known false) is trusted to
  // hold no one else's: the rewind refuses one, after the whole-state layers moved.
  void accept(int64_t accepted);
  // Drops an open round's captures without moving any layer (no-op without a round). A schedule
  // that replaced the round's on a layer belongs to someone else and is left alone.
  void cancel();

  bool open() const { return open_; }
  // The open round's start offset and draft count (once it closed, the last round's; 0 before
  // any).
  int64_t start() const { return start_; }
  int64_t drafts() const { return drafts_; }
  // Layers that capture in the open round (whole-state layers that cannot rewind there).
  int64_t capturing_layers() const;

  struct Stats {
    int64_t rounds = 0;    // accepted rounds
    int64_t drafted = 0;   // draft tokens verified
    int64_t accepted = 0;  // of them, confirmed
    int64_t restores = 0;  // layer restores from a capture
    int64_t rewinds = 0;   // layer offset rewinds
  };
  const Stats& stats() const { return stats_; }

 private:
  struct Layer {
    Cache* cache = nullptr;              // never null (stateless layers are left out)
    size_t index = 0;                    // its first position in the constructor's list
    bool capture = false;                // this round
    bool taken = false;                  // this round's captures are in `snapshots`
    bool moved = false;                  // restored by an accept that failed on a later layer
    uint64_t serial = 0;                 // ScheduleState::serial of the round's schedule
    std::vector<SnapshotPtr> snapshots;  // its captures (capacity kept across rounds)
  };
  int64_t common_offset() const;
  bool holds_round_schedule(const Layer& layer) const;
  bool is_round_schedule(const Layer& layer, const ScheduleState& s) const;
  void check_layer(const Layer& layer, int64_t target) const;
  void check_captures(const Layer& layer) const;
  void check_accept(int64_t accepted) const;

  std::vector<Layer> layers_;
  SeqId seq_;
  bool open_ = false;
  int64_t moving_ = -1;  // the accepted count of an accept that released captures, then failed
  int64_t start_ = 0, drafts_ = 0;
  std::vector<int64_t> offsets_;  // scratch: the scheduled offsets
  Stats stats_;
};

}  // namespace kvsnap
