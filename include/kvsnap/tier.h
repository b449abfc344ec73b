// Tier — a store of restore points shared by many processes, below the prefix cache: a request
// one process evaluated restores in another (or after a restart) instead of being recomputed.
//
//   kvsnap::TierOptions options;
//   options.model_fingerprint = config_json + weights_hash;  // what makes the state valid
//   options.tenant = "team-a";                                // the operator's isolation salt
//   options.key = kvsnap::load_tier_key("/etc/kvsnap/tier.key");  // optional: authenticity
//   auto tier = kvsnap::Tier::open("redis://:secret@10.0.0.5:6379/2", layers, options);
//   kvsnap::PrefixCache prefix(layers, {.tier = tier});  // begin asks it on a miss; close
//                                                        // writes behind
//
// Backends: `redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]` (hiredis; AUTH and SELECT as given; every
// key carries a TTL, so Redis under `maxmemory` with an eviction policy just shortens matches) and
// `dir:PATH` (a folder of files, the same objects; a file unused for the TTL is removed).
//
// Keys: a BLAKE2b hash chained over the prompt's tokens, rooted in the format version, the chunk
// size, the model fingerprint, the layer configuration, the tenant salt and the scope (the MAC
// key's id where a key is given, so processes with other keys miss each other's objects; else,
// for a dir: store, this user's id). Attention (KV) data
// lives in fixed-size token chunks, each stored once and shared by every prompt that contains it;
// whole-state layers (sliding window, recurrent) and the KV tail after the last full chunk are one
// object per restore point, listed in a per-chunk index. A restore point counts only when every
// layer has what it needs at that exact offset; otherwise a shorter one is used — never mixed
// offsets, never a partial restore.
//
// Integrity: every object is a sealed safetensors file (xxHash64 over every byte, lengths
// checked) naming its key, format version and root. With a key (TierOptions::key), each also
// carries a keyed BLAKE2b MAC over its key name and bytes: an object forged without the key,
// copied from another key name or tenant, or signed with another key is rejected. Rejected
// objects are counted, logged and never restored. Without a key the tier runs in "trusted
// store" mode (said once through TierOptions::log): damage is caught, forgery is not.
//
// Time: lookups wait at most TierOptions::lookup_timeout for the store (a slow or dead store
// costs a request no more); writes are encoded at close and sent by a background thread through
// a bounded queue (a full queue drops the batch, counted). Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvsnap/cache.h"
#include "kvsnap/export.h"

namespace kvsnap {

namespace detail {
class TierImpl;
}  // namespace detail

struct TierOptions {
  // What makes stored state valid for this model: its configuration and weights (any bytes, or
  // a hash of them). Required: states of another model are never restored.
  std::string model_fingerprint;
  // The operator's isolation boundary: processes with another tenant salt never find these
  // entries. Never take it from a request.
  std::string tenant;
  // MAC key material (load_tier_key), at least 16 bytes; empty: trusted-store mode.
  std::string key;
  // Tokens per KV chunk object, in [1, 32768]. Part of the key root: processes must agree to
  // share. A Redis index set (a chunk's restore points) listing more than 16 members per token
  // of it is taken for planted: rejected and deleted.
  int64_t chunk_tokens = 256;
  // The largest object written, in [1, 512 MiB] (Redis's default proto-max-bulk-len, the most
  // either store reads back; lower it to a server's smaller setting). A chunk larger than this
  // is not written, nor anything after it in its session (its restore points need it); a
  // larger restore point alone is left out. Said once in the log, counted in store_errors:
  // lower chunk_tokens.
  int64_t max_object_bytes = int64_t(512) << 20;
  // The most object bytes one lookup holds, all it reads together (the chunks and the restore
  // point, as the store sent them), in [1, 2^50]; lookup's max_bytes lowers it per call (a
  // PrefixCache passes its budget). A restore point that needs more is passed over for a
  // shallower one that fits (one whose chunks alone would pass it is never fetched: their sizes
  // come with the probe); a store sending more than it announced costs that lookup only.
  // Said once in the log, counted in store_errors: raise it for long prompts on wide models.
  int64_t max_lookup_bytes = int64_t(8) << 30;
  // The most a lookup waits for the store, all round trips together. This, write_timeout and
  // retry_interval must be in [0, 24 h] (open refuses others).
  std::chrono::milliseconds lookup_timeout{50};
  // How long one write batch may take before the writer gives up on it.
  std::chrono::milliseconds write_timeout{2000};
  // After a failed connection or round trip, the store is not tried again for this long.
  std::chrono::milliseconds retry_interval{500};
  // Lifetime of stored keys, in [1 s, 100 years]; refreshed when a lookup reads them. (A dir:
  // store removes files unused for this long.)
  std::chrono::seconds ttl{std::chrono::hours(24)};
  // Write batches (one per closed session) waiting for the writer; more are dropped.
  int64_t write_queue = 64;
  // Bytes of objects waiting for the writer (and being written): a session's batch that would
  // pass it is dropped (counted in dropped_batches) before its objects are encoded, so a slow
  // or stalled store costs at most this much memory — or one batch, when a single one is larger
  // (it goes when nothing else waits, so a session that large is still stored).
  int64_t write_queue_bytes = int64_t(1) << 30;
  // One line per event worth an operator's attention (trusted-store mode, rejected objects,
  // the store lost or back). Default: "kvsnap tier: ..." on stderr. Called from any thread,
  // also from inside a PrefixCache's close with that cache's lock held and from the tier's
  // writer: it must not call the prefix cache (a deadlock) nor this tier (a flush would wait on
  // the writer that called it); hand the line to a queue or a logger.
  // Control characters in a line (text the store sent) arrive written as \xNN; an exception
  // it throws loses that line only.
  std::function<void(const std::string&)> log;
};

// Counters since open. bytes_* count object bytes (values) moved.
struct TierStats {
  // Lookups with something to ask the store (more than better_than, a budget above 0), also
  // those that then could not ask it: cut short waiting for another lookup, or made while a
  // store that failed moments ago is not tried again yet.
  int64_t lookups = 0;
  int64_t hits = 0;  // lookups that returned a restore point
  // Tokens the restore points returned add to what their callers held (offset - better_than).
  int64_t restored_tokens = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t timeouts = 0;         // lookups cut short by lookup_timeout
  int64_t rejected = 0;         // objects damaged, truncated, foreign or unauthenticated
  int64_t unauthenticated = 0;  // of those, objects without a valid MAC
  int64_t objects_written = 0;  // objects the store accepted
  int64_t dropped_batches = 0;  // write batches dropped: the queue was full, the store failed, or
                                // writing them ran out of memory
  int64_t store_errors = 0;     // failed connections, round trips or refused writes
  // Time lookups and stores took on the callers' threads (what requests waited for the tier;
  // the writes themselves run on the tier's own thread).
  int64_t caller_microseconds = 0;
};

// Tokens [from, to) of a restore point: per layer, the KV data of [from, to) (ranged layers),
// and in the last segment only, the state at `to` (whole-state layers); null elsewhere.
struct TierSegment {
  int64_t from = 0, to = 0;
  std::vector<SnapshotPtr> snapshots;  // one per layer; owned
};

// The longest restore point found: `segments` cover [first segment's from, offset) in order.
struct TierMatch {
  int64_t offset = 0;  // 0: nothing found
  std::vector<TierSegment> segments;
};

// A restore point to store: the state of every whole-state layer at `offset` (null for others).
struct TierPoint {
  int64_t offset = 0;
  std::vector<const Snapshot*> states;  // one per layer; not owned
};

class KVSNAP_EXPORT Tier {
 public:
  // Opens the store at `address` (see above) for `layers` (a null entry is a stateless layer;
  // not owned: the PrefixCache's layers). Throws Error for a malformed address, an empty model
  // fingerprint, a key shorter than 16 bytes or a chunk size < 1 — never because the store is
  // unreachable (it is tried again later; lookups miss meanwhile).
  [[nodiscard]] static std::shared_ptr<Tier> open(const std::string& address,
                                                  std::vector<Cache*> layers, TierOptions options);
  // Throws Error naming `address` and the rule unless it is a well-formed address.
  static void check_address(const std::string& address);
  // Waits (at most write_timeout plus the queue) for queued writes, then stops the writer.
  ~Tier();
  Tier(const Tier&) = delete;
  Tier& operator=(const Tier&) = delete;

  // The deepest restore point t of `tokens` with better_than < t <= limit, every layer's data at
  // t included. Segments start at the chunk boundary at or below `better_than` (the caller
  // holds KV data for [0, better_than) already), and hold at most max_bytes and
  // TierOptions::max_lookup_bytes of objects (<= 0: nothing is asked). Empty when nothing is
  // found, the store fails or the timeout passes. Never throws for the store's sake.
  [[nodiscard]] TierMatch lookup(std::span<const int32_t> tokens, int64_t limit,
                                 int64_t better_than = 0,
                                 int64_t max_bytes = std::numeric_limits<int64_t>::max());
  // Queues `points` of `tokens` for writing: each with the whole states given and the KV data
  // of [0, offset) taken from `ranges` (per layer: a snapshot whose range covers [0, the largest
  // offset), null for other layers). Data is copied before returning (the snapshots may change
  // afterwards); chunks this process wrote or read are not written again. Never blocks on the
  // store; a full queue drops the batch (counted).
  void store(std::span<const int32_t> tokens, std::span<const Snapshot* const> ranges,
             std::span<const TierPoint> points);
  // store for a caller whose request must not fail for the tier's sake (PrefixCache::close
  // calls it): never throws. A store that throws (points this tier refuses: a layout other than
  // the one it learned, say) or runs out of memory is counted in store_errors and logged
  // (TierOptions::log, the first time), and nothing is queued; returns false then.
  bool offer(std::span<const int32_t> tokens, std::span<const Snapshot* const> ranges,
             std::span<const TierPoint> points) noexcept;
  // offer with the KV data's snapshots taken by `take_ranges` (per layer, as `ranges` above)
  // inside: what taking them throws (a custom cache's snapshot, memory) is counted and logged
  // alike, and nothing is queued.
  bool offer(std::span<const int32_t> tokens,
             const std::function<std::vector<SnapshotPtr>()>& take_ranges,
             std::span<const TierPoint> points) noexcept;
  // Waits until every queued write has been tried (or `timeout` passes: longer than a year
  // counts as a year); true when drained.
  bool flush(std::chrono::milliseconds timeout = std::chrono::seconds(10));

  TierStats stats() const;
  const std::vector<Cache*>& layers() const;
  // The address with any password replaced by "***".
  std::string address() const;
  // Whether objects carry a MAC (a key was given).
  bool authenticated() const;

 private:
  explicit Tier(std::unique_ptr<detail::TierImpl> impl);
  std::unique_ptr<detail::TierImpl> impl_;
};

// Reads a MAC key from `path`: a regular file owned by the user running kvsnap (or root) that
// group and others can neither read nor write, in a folder they cannot write (or a sticky one,
// like /tmp; only the folder that holds the file is checked), like OpenSSH's private keys,
// holding 16 bytes to 1 MiB (trailing whitespace ignored), e.g.
// `head -c 32 /dev/urandom > tier.key; chmod 600 tier.key`. Returns its contents, trailing
// whitespace removed (for TierOptions::key). Throws Error naming the path, its owner and mode
// and what is wrong otherwise.
[[nodiscard]] KVSNAP_EXPORT std::string load_tier_key(const std::string& path);
// Reads a tier address (which may hold a Redis password, kept out of command lines and
// environments this way) from `path`, a file checked as load_tier_key checks key files;
// surrounding whitespace is dropped. Throws Error naming the path and what is wrong, the
// address's password redacted.
[[nodiscard]] KVSNAP_EXPORT std::string load_tier_address(const std::string& path);

}  // namespace kvsnap
