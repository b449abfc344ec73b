#include "cache/capture_schedule.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>

namespace kvsnap::detail {

void CaptureSchedule::prepare(std::span<const int64_t> offsets, int64_t current, const char* call) {
  check(offsets, current, call);
  if (offsets.empty()) return;
  // Each allocates (only when its capacity is short) before it changes anything: one that runs
  // out leaves no schedule at all.
  captured_.clear();
  captured_.reserve(offsets.size());
  offsets_.assign(offsets.begin(), offsets.end());
  lost_ = false;
  start_ = current;
  active_ = true;
  static std::atomic<uint64_t> schedules{0};
  serial_ = ++schedules;
}

void CaptureSchedule::check(std::span<const int64_t> offsets, int64_t current,
                            const char* call) const {
  if (active_) {
    throw Error(
        fmt::format("{}: the previous schedule [{}] was not taken (call take_snapshots "
                    "first)",
                    call, fmt::join(offsets_, ", ")));
  }
  int64_t previous = current - 1;
  for (int64_t offset : offsets) {
    if (offset < current) {
      throw Error(fmt::format("{}: offset {} in [{}] is already passed (cache offset {})", call,
                              offset, fmt::join(offsets, ", "), current));
    }
    if (offset <= previous) {
      throw Error(fmt::format("{}: offsets [{}] must be ascending and unique", call,
                              fmt::join(offsets, ", ")));
    }
    previous = offset;
  }
}

ScheduleState CaptureSchedule::state() const {
  ScheduleState out;
  out.pending = active_;
  out.count = static_cast<int64_t>(offsets_.size());
  if (!offsets_.empty()) {
    out.first = offsets_.front();
    out.last = offsets_.back();
  }
  out.reached = static_cast<int64_t>(captured_.size());
  out.serial = active_ ? serial_ : 0;
  return out;
}

void CaptureSchedule::require_idle(const char* call) const {
  if (active_) {
    throw Error(
        fmt::format("{}: captures at [{}] are scheduled; take_snapshots() before moving "
                    "the cache",
                    call, fmt::join(offsets_, ", ")));
  }
}

std::vector<int64_t> CaptureSchedule::interior(int64_t lo, int64_t hi) const {
  std::vector<int64_t> out;
  if (lost_) return out;
  for (size_t i = captured_.size(); i < offsets_.size(); ++i) {
    if (offsets_[i] > lo && offsets_[i] < hi) out.push_back(offsets_[i] - lo);
  }
  return out;
}

void CaptureSchedule::check_complete(int64_t current, const char* call) const {
  if (lost_) {
    throw Error(fmt::format(
        "{}: the capture at offset {} was lost (out of memory when a write reached it); "
        "take_reached_snapshots() gives the {} before it",
        call, offsets_[captured_.size()], captured_.size()));
  }
  if (captured_.size() < offsets_.size()) {
    const int64_t next = offsets_[captured_.size()];
    if (next <= current) {  // reached, but its capture ran out of memory (a KV range's)
      throw Error(fmt::format(
          "{}: scheduled offset {} was reached (cache offset {}) but its capture ran out of "
          "memory; the next write makes it (a zero-length update will do)",
          call, next, current));
    }
    throw Error(
        fmt::format("{}: scheduled offset {} not reached (cache offset {})", call, next, current));
  }
}

std::vector<SnapshotPtr> CaptureSchedule::take(int64_t current, const char* call) {
  check_complete(current, call);
  std::vector<SnapshotPtr> out = std::move(captured_);
  clear();
  return out;
}

void CaptureSchedule::take_into(std::vector<SnapshotPtr>& into, int64_t current, const char* call) {
  check_complete(current, call);
  into.clear();
  into.swap(captured_);
  clear();
}

size_t CaptureSchedule::interior_count(int64_t lo, int64_t hi) const {
  size_t count = 0;
  if (lost_) return count;
  for (size_t i = captured_.size(); i < offsets_.size(); ++i) {
    if (offsets_[i] > lo && offsets_[i] < hi) ++count;
  }
  return count;
}

std::vector<SnapshotPtr> CaptureSchedule::take_reached() {
  std::vector<SnapshotPtr> out = std::move(captured_);
  clear();
  return out;
}

void CaptureSchedule::clear() {
  active_ = false;
  lost_ = false;
  offsets_.clear();
  captured_.clear();
  start_ = 0;
}

}  // namespace kvsnap::detail
