// Internal: the folder backend of the tier — the same objects as files in one folder (written
// atomically), index sets as subfolders of empty files named by their members. The deadline is
// checked between files and between reads of a file (local files seldom block; they are never
// FIFOs or devices, see fetch). Objects and index sets expire as Redis's do: unused for the
// TTL, they are removed (a sweep on the writing connection).
#pragma once

#include <time.h>

#include <chrono>
#include <limits>
#include <string>

#include "tier/store.h"

namespace kvsnap::detail {

class DirStore final : public Store {
 public:
  // Creates `folder` when missing. Throws Error when it is not a folder or cannot be created.
  // With `own_files_only` (no MAC key: ownership is all that says who wrote an object) the
  // folder must be private — this user's or root's, not writable by group or others unless
  // sticky — else Error naming it; and a file another user owns reads as missing (and is never
  // swept). `ttl`: how long an object or index set lives unused (0: for ever). `health` (may be
  // null) is told of writes the folder refuses (full, read-only, gone), and of their recovery.
  explicit DirStore(std::string folder, bool own_files_only = false,
                    std::chrono::seconds ttl = std::chrono::seconds(0),
                    std::shared_ptr<StoreHealth> health = nullptr);

  // A write's temporary this old is a dead writer's: no live write takes this long (the write
  // timeout bounds a batch). By age, not by process id: the folder may be shared by hosts or
  // containers whose process ids this one cannot see.
  static constexpr std::chrono::hours kStaleTemporary{1};
  // How often write sweeps the folder (one listing of it): an eighth of the TTL, between a
  // second and kStaleTemporary. Not when a store opens: opening stays cheap however many objects
  // the folder holds, and a connection that only reads (lookups) never lists it.
  std::chrono::seconds sweep_interval() const;

  void probe(std::span<const std::string> sets, std::span<const std::string> keys,
             Deadline deadline, std::vector<std::vector<std::string>>& members,
             std::vector<int64_t>& sizes) override;
  // An object's name holding anything but a regular file of at most kMaximumObjectBytes — a
  // link (not followed), a FIFO (not waited on), a device, a socket, a folder — reads as missing
  // (nullopt), as a missing name does: a planted file costs restores, never a request's time
  // past the deadline nor its memory. A file that is there but cannot be read: StoreFailure.
  std::vector<std::optional<std::string>> fetch(std::span<const std::string> keys,
                                                Deadline deadline, int64_t max_bytes) override;
  // Index entries are never made through a link: an index folder's name holding a link (or
  // anything but a folder) is left alone and its entries are skipped (probe lists nothing
  // there), and a member's file is created only when its name is free (O_EXCL|O_NOFOLLOW).
  // Sweeps first when sweep_interval() has passed since the last sweep.
  Refused write(const WriteBatch& batch, Deadline deadline) override;

  // Lifetimes, as Redis's TTLs: writing an object or an index entry, fetching an object or
  // finding it in probe, and probing an index set start them afresh (their modification times).
  // A sweep removes, of the names this store writes (kvsnap-c-, -p-, -i-, -clock-; nothing else
  // in the folder) and of this user's files only with own_files_only: objects and index sets
  // unused for the TTL, and temporaries older than kStaleTemporary. Links are removed, never
  // followed; an index folder loses its entries (never recursing), then goes when empty. It stops
  // at the deadline, and the next sweep goes on from there.
  // `most`: entries looked at before it stops as at the deadline (tests).
  void sweep(Deadline deadline, int64_t most = std::numeric_limits<int64_t>::max());

 private:
  Refused write_batch(const WriteBatch& batch, Deadline deadline);
  // The file of key `key` ("kvsnap:c:..." -> "<folder>/kvsnap-c-...").
  std::string path(const std::string& key) const;

  std::string folder_;
  bool own_files_only_;
  std::chrono::seconds ttl_;
  std::shared_ptr<StoreHealth> health_;
  std::chrono::steady_clock::time_point next_sweep_{};  // the first write sweeps
  int64_t sweep_resume_ = 0;  // entries of the folder the next sweep skips (the last stopped)
};

}  // namespace kvsnap::detail
