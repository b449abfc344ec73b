#include <fmt/format.h>

#include <algorithm>

#include "kvsnap/attention.h"

namespace kvsnap {

AttentionMask AttentionMask::none() { return AttentionMask(); }

AttentionMask AttentionMask::causal() {
  AttentionMask mask;
  mask.causal_ = true;
  return mask;
}

AttentionMask AttentionMask::sliding_window(int64_t window) {
  if (window < 1) {
    throw Error(fmt::format("AttentionMask::sliding_window: window {} must be >= 1", window));
  }
  AttentionMask mask = lookback(window);
  mask.causal_ = true;
  return mask;
}

AttentionMask AttentionMask::lookback(int64_t window) {
  if (window < 1) {
    throw Error(fmt::format("AttentionMask::lookback: window {} must be >= 1", window));
  }
  AttentionMask mask;
  mask.window_ = window;
  return mask;
}

AttentionMask AttentionMask::from_array(Array additive_or_bool) {
  if (additive_or_bool.empty() || additive_or_bool.ndim() != 4) {
    throw Error(
        fmt::format("AttentionMask::from_array: mask is {}; need a 4-d array [B|1, Hq|1, "
                    "L, P]",
                    additive_or_bool.describe()));
  }
  AttentionMask mask;
  mask.arrays_.push_back(std::move(additive_or_bool));
  return mask;
}

AttentionMask AttentionMask::intersect(const AttentionMask& other) const {
  AttentionMask mask = *this;
  mask.causal_ = causal_ || other.causal_;
  if (other.window_ > 0) {
    mask.window_ = window_ > 0 ? std::min(window_, other.window_) : other.window_;
  }
  mask.arrays_.insert(mask.arrays_.end(), other.arrays_.begin(), other.arrays_.end());
  return mask;
}

AttentionMask AttentionMask::for_row(int64_t row) const {
  AttentionMask mask = *this;
  for (Array& array : mask.arrays_) {
    if (array.dim(0) == 1) continue;  // one slice for every row
    if (row < 0 || row >= array.dim(0)) {
      throw Error(fmt::format("AttentionMask::for_row: row {} is outside [0, {}) of the mask {}",
                              row, array.dim(0), array.describe()));
    }
    array = array.slice(0, row, row + 1);
  }
  return mask;
}

AttentionMask::Kind AttentionMask::kind() const {
  if (arrays_.empty()) {
    if (window_ > 0) return causal_ ? Kind::sliding_window : Kind::lookback;
    return causal_ ? Kind::causal : Kind::none;
  }
  if (!causal_ && window_ == 0 && arrays_.size() == 1) return Kind::array;
  return Kind::intersection;
}

}  // namespace kvsnap
