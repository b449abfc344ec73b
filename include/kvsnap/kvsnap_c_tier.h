/* kvsnap_c_tier.h — the C API of the shared tier (kvsnap/tier.h): restore points shared by
 * processes through a folder ("dir:PATH") or Redis ("redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]"),
 * below a prefix cache, which asks it on a miss and writes what sessions evaluate behind them.
 * Includes kvsnap_c.h; its conventions hold (statuses, kvsnap_last_error, destroy calls).
 *
 *   kvsnap_tier_options options = kvsnap_tier_options_default();
 *   options.model_fingerprint = fingerprint;  (the model's configuration and weights, or a hash)
 *   options.model_fingerprint_size = fingerprint_size;
 *   kvsnap_tier* tier = NULL;
 *   kvsnap_tier_open("redis://:secret@10.0.0.5:6379/2", layers, count, &options, &tier);
 *   kvsnap_prefix_cache* prefix = NULL;
 *   kvsnap_prefix_cache_create_with_tier(layers, count, NULL, tier, &prefix);
 *   kvsnap_tier_destroy(tier);  (the prefix cache keeps it while it lives)
 *
 * A slow, failing or hostile store costs restores, never a request. Threads: a tier may be
 * called from several threads at once. */
#ifndef KVSNAP_KVSNAP_C_TIER_H
#define KVSNAP_KVSNAP_C_TIER_H

#include "kvsnap/kvsnap_c.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvsnap_tier kvsnap_tier;

/* TierOptions (kvsnap/tier.h), which says what each does; start from kvsnap_tier_options_default.
 * Byte strings are read during kvsnap_tier_open only. */
typedef struct kvsnap_tier_options {
  const void* model_fingerprint; /* required: states of another model never restore */
  size_t model_fingerprint_size;
  const char* tenant; /* the operator's isolation salt; NULL: "" */
  const void* key;    /* MAC key (kvsnap_load_tier_key), >= 16 bytes; NULL: trusted store */
  size_t key_size;
  int64_t chunk_tokens;
  int64_t max_object_bytes;
  int64_t max_lookup_bytes;
  int64_t lookup_timeout_ms;
  int64_t write_timeout_ms;
  int64_t retry_interval_ms;
  int64_t ttl_seconds;
  int64_t write_queue;
  int64_t write_queue_bytes;
  /* One line per event worth an operator's attention, called from any thread: the tier's writer
   * thread, and the thread of a call that looks up, stores or flushes (kvsnap_prefix_cache_begin,
   * kvsnap_session_close, with the prefix cache's lock held, kvsnap_tier_flush, the destroy
   * calls, which wait for the writer). It must not call the tier
   * or its prefix caches, nor wait for a lock such a call's thread may hold. NULL: "kvsnap
   * tier: ..." on stderr. `log_context` must stay valid until the tier is gone: after
   * kvsnap_tier_destroy and the destroy of every prefix cache holding it. */
  void (*log)(void* context, const char* line);
  void* log_context;
} kvsnap_tier_options;

typedef struct kvsnap_tier_stats {
  int64_t lookups, hits, restored_tokens, bytes_read, bytes_written, timeouts, rejected,
      unauthenticated, objects_written, dropped_batches, store_errors, caller_microseconds;
} kvsnap_tier_stats;

/* TierOptions' defaults, no fingerprint. */
KVSNAP_EXPORT kvsnap_tier_options kvsnap_tier_options_default(void);
/* Opens the store at `address` for `count` layers, borrowed: they must outlive the tier and any
 * prefix cache holding it, and be the prefix cache's own. Fails (KVSNAP_INVALID_ARGUMENT) for a
 * negative duration, or a key that is not NULL with key_size 0; (KVSNAP_ERROR) for a malformed
 * address or other options; never because the store is unreachable (lookups miss until it
 * answers). */
KVSNAP_EXPORT kvsnap_status kvsnap_tier_open(const char* address, kvsnap_cache* const* layers,
                                             size_t count, const kvsnap_tier_options* options,
                                             kvsnap_tier** out);
/* Lets go of this handle's hold: the tier goes (waiting for its queued writes, at most the write
 * timeout) once no prefix cache holds it either. */
KVSNAP_EXPORT void kvsnap_tier_destroy(kvsnap_tier* tier);
KVSNAP_EXPORT kvsnap_status kvsnap_tier_get_stats(const kvsnap_tier* tier, kvsnap_tier_stats* out);
/* Waits until every queued write has been tried, at most `timeout_ms`; *drained says whether. */
KVSNAP_EXPORT kvsnap_status kvsnap_tier_flush(kvsnap_tier* tier, int64_t timeout_ms, bool* drained);
/* The address, any password replaced by "***"; valid while the handle lives. NULL for NULL. */
KVSNAP_EXPORT const char* kvsnap_tier_address(const kvsnap_tier* tier);
/* Whether objects carry a MAC (a key was given). */
KVSNAP_EXPORT bool kvsnap_tier_authenticated(const kvsnap_tier* tier);

/* kvsnap_prefix_cache_create with `tier` (opened for the same layers; NULL: none), which the
 * prefix cache holds while it lives. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_create_with_tier(
    kvsnap_cache* const* layers, size_t count, const kvsnap_prefix_options* options,
    kvsnap_tier* tier, kvsnap_prefix_cache** out);

/* A MAC key from a private file (load_tier_key: this user's, mode 0600, in a folder others
 * cannot write, 16 bytes to 1 MiB once trailing whitespace, a text key's newline, is dropped:
 * every kvsnap process reads one file as one key) into `buffer`; *size is its length. When
 * `capacity` is smaller, fails (KVSNAP_INVALID_ARGUMENT) with *size set and `buffer`
 * untouched (a NULL buffer of capacity 0 asks for the size); any other failure leaves *size as
 * it was. */
KVSNAP_EXPORT kvsnap_status kvsnap_load_tier_key(const char* path, void* buffer, size_t capacity,
                                                 size_t* size);
/* A tier address from a file checked as key files are, NUL-terminated into `buffer`; *size is its
 * length without the NUL. Fails as kvsnap_load_tier_key when `capacity` <= *size. */
KVSNAP_EXPORT kvsnap_status kvsnap_load_tier_address(const char* path, char* buffer,
                                                     size_t capacity, size_t* size);

#ifdef __cplusplus
}
#endif

#endif /* KVSNAP_KVSNAP_C_TIER_H */
