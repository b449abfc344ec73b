// Internal, offered to the layers above: when array copies bypass the CPU caches (streaming
// stores, in strided_copy), and the scope that asks them to.
#pragma once

#include <cstdint>

namespace kvsnap::detail {

// The last-level cache's size (sysfs), else 32 MiB, from which a copy streams: one whose runs are
// longer than a kilobyte and that moves this many bytes or more (its first lines would be gone
// from the cache before its last are written). 0 where this build never streams (no SSE2, or
// under a sanitizer, which would not see the streaming stores: memcpy instead).
int64_t strided_copy_stream_span();

// While one made with `on` lives, this thread's copies of runs longer than a kilobyte stream
// whatever their size: for writes into a history larger than the last-level cache, which
// attention reads from its first column on, so the columns just written would be pushed out of
// the cache before it reaches them (KVStore::write).
class StreamingWrites {
 public:
  explicit StreamingWrites(bool on);
  ~StreamingWrites();
  StreamingWrites(const StreamingWrites&) = delete;
  StreamingWrites& operator=(const StreamingWrites&) = delete;

 private:
  bool on_;
};

}  // namespace kvsnap::detail
