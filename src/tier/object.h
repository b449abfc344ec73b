// Internal: one tier object — a sealed safetensors file (persist/files.h: xxHash64 over every
// byte, lengths checked) with per-layer snapshot data for a token range, whose metadata names
// the object's key, the tier root (version, model, layers, tenant) and what it holds; with a MAC
// key it is followed by a 32-byte tag: keyed BLAKE2b over the key name and those bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cache/snapshot_record.h"
#include "cache/state_snapshot.h"
#include "kvsnap/error.h"

namespace kvsnap::detail {

// What an object holds: a chunk, the KV data of [from, to); a restore point, the KV data of
// [from, to) (the tail after the last full chunk, none when empty) and every whole-state layer's
// state at `to`.
struct ObjectSpec {
  enum class Kind { chunk, point } kind = Kind::chunk;
  int64_t from = 0, to = 0;
};

// The kind of snapshot a layer takes; nullopt for a stateless layer.
std::optional<SnapshotRecord::Kind> layer_kind(const Cache* layer);
// "KV", "sliding-window" or "recurrent".
const char* record_kind_name(SnapshotRecord::Kind kind);

// Whether an object of `spec` holds data for `layer` (KV layers: a non-empty range; whole-state
// layers: points only; stateless layers: never).
bool object_holds(const ObjectSpec& spec, const Cache* layer);

// Why an object read from the store is not used. `unauthenticated`: its MAC is missing or wrong.
struct ObjectRejected : Error {
  ObjectRejected(const std::string& reason, bool unauthenticated)
      : Error(reason), unauthenticated(unauthenticated) {}
  bool unauthenticated;
};

// One layer's data in an object: a record (or a slice of one along the token axis). Where its
// arrays are not the data (`record.live`: views of a live cache, or a paged snapshot's outline),
// `source` is the snapshot they came from and `column` the slice's first token in source's
// record: the data is copied from wherever the snapshot's tokens lie when the object is encoded,
// under that cache's lock — another thread's forward may have copied them out of the viewed
// columns and overwritten those since; a paged snapshot's come straight from its blocks.
struct ObjectPart {
  SnapshotRecord record;
  const StateSnapshot* source = nullptr;
  int64_t column = 0;
};

// The part of `snapshot`'s record; nullopt for a snapshot of a kind kvsnap cannot store.
std::optional<ObjectPart> object_part(const Snapshot& snapshot);
// Tokens [from, to) of a KV part covering them.
ObjectPart slice_part(const ObjectPart& kv, int64_t from, int64_t to);

// The object `key` holding `parts` (per layer; nullopt where the spec holds nothing).
std::string encode_object(const std::string& key, const std::string& root_hex,
                          const ObjectSpec& spec,
                          const std::vector<std::optional<ObjectPart>>& parts);
// Appends the MAC tag of `key` over `value` (as encode_object left it).
void append_tag(std::string& value, const std::string& key, const std::string& mac_key);

// The longest header an object under `key` for `layers` layers may have: a few short metadata
// strings (the key among them) and two tensors a layer take well under it. A store anyone can
// write to could otherwise hand every reader a 100 MiB header, which costs GBs to parse.
uint64_t max_object_header(const std::string& key, size_t layers);

// Checks `value`, read from `key`, in this order: its MAC (with a MAC key), header length
// (max_object_header), structure and lengths, format and version, checksum, root and key name,
// then what it holds against `spec` and `layers` (kinds, ranges, windows, recurrent shapes).
// Returns one snapshot per layer as the spec says (null elsewhere). Throws ObjectRejected with
// the reason.
std::vector<SnapshotPtr> decode_object(std::string value, const std::string& key,
                                       const std::string& root_hex, const ObjectSpec& spec,
                                       const std::vector<Cache*>& layers,
                                       const std::string& mac_key);

}  // namespace kvsnap::detail
