// Internal: snapshot records written as tensors of a sealed kvsnap file — the one way snapshot
// files, prefix-cache files and tier objects write snapshot data.
//
// A lazy snapshot's record views its live cache (`record.live`). Once record() has returned, a
// forward on another thread may copy the snapshot's tokens out of the viewed columns and
// overwrite them, so such tensors are not copied from the record's arrays: encode_sealed copies
// them under that cache's lock, from wherever the snapshot's tokens lie then
// (StateSnapshot::copy_record).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cache/snapshot_record.h"
#include "cache/state_snapshot.h"
#include "persist/safetensors.h"

namespace kvsnap::detail {

// The snapshot `record` (taken from `snapshot`) views while it is live, else null.
inline const StateSnapshot* live_source(const SnapshotRecord& record, const Snapshot& snapshot) {
  return record.live ? as_state_snapshot(&snapshot) : nullptr;
}

class RecordTensors {
 public:
  // Appends `record`'s arrays to `file` as tensors `first` and `second`. `source`: the snapshot
  // the record views while it is live (live_source), else null; `column`: where the record's
  // first token lies in source's record (a slice's first token; 0 for a whole record).
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
