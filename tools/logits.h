// The logits each reply token was chosen from, kept for the runs' agreement check (compare) —
// on disk, not in memory: a run's rows go to a temporary file of its own, created already
// unlinked (nothing is left behind, even after a kill -9) and read back a row at a time. Every
// row of both runs had been kept in memory until the check: 1000 regenerations of 4096 tokens
// over a 512-token vocabulary are 8 GB a run.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "workload.h"

namespace kvsnap::tools {

// Rows of floats appended to a temporary file in logits_folder(), buffered; positions are byte
// offsets. One thread at a time.
class LogitsTape {
 public:
  // Throws Error "replay: cannot keep reply logits in <folder> (<why>)".
  LogitsTape();
  ~LogitsTape();
  LogitsTape(const LogitsTape&) = delete;
  LogitsTape& operator=(const LogitsTape&) = delete;

  // Appends `row`; returns where it lies. Throws Error on a failed write (a full disk).
  int64_t append(std::span<const float> row);
  // Reads the row of `out.size()` floats at `position` into `out`.
  void read(int64_t position, std::span<float> out) const;
  // Bytes appended so far.
  int64_t bytes() const { return written_ + static_cast<int64_t>(buffer_.size()); }

 private:
  void flush() const;

  int fd_ = -1;
  mutable int64_t written_ = 0;       // bytes in the file
  mutable std::vector<char> buffer_;  // bytes after them, not yet written
};

// Where tapes lie: $TMPDIR when set, else /var/tmp (disk, where /tmp may be memory), else /tmp.
std::string logits_folder();

// One request's rows, each where it lies on its run's tape.
class LogitRows {
 public:
  LogitRows() = default;
  explicit LogitRows(std::shared_ptr<LogitsTape> tape) : tape_(std::move(tape)) {}
  // Rows of a run made by hand (tests), on a tape of their own.
  static LogitRows of(const std::vector<std::vector<float>>& rows);

  // Appends a row (every row of a request is as wide); a request without a tape gets one.
  void push_back(std::span<const float> row);
  size_t size() const { return positions_.size(); }
  bool empty() const { return positions_.empty(); }
  int64_t width() const { return width_; }
  // Row `i`, read back into `out` (resized to the width).
  void read(size_t i, std::vector<float>& out) const;
  // Every row, read back.
  std::vector<std::vector<float>> all() const;

 private:
  std::shared_ptr<LogitsTape> tape_;
  std::vector<int64_t> positions_;
  int64_t width_ = 0;
};

// Throws InputError before any work unless logits_folder() takes a tape (LogitsTape's Error)
// and has room for what `runs` runs of `workload` may keep (every request's max_tokens rows of
// `vocab` floats, each run): "replay: the agreement check keeps every reply token's logits, up
// to N bytes ... in <folder>, which has M free; set TMPDIR to a folder with room". The room is
// not checked when the free space cannot be read.
void check_logits_room(const Workload& workload, int64_t vocab, int runs);

}  // namespace kvsnap::tools
