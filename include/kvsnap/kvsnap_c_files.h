/* kvsnap_c_files.h — saved state in a folder that several users share (persistence.h's
 * SaveOptions and LoadOptions). Part of kvsnap_c.h, which includes it; its conventions hold
 * (statuses, kvsnap_last_error, destroy calls).
 *
 * By default kvsnap's files are this user's alone: saved mode 0600, and a load refuses a file,
 * or the folder holding it, that another user (neither this one nor root) owns or that group or
 * others can write, since whoever can write it can plant state the model then continues from.
 * A save without KVSNAP_SAVE_SHARED also refuses (writing nothing) a folder its own load would
 * refuse. These calls take flags that opt out, for a cache folder its users share on purpose:
 *
 *   kvsnap_prefix_cache_save_with(prefix, "/srv/cache", id, KVSNAP_SAVE_SHARED);      // 0644
 *   kvsnap_prefix_cache_load_with(other, "/srv/cache", id, KVSNAP_LOAD_ALLOW_SHARED);
 *
 * Each call refuses (KVSNAP_INVALID_ARGUMENT, changing nothing) a flag that is not its own. */
#ifndef KVSNAP_KVSNAP_C_FILES_H
#define KVSNAP_KVSNAP_C_FILES_H

#include "kvsnap/kvsnap_c.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvsnap_file_flags {
  KVSNAP_FILE_PRIVATE = 0, /* the defaults: saved 0600, loaded only when private */
  /* Saves: mode 0644, so the other users of a shared folder can load it — and read what it
   * holds. The folders a save creates stay 0700: make a shared folder yourself. */
  KVSNAP_SAVE_SHARED = 1,
  /* Loads: trust a file or folder another user owns or others can write — and every user who
   * can write it (LoadOptions::allow_shared). */
  KVSNAP_LOAD_ALLOW_SHARED = 2
} kvsnap_file_flags;

/* kvsnap_prefix_cache_save with flags: KVSNAP_SAVE_SHARED or none. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_save_with(const kvsnap_prefix_cache* prefix,
                                                          const char* dir, const char* model_id,
                                                          uint32_t flags);
/* kvsnap_prefix_cache_load with flags: KVSNAP_LOAD_ALLOW_SHARED or none. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_load_with(kvsnap_prefix_cache* prefix,
                                                          const char* dir, const char* model_id,
                                                          uint32_t flags);
/* kvsnap_prefix_cache_saved_in with flags (KVSNAP_LOAD_ALLOW_SHARED or none): whether `dir`
 * holds a saved trie that a load with them would not refuse as not private (the load still checks
 * the model id and the layers). False for an unknown flag. */
KVSNAP_EXPORT bool kvsnap_prefix_cache_saved_in_with(const char* dir, uint32_t flags);
/* kvsnap_save_snapshots with flags: KVSNAP_SAVE_SHARED or none. */
KVSNAP_EXPORT kvsnap_status kvsnap_save_snapshots_with(const char* path, int64_t offset,
                                                       const kvsnap_snapshot* const* snapshots,
                                                       size_t count, uint32_t flags);
/* kvsnap_load_snapshots with flags: KVSNAP_LOAD_ALLOW_SHARED or none. */
KVSNAP_EXPORT kvsnap_status kvsnap_load_snapshots_with(const char* path, uint32_t flags,
                                                       int64_t* offset, kvsnap_snapshot_list** out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVSNAP_KVSNAP_C_FILES_H */
