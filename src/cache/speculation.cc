#include "kvsnap/speculation.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <string>

#include "cache/sequences.h"

namespace kvsnap {
namespace {

std::string describe(const ScheduleState& s) {
  if (!s.pending) return "none";
  if (s.count == 0) return "a schedule of no offsets";
  if (s.count == 1) {
    return fmt::format("offset {}, {}", s.first, s.reached > 0 ? "captured" : "not reached");
  }
  return fmt::format("{} offsets from {} to {}, {} captured", s.count, s.first, s.last, s.reached);
}

}  // namespace

Speculation::Speculation(std::vector<Cache*> layers, SeqId seq) : seq_(seq) {
  if (seq < 0 || seq >= detail::kMaxSequences) {
    throw Error(fmt::format("Speculation: sequence id {} outside [0, {}) (the ids caches hold)",
                            seq, detail::kMaxSequences));
  }
  layers_.reserve(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    Cache* cache = layers[i];
    // A stateless layer has nothing to roll back; a layer listed again (a cache several model
    // layers share) is the same state, rolled back once.
    if (cache == nullptr || std::any_of(layers_.begin(), layers_.end(),
                                        [&](const Layer& layer) { return layer.cache == cache; })) {
      continue;
    }
    layers_.push_back(Layer{cache, i, false, false, false, 0, {}});
  }
}

Speculation::~Speculation() {
  try {
    cancel();
  } catch (...) {  // a destructor never throws; the layers keep whatever they captured
  }
}

int64_t Speculation::capturing_layers() const {
  return std::count_if(layers_.begin(), layers_.end(),
                       [&](const Layer& layer) { return open_ && layer.capture; });
}

int64_t Speculation::common_offset() const {
  int64_t start = -1;
  for (const Layer& layer : layers_) {
    const int64_t offset = layer.cache->offset(seq_);
    if (start >= 0 && offset != start) {
      throw Error(fmt::format(
          "Speculation::begin: the layers of sequence {} stand at offsets {} and {}; a round "
          "starts where every layer is",
          seq_, start, offset));
    }
    start = offset;
  }
  return std::max<int64_t>(start, 0);
}

void Speculation::begin(int64_t drafts) {
  if (drafts < 0 || drafts > kMaxDrafts) {
    throw Error(
        fmt::format("Speculation::begin: drafts {} must be in [0, {}]", drafts, kMaxDrafts));
  }
  if (open_) {
    throw Error(fmt::format(
        "Speculation::begin: a round of {} drafts from offset {} is open (accept or cancel it "
        "first)",
        drafts_, start_));
  }
  const int64_t start = common_offset();
  if (start + drafts + 1 > INT32_MAX) {
    throw Error(fmt::format(
        "Speculation::begin: {} drafts from offset {} would end at {}, past the last position a "
        "batch holds ({})",
        drafts, start, start + drafts + 1, INT32_MAX));
  }
  // A schedule someone else left would block a rewind at accept, or be taken for the round's.
  for (const Layer& layer : layers_) {
    const ScheduleState s = layer.cache->schedule_state(seq_);
    if (!s.pending) continue;
    throw Error(fmt::format(
        "Speculation::begin: layer {} has captures scheduled for sequence {} ({}); a round "
        "needs every layer free of schedules (take or cancel them first)",
        layer.index, seq_, describe(s)));
  }
  const int64_t end = start + drafts + 1;  // where the verify forward leaves every layer
  offsets_.clear();
  for (int64_t o = start + 1; o < end; ++o) offsets_.push_back(o);
  // Attention rewinds; a whole-state layer rewinds only up to its limit (a window that has
  // evicted nothing), else it captures every draft offset.
  size_t prepared = 0;
  try {
    for (; prepared < layers_.size(); ++prepared) {
      Layer& layer = layers_[prepared];
      const RestoreRule rule = layer.cache->restore_rule();
      layer.capture =
          drafts > 0 && rule.kind == RestoreRule::Kind::whole_state && end > rule.rewind_limit;
      if (layer.capture) layer.cache->prepare_snapshots(seq_, offsets_);
    }
    // Each schedule's number, once every layer holds its own (one that throws: all cancelled).
    for (Layer& layer : layers_) {
      if (layer.capture) layer.serial = layer.cache->schedule_state(seq_).serial;
    }
  } catch (...) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      try {
        if (i < prepared && layers_[i].capture) layers_[i].cache->cancel_snapshots(seq_);
      } catch (...) {  // a kind whose cancel throws: the rest are still cancelled, and the
      }                // error begin reports is the one that stopped it
      layers_[i].capture = false;
    }
    throw;
  }
  start_ = start;
  drafts_ = drafts;
  open_ = true;
}

// Throws unless `layer` holds the round's captures: one per draft offset, in order.
void Speculation::check_captures(const Layer& layer) const {
  const auto& captures = layer.snapshots;
  bool ours = static_cast<int64_t>(captures.size()) == drafts_;
  for (size_t j = 0; ours && j < captures.size(); ++j) {
    ours = captures[j] != nullptr && captures[j]->to() == start_ + 1 + static_cast<int64_t>(j);
  }
  if (ours) return;
  throw Error(fmt::format(
      "Speculation::accept: layer {} gave {} captures for sequence {}, not the round's {} at "
      "offsets {} to {} (its schedule was taken or replaced, or an accept that failed released "
      "them): the round cannot return there; cancel it",
      layer.index, captures.size(), seq_, drafts_, start_ + 1, start_ + drafts_));
}

// Whether `s` (of `layer`) is the schedule this round installed: the one prepare_snapshots made
// then, where the kind numbers its schedules (ScheduleState::serial); else one of the round's
// offsets, start+1 .. start+drafts (ascending and unique, so the ends and the count say it all).
bool Speculation::is_round_schedule(const Layer& layer, const ScheduleState& s) const {
  if (!s.pending) return false;
  if (layer.serial != 0) return s.serial == layer.serial;
  return s.count == drafts_ && s.first == start_ + 1 && s.last == start_ + drafts_;
}

// Whether `layer` holds the round's schedule (or does not say: a kind that does not report its
// schedule is checked on what take_snapshots gives).
bool Speculation::holds_round_schedule(const Layer& layer) const {
  const ScheduleState s = layer.cache->schedule_state(seq_);
  return !s.known || is_round_schedule(layer, s);
}

// Throws unless `layer` can return to `target` without touching anyone else's schedule: a
// capturing layer that must move holds the round's captures, all made; a layer that rewinds
// holds no schedule. Changes nothing.
void Speculation::check_layer(const Layer& layer, int64_t target) const {
  // At the verify forward's end, a layer stays: a capturing one only releases the round's captures.
  if (target == start_ + drafts_ + 1) return;
  if (layer.taken) return check_captures(layer);
  const ScheduleState s = layer.cache->schedule_state(seq_);
  if (!s.known) return;
  if (layer.capture) {
    if (is_round_schedule(layer, s) && s.reached == s.count) return;
    throw Error(fmt::format(
        "Speculation::accept: the round's captures of sequence {} at offsets {} to {} on layer "
        "{} were taken, replaced or lost (out of memory while the verify forward made them; its "
        "schedule now: {}): the round cannot return there; cancel it",
        seq_, start_ + 1, start_ + drafts_, layer.index, describe(s)));
  }
  if (s.pending) {
    throw Error(fmt::format(
        "Speculation::accept: layer {} has captures scheduled for sequence {} ({}), not the "
        "round's, and must rewind to offset {}: take or cancel them, then accept again",
        layer.index, seq_, describe(s), target));
  }
}

// Throws unless accept(accepted) can move every layer (see accept); changes nothing.
void Speculation::check_accept(int64_t accepted) const {
  if (moving_ >= 0 && accepted != moving_) {
    throw Error(fmt::format(
        "Speculation::accept: an accept of {} drafts ran out of memory after moving some layers; "
        "accept {} again to move the rest, or cancel the round",
        moving_, moving_));
  }
  const int64_t end = start_ + drafts_ + 1, target = start_ + accepted + 1;
  for (const Layer& layer : layers_) {
    const int64_t offset = layer.cache->offset(seq_);
    if (offset == (layer.moved ? target : end)) continue;
    throw Error(
        layer.moved
            ? fmt::format("Speculation::accept: layer {} of sequence {} stands at offset {}; the "
                          "accept that ran out of memory had moved it to {}",
                          layer.index, seq_, offset, target)
            : fmt::format("Speculation::accept: layer {} of sequence {} stands at offset {}; the "
                          "verify forward of {} tokens from {} leaves every layer at {}",
                          layer.index, seq_, offset, drafts_ + 1, start_, end));
  }
  for (const Layer& layer : layers_) {
    if (moving_ < 0 || !layer.capture) {
      check_layer(layer, target);
    } else if (!layer.moved && (layer.snapshots.size() <= static_cast<size_t>(accepted) ||
                                layer.snapshots[static_cast<size_t>(accepted)] == nullptr)) {
      throw Error(
          fmt::format("Speculation::accept: internal error: layer {} lost its capture at offset {}",
                      layer.index, target));
    }
  }
}

void Speculation::accept(int64_t accepted) {
  if (!open_) throw Error("Speculation::accept: no round is open (call begin first)");
  if (accepted < 0 || accepted > drafts_) {
    throw Error(
        fmt::format("Speculation::accept: accepted {} is outside [0, {}] (the round's drafts)",
                    accepted, drafts_));
  }
  const int64_t end = start_ + drafts_ + 1, target = start_ + accepted + 1;
  check_accept(accepted);  // everything, before any layer moves
  if (target == end) {
    // Every draft confirmed: no layer moves, and the captures are only released — dropped with
    // their schedule, not taken (taking refuses a capture lost out of memory, which nothing
    // needs now).
    for (Layer& layer : layers_) {
      if (layer.capture && !layer.taken && holds_round_schedule(layer)) {
        layer.cache->cancel_snapshots(seq_);
      }
      layer.snapshots.clear();
      layer.capture = layer.taken = false;
    }
  } else {
    for (Layer& layer : layers_) {
      if (!layer.capture || layer.taken) continue;
      layer.cache->take_snapshots_into(seq_, layer.snapshots);
      layer.taken = true;
      check_captures(layer);  // a kind that does not report its schedule
    }
    // Only the capture at the accepted offset is restored; the others go first, so no restore
    // copies out their views of the columns it writes (a wrapped window's own capture is still
    // copied to rewrite the ring). The whole-state restores run before the rewinds, which cannot
    // fail: a first restore that throws leaves every layer at the verify forward's end.
    for (Layer& layer : layers_) {
      for (size_t j = 0; j < layer.snapshots.size(); ++j) {
        if (j != static_cast<size_t>(accepted)) layer.snapshots[j].reset();
      }
    }
    moving_ = accepted;  // from here on, only this count can finish the round
    for (const bool whole_state : {true, false}) {
      for (Layer& layer : layers_) {
        if (layer.capture != whole_state || layer.moved) continue;
        Snapshot* capture =
            whole_state ? layer.snapshots[static_cast<size_t>(accepted)].get() : nullptr;
        // The layer's own capture: the restore moves the offset or adopts the shared state.
        if (!layer.cache->restore(seq_, capture, target)) {
          throw Error(fmt::format(
              "Speculation::accept: internal error: layer {} could not return to offset {}",
              layer.index, target));
        }
        ++(whole_state ? stats_.restores : stats_.rewinds);
        layer.snapshots.clear();  // released before the next write can make it copy out
        layer.moved = true;
      }
    }
    for (Layer& layer : layers_) layer.capture = layer.taken = layer.moved = false;
  }
  moving_ = -1;
  open_ = false;
  ++stats_.rounds;
  stats_.drafted += drafts_;
  stats_.accepted += accepted;
}

void Speculation::cancel() {
  if (!open_) return;
  for (Layer& layer : layers_) {
    // Only the round's own schedule: one that replaced it belongs to someone else.
    if (layer.capture && !layer.taken && holds_round_schedule(layer)) {
      layer.cache->cancel_snapshots(seq_);
    }
    layer.snapshots.clear();
    layer.capture = layer.taken = layer.moved = false;
  }
  moving_ = -1;
  open_ = false;
}

}  // namespace kvsnap
