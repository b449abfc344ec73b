#include "kvsnap/speculation.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvsnap {

Speculation::Speculation(std::vector<Cache*> layers, SeqId seq) : seq_(seq) {
  layers_.reserve(layers.size());
  for (Cache* cache : layers) layers_.push_back(Layer{cache, false, {}});
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

void Speculation::begin(int64_t drafts) {
  if (drafts < 0) {
    throw Error(fmt::format("Speculation::begin: drafts {} must be >= 0", drafts));
  }
  if (open_) {
    throw Error(fmt::format(
        "Speculation::begin: a round of {} drafts from offset {} is open (accept or cancel it "
        "first)",
        drafts_, start_));
  }
  int64_t start = -1;
  for (const Layer& layer : layers_) {
    if (layer.cache == nullptr) continue;
    const int64_t offset = layer.cache->offset(seq_);
    if (start >= 0 && offset != start) {
      throw Error(fmt::format(
          "Speculation::begin: the layers of sequence {} stand at offsets {} and {}; a round "
          "starts where every layer is",
          seq_, start, offset));
    }
    start = offset;
  }
  start = std::max<int64_t>(start, 0);
  const int64_t end = start + drafts + 1;  // where the verify forward leaves every layer
  offsets_.clear();
  for (int64_t o = start + 1; o < end; ++o) offsets_.push_back(o);
  // Attention rewinds; a whole-state layer rewinds only up to its limit (a window that has
  // evicted nothing), else it captures every draft offset.
  size_t prepared = 0;
  try {
    for (; prepared < layers_.size(); ++prepared) {
      Layer& layer = layers_[prepared];
      if (layer.cache == nullptr) continue;
      const RestoreRule rule = layer.cache->restore_rule();
      layer.capture =
          drafts > 0 && rule.kind == RestoreRule::Kind::whole_state && end > rule.rewind_limit;
      if (layer.capture) layer.cache->prepare_snapshots(seq_, offsets_);
    }
  } catch (...) {
    for (size_t i = 0; i < prepared; ++i) {
      if (layers_[i].capture) layers_[i].cache->cancel_snapshots(seq_);
      layers_[i].capture = false;
    }
    throw;
  }
  start_ = start;
  drafts_ = drafts;
  open_ = true;
}

void Speculation::accept(int64_t accepted) {
  if (!open_) throw Error("Speculation::accept: no round is open (call begin first)");
  if (accepted < 0 || accepted > drafts_) {
    throw Error(
        fmt::format("Speculation::accept: accepted {} is outside [0, {}] (the round's drafts)",
                    accepted, drafts_));
  }
  const int64_t end = start_ + drafts_ + 1, target = start_ + accepted + 1;
  for (const Layer& layer : layers_) {
    if (layer.cache == nullptr || layer.cache->offset(seq_) == end) continue;
    throw Error(fmt::format(
        "Speculation::accept: a layer of sequence {} stands at offset {}; the verify forward of "
        "{} tokens from {} leaves every layer at {}",
        seq_, layer.cache->offset(seq_), drafts_ + 1, start_, end));
  }
  for (Layer& layer : layers_) {
    if (layer.cache == nullptr) continue;
    bool ok = true;
    if (layer.capture) {
      layer.cache->take_snapshots_into(seq_, layer.snapshots);
      if (target < end) {
        // The capture at draft offset start + 1 + j is snapshots[j]; the cache's own capture,
        // so the restore moves the offset or adopts the shared state: nothing is copied.
        ok = layer.cache->restore(seq_, layer.snapshots[static_cast<size_t>(accepted)].get(),
                                  target);
        ++stats_.restores;
      }
      layer.snapshots.clear();  // released before the next write can make them copy out
    } else if (target < end) {
      ok = layer.cache->restore(seq_, nullptr, target);
      ++stats_.rewinds;
    }
    if (!ok) {
      throw Error(fmt::format(
          "Speculation::accept: internal error: a layer could not return to offset {}", target));
    }
    layer.capture = false;
  }
  open_ = false;
  ++stats_.rounds;
  stats_.drafted += drafts_;
  stats_.accepted += accepted;
}

void Speculation::cancel() {
  if (!open_) return;
  for (Layer& layer : layers_) {
    if (layer.capture) layer.cache->cancel_snapshots(seq_);
    layer.capture = false;
  }
  open_ = false;
}

}  // namespace kvsnap
