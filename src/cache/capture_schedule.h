// Internal: the offsets a cache was asked to capture (prepare_snapshots) and what it captured.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvsnap/cache.h"

namespace kvsnap::detail {

class CaptureSchedule {
 public:
  // Installs `offsets` for a cache now at `current`. Throws Error naming `call` unless offsets
  // are ascending, unique, >= current, and the previous schedule was taken. No offsets install
  // nothing: the schedule stays inactive (nothing to take, nothing to wait for).
  void prepare(std::span<const int64_t> offsets, int64_t current, const char* call);
  // The same, then `capture_now()` (an offset at `current` is captured at once): a prepare that
  // runs out there schedules nothing (cleared) and rethrows.
  template <class CaptureNow>
  void prepare(std::span<const int64_t> offsets, int64_t current, const char* call,
               CaptureNow&& capture_now) {
    prepare(offsets, current, call);
    try {
      capture_now();
    } catch (...) {
      clear();
      throw;
    }
  }
  // Throws the Error prepare(offsets, current, call) would; changes nothing.
  void check(std::span<const int64_t> offsets, int64_t current, const char* call) const;

  // True between prepare and take.
  bool active() const { return active_; }
  // Cache::schedule_state of the sequence this schedule belongs to.
  ScheduleState state() const;
  // Throws Error naming `call` while a schedule is pending (the cache may not move backwards).
  void require_idle(const char* call) const;

  // The next offset still to capture, or -1 (also once a capture was lost).
  int64_t next() const {
    return !lost_ && captured_.size() < offsets_.size() ? offsets_[captured_.size()] : -1;
  }
  // The offset k places after next() (upcoming(0) is next() while active), or -1.
  int64_t upcoming(size_t k) const {
    const size_t i = captured_.size() + k;
    return active_ && !lost_ && i < offsets_.size() ? offsets_[i] : -1;
  }
  // Records the capture `make()` makes for next(). For kinds whose capture a later write could
  // not make (a window's or a state's would hold a later one): when making it throws (out of
  // memory) the schedule is lost there and the exception rethrown — nothing more is captured,
  // take() throws saying so, and take_reached() gives the captures before it.
  template <class Make>
  void record_or_lose(Make&& make) {
    SnapshotPtr made;
    try {
      made = make();
    } catch (...) {
      lost_ = true;
      throw;
    }
    record(std::move(made));
  }
  // Where the edge of the next capture begins: the last captured offset, else the offset at
  // prepare time.
  int64_t edge_start() const { return captured_.empty() ? start_ : offsets_[captured_.size() - 1]; }
  // Scheduled offsets o, not yet captured, with lo < o < hi, relative to lo.
  std::vector<int64_t> interior(int64_t lo, int64_t hi) const;
  // Records the capture for next().
  void record(SnapshotPtr snapshot) { captured_.push_back(std::move(snapshot)); }
  // Each capture recorded and not yet taken.
  template <class Visit>
  void for_each_captured(Visit visit) const {
    for (const SnapshotPtr& s : captured_) {
      if (s != nullptr) visit(*s);
    }
  }

  // Returns the captures and clears the schedule. Throws Error naming `call` (and keeps the
  // schedule) when an offset was not reached by `current`.
  std::vector<SnapshotPtr> take(int64_t current, const char* call);
  // The same into `into` (cleared first): the two buffers swap, so neither side allocates once
  // both have grown to the schedule's size.
  void take_into(std::vector<SnapshotPtr>& into, int64_t current, const char* call);
  // How many scheduled offsets o, not yet captured, have lo < o < hi (interior(lo, hi).size(),
  // without allocating).
  size_t interior_count(int64_t lo, int64_t hi) const;
  // Returns the captures recorded so far and clears the schedule.
  std::vector<SnapshotPtr> take_reached();
  void clear();

 private:
  // Throws the Error take(current, call) throws when it cannot give every capture.
  void check_complete(int64_t current, const char* call) const;

  bool active_ = false;
  bool lost_ = false;
  uint64_t serial_ = 0;  // ScheduleState::serial of the pending schedule
  int64_t start_ = 0;
  std::vector<int64_t> offsets_;
  std::vector<SnapshotPtr> captured_;
};

}  // namespace kvsnap::detail
