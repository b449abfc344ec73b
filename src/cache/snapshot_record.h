// Internal: the data of a built-in snapshot, for persistence — read out of any snapshot and
// turned back into an owned one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvsnap/cache.h"

namespace kvsnap::detail {

struct SnapshotRecord {
  enum class Kind { kv, rotating, recurrent };
  Kind kind = Kind::kv;
  Array first;   // kv, rotating: keys [B, H, T, D]; recurrent: conv tail [B, W-1, C]
  Array second;  // kv, rotating: values [B, H, T, Dv]; recurrent: delta state [B, Hv, Dv, Dk]
  int64_t from = 0, to = 0;  // kv: [from, to); whole-state kinds: from == to == the offset
  int64_t window = 0;        // rotating: the max_size of the cache it belongs to
  // The arrays are not the data to read: views of a cache's live buffers (a lazy snapshot's
  // columns), valid only until that cache's next write, which copies the snapshot's columns out
  // first and then overwrites them, on any thread; or an outline's placeholders
  // (StateSnapshot::record_outline). Read the data through StateSnapshot::copy_record (under the
  // cache's lock).
  bool live = false;
};

// Tokens a rotating snapshot ending at `end` holds for a window of `window`: every token while
// nothing was evicted, else the max_size - 1 the next query needs.
constexpr int64_t rotating_window_tokens(int64_t end, int64_t window) {
  return end <= window ? end : window - 1;
}

// The record of a KVCache, RotatingKVCache or RecurrentCache snapshot (arrays are views of the
// live cache while the snapshot is lazy: see SnapshotRecord::live); nullopt for any other kind.
std::optional<SnapshotRecord> snapshot_record(const Snapshot&);

// An owned snapshot holding `record`'s arrays. Throws Error naming `context` when the arrays and
// offsets are inconsistent (shapes, dtypes, ranges).
SnapshotPtr make_snapshot(SnapshotRecord record, const std::string& context);

// "kv", "rotating" or "recurrent".
const char* snapshot_kind_name(SnapshotRecord::Kind kind);

// What a layer is, as compact JSON, for checking saved state against the layer it returns to:
// {"kind":"none"} (null: stateless), {"kind":"kv"}, {"kind":"rotating","max_size":N},
// {"kind":"recurrent",...its five extents} or {"kind":"other"} (a kind kvsnap cannot store).
std::string describe_layer(const Cache* layer);

// The shapes a snapshot needs its layer's cache to have, with the token count left out (so every
// snapshot of one layer has the same signature); empty when a recurrent record does not have
// `layer`'s configured shapes.
std::string snapshot_signature(const SnapshotRecord& record, const Cache* layer);
// The signature snapshot_signature gives `snapshot`'s record, read from its layout without
// gathering its data; empty for a snapshot of a kind kvsnap does not know.
std::string held_signature(const Snapshot& snapshot, const Cache* layer);

// An owned KV snapshot of `parent`'s tokens then `child`'s (adjacent KV snapshots of any cache),
// adding the bytes copied to `copied`. Throws Error naming `call` when their layouts differ.
SnapshotPtr join_kv_snapshots(const Snapshot& parent, const Snapshot& child, const char* call,
                              int64_t& copied);

// Owned snapshots of each kind, defined next to each snapshot class.
SnapshotPtr make_kv_snapshot(Array keys, Array values, int64_t from);
SnapshotPtr make_rotating_snapshot(Array keys, Array values, int64_t end, int64_t window);
SnapshotPtr make_recurrent_snapshot(Array conv, Array delta, int64_t offset);

}  // namespace kvsnap::detail
