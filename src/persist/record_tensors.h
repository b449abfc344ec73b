// Internal: snapshot records written as tensors of a sealed kvsnap file — the one way snapshot
// files, prefix-cache files and tier objects write snapshot data.
//
// A lazy snapshot's record views its live cache (`record.live`). Once record() has returned, a
// forward on another thread may copy the snapshot's tokens out of the viewed columns and
// overwrite them, so such tensors are not copied from the record's arrays: encode_sealed copies
// them under that cache's lock, from wherever the snapshot's tokens lie then
// (StateSnapshot::copy_record). A paged snapshot's tokens are copied the same way, straight from
// its blocks, so a file or object taking a few of its tokens does not gather them all first.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cache/snapshot_record.h"
#include "cache/state_snapshot.h"
#include "persist/safetensors.h"

namespace kvsnap::detail {

// What a file writes of a snapshot: its record, and where the data is copied from when the
// record's arrays are not it (null when they are).
struct RecordToWrite {
  SnapshotRecord record;
  const StateSnapshot* source = nullptr;
};

// For a built-in snapshot: a lazy one's record (views of its live cache, copied from the
// snapshot under the cache's lock), a paged one's outline (its tokens copied from its blocks by
// each file or object that takes them, never gathered whole first), else its record (owned
// arrays). nullopt for a kind kvsnap cannot store.
inline std::optional<RecordToWrite> record_to_write(const Snapshot& snapshot) {
  const StateSnapshot* state = as_state_snapshot(&snapshot);
  if (state == nullptr) return std::nullopt;
  if (std::optional<SnapshotRecord> outline = state->record_outline()) {
    return RecordToWrite{std::move(*outline), state};
  }
  SnapshotRecord record = state->record();
  const bool live = record.live;
  return RecordToWrite{std::move(record), live ? state : nullptr};
}

class RecordTensors {
 public:
  // Appends `record`'s arrays to `file` as tensors `first` and `second`. `source`: where the
  // data is copied from when the arrays are not it (RecordToWrite::source), else null; `column`:
  // where the record's first token lies in source's record (a slice's first token; 0 for a whole
  // record).
  void add(SafetensorsFile& file, std::string first, std::string second,
           const SnapshotRecord& record, const StateSnapshot* source, int64_t column = 0);

  // encode_sealed(file), each live record's data copied under its cache's lock; every other
  // tensor from its array.
  std::string encode_sealed(SafetensorsFile file) const;

 private:
  struct Live {
    const StateSnapshot* source;
    bool second;
    int64_t column;
  };
  std::vector<std::optional<Live>> live_;  // per tensor of the file, as far as records go
};

}  // namespace kvsnap::detail
