// Snapshots on disk: a layer-indexed set of snapshots (any built-in kind, null entries allowed)
// in one safetensors file, so cached state survives a restart.
//
//   kvsnap::save_snapshots("turn3.safetensors", cache.offset(), {s0.get(), nullptr, s2.get()});
//   kvsnap::LoadedSnapshots loaded = kvsnap::load_snapshots("turn3.safetensors");
//   (void)cache.restore(loaded.snapshots[0].get(), loaded.offset);
//
// The file is plain safetensors (readable by other tools): tensors `layer.<i>.keys` /
// `layer.<i>.values` (KV and rotating kinds) or `layer.<i>.conv` / `layer.<i>.delta`
// (recurrent), and `__metadata__` with the format version (2), the offset, each layer's kind,
// offsets and (rotating) window, and `checksum`: the xxHash64, as 16 hex digits, of every byte
// of the file with those 16 digits written as '0'. Any damaged byte — data, header, padding,
// length — fails the check, and the file is rejected whole with a kvsnap::Error. Writes are
// atomic (temporary file `<path>.tmp-<pid>-<n>-<place>`, one per save, fsync, rename): a crash
// mid-save leaves the previous file loadable, saves of one path from several threads each
// succeed (the file is the last one renamed, whole), and the next save or load of `path` removes
// temporaries of writers that no longer run (a load only in the folder it checked: not in a
// link's folder). A save refuses, writing nothing, what a load would refuse: an offset past 2^40,
// more than 2^20 layers, a header over the 100 MB safetensors readers accept.
//
// Files are private: created mode 0600 whatever the umask, in folders a load trusts (else the
// save is refused; SaveOptions::shared writes 0644 files for shared folders). Loading refuses
// (Error naming the path, its owner and mode, and LoadOptions::allow_shared) a file, or the folder
// holding it, that another user (neither this one nor root) owns or that group or others can write:
// whoever can write it can plant state the model then continues from, and the checksum does not
// stop them (anyone can recompute it). See README.md, "Security".
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "kvsnap/cache.h"
#include "kvsnap/export.h"

namespace kvsnap {

struct LoadedSnapshots {
  int64_t offset = 0;                  // as saved
  std::vector<SnapshotPtr> snapshots;  // one per layer; owned; null where null was saved
};

// How loaders (load_snapshots, PrefixCache::load and saved_in) treat files they did not make
// private themselves.
struct LoadOptions {
  // By default a file, or the folder holding it, is refused unless this process's effective
  // user or root owns it (root can change any file anyway: OpenSSH's StrictModes trusts the
  // same two) and group and others cannot write it; a sticky folder like /tmp may be writable by
  // others. The check is made on the opened file, so what passed is what is read. true: trust a
  // shared cache anyway — and every user who can write it.
  bool allow_shared = false;
};

// How save_snapshots and PrefixCache::save write their file.
struct SaveOptions {
  // false: mode 0600, this user's alone, and only into a folder a default load trusts (one this
  // user or root owns that group and others cannot write, or a sticky one like /tmp that this
  // user or root owns): a save refuses, writing nothing, a folder where its own load would
  // refuse the file. true: mode
  // 0644, so the other users of a shared folder can load it (with LoadOptions::allow_shared) —
  // and read what it holds —, into any folder.
  bool shared = false;
};

// Writes `snapshots` (lazy ones are read from their cache, not materialized: under the cache's
// lock, so another thread may write the sequences they were taken from meanwhile) with `offset`.
// Throws Error for a snapshot of a kind kvsnap cannot store or that cannot restore `offset` (a KV
// range restores any offset in [from, to], a window its end or, while it has evicted nothing, an
// earlier one, a recurrent state its own: loading checks the same), or when the file cannot be
// written, or (without options.shared) into a folder a load would refuse: see SaveOptions; and,
// before anything else, for a path that names no file (empty, ending in '/', '.' or '..').
KVSNAP_EXPORT void save_snapshots(const std::string& path, int64_t offset,
                                  std::span<const Snapshot* const> snapshots);
KVSNAP_EXPORT void save_snapshots(const std::string& path, int64_t offset,
                                  const std::vector<SnapshotPtr>& snapshots);
KVSNAP_EXPORT void save_snapshots(const std::string& path, int64_t offset,
                                  std::initializer_list<const Snapshot*> snapshots);
KVSNAP_EXPORT void save_snapshots(const std::string& path, int64_t offset,
                                  std::span<const Snapshot* const> snapshots,
                                  const SaveOptions& options);
KVSNAP_EXPORT void save_snapshots(const std::string& path, int64_t offset,
                                  const std::vector<SnapshotPtr>& snapshots,
                                  const SaveOptions& options);
KVSNAP_EXPORT void save_snapshots(const std::string& path, int64_t offset,
                                  std::initializer_list<const Snapshot*> snapshots,
                                  const SaveOptions& options);
// Reads a file written by save_snapshots. Throws Error naming the file and what is wrong.
[[nodiscard]] KVSNAP_EXPORT LoadedSnapshots load_snapshots(const std::string& path);
[[nodiscard]] KVSNAP_EXPORT LoadedSnapshots load_snapshots(const std::string& path,
                                                           const LoadOptions& options);

// The same as bytes (what the files hold).
KVSNAP_EXPORT std::string encode_snapshots(int64_t offset,
                                           std::span<const Snapshot* const> snapshots);
[[nodiscard]] KVSNAP_EXPORT LoadedSnapshots decode_snapshots(const std::string& bytes,
                                                             const std::string& source);

}  // namespace kvsnap
