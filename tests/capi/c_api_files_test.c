/* Saved state in a folder several users share, from C (kvsnap_c_files.h): a shared save is
 * mode 0644 and a private one 0600; a folder others can write is refused by the plain loads and
 * read with KVSNAP_LOAD_ALLOW_SHARED; each call refuses the flags that are not its own,
 * changing nothing. */
#define _XOPEN_SOURCE 700
#include <ftw.h>
#include <kvsnap/kvsnap_c.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "c_check.h"

static char folder[64]; /* the test's scratch folder */

/* Keys and values [1, 2, tokens, 4] at the cache's offset. */
static void append(kvsnap_cache* cache, int64_t tokens) {
  static float data[2 * 16 * 4];
  int64_t offset = 0;
  CHECK_OK(kvsnap_cache_offset(cache, &offset));
  int32_t offsets[1] = {(int32_t)offset};
  const kvsnap_batch batch = {.batch_size = 1, .length = tokens, .seq_offsets = offsets};
  const int64_t shape[4] = {1, 2, tokens, 4};
  for (int64_t i = 0; i < 2 * tokens * 4; ++i) data[i] = (float)(offset * 100 + i);
  kvsnap_array* kv = NULL;
  CHECK_OK(kvsnap_array_wrap(data, KVSNAP_F32, 4, shape, NULL, NULL, NULL, &kv));
  CHECK_OK(kvsnap_cache_update(cache, &batch, kv, kv, NULL));
  kvsnap_array_destroy(kv);
}

static const int32_t prompt[6] = {5, 4, 3, 2, 1, 0};

/* Serves `prompt` once; returns the tokens it restored. */
static int64_t serve(kvsnap_prefix_cache* prefix, kvsnap_cache* layer) {
  kvsnap_session* session = NULL;
  CHECK_OK(kvsnap_prefix_cache_begin(prefix, prompt, 6, &session));
  int64_t cached = -1;
  CHECK_OK(kvsnap_session_cached(session, &cached));
  append(layer, 6 - cached);
  CHECK_OK(kvsnap_session_prefill_done(session));
  CHECK_OK(kvsnap_session_close(session));
  kvsnap_session_destroy(session);
  return cached;
}

static mode_t mode_of(const char* path) {
  struct stat status;
  CHECK(stat(path, &status) == 0);
  return status.st_mode & 07777;
}

static void test_prefix_cache_in_a_shared_folder(void) {
  kvsnap_cache *layer = NULL, *other_layer = NULL;
  kvsnap_prefix_cache *prefix = NULL, *other = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&layer));
  CHECK_OK(kvsnap_kv_cache_create(&other_layer));
  CHECK_OK(kvsnap_prefix_cache_create(&layer, 1, NULL, &prefix));
  CHECK_OK(kvsnap_prefix_cache_create(&other_layer, 1, NULL, &other));
  CHECK(serve(prefix, layer) == 0);

  char shared[96], file[128], private_dir[96], private_file[128];
  snprintf(shared, sizeof shared, "%s/shared", folder);
  snprintf(file, sizeof file, "%s/prefix_cache.safetensors", shared);
  snprintf(private_dir, sizeof private_dir, "%s/private", folder);
  snprintf(private_file, sizeof private_file, "%s/prefix_cache.safetensors", private_dir);
  CHECK(mkdir(shared, 0700) == 0 && chmod(shared, 0777) == 0);

  /* A flag of another call is refused before anything is written. */
  CHECK_FAILS(kvsnap_prefix_cache_save_with(prefix, shared, "m", KVSNAP_LOAD_ALLOW_SHARED),
              KVSNAP_INVALID_ARGUMENT,
              "kvsnap_prefix_cache_save_with: flags 0x2 include 0x2, which this call does not "
              "take (it takes 0x1)");
  CHECK(!kvsnap_prefix_cache_saved_in_with(shared, KVSNAP_LOAD_ALLOW_SHARED));
  /* A private save refuses the folder its own load would refuse. */
  CHECK_FAILS(kvsnap_prefix_cache_save(prefix, shared, "m"), KVSNAP_ERROR,
              "PrefixCache::save: refusing the folder");
  CHECK(strstr(kvsnap_last_error(), "SaveOptions::shared") != NULL);
  CHECK_FAILS(kvsnap_prefix_cache_save_with(prefix, shared, "m", KVSNAP_FILE_PRIVATE), KVSNAP_ERROR,
              "PrefixCache::save: refusing the folder");
  CHECK(!kvsnap_prefix_cache_saved_in_with(shared, KVSNAP_LOAD_ALLOW_SHARED));
  CHECK_OK(kvsnap_prefix_cache_save_with(prefix, shared, "m", KVSNAP_SAVE_SHARED));
  CHECK(mode_of(file) == 0644);
  CHECK_OK(kvsnap_prefix_cache_save_with(prefix, private_dir, "m", KVSNAP_FILE_PRIVATE));
  CHECK(mode_of(private_file) == 0600 && mode_of(private_dir) == 0700);

  /* The folder others can write: the plain calls refuse it, the flag reads it. */
  CHECK(!kvsnap_prefix_cache_saved_in(shared));
  CHECK(!kvsnap_prefix_cache_saved_in_with(shared, KVSNAP_FILE_PRIVATE));
  CHECK(!kvsnap_prefix_cache_saved_in_with(shared, KVSNAP_SAVE_SHARED)); /* not a load flag */
  CHECK(kvsnap_prefix_cache_saved_in_with(shared, KVSNAP_LOAD_ALLOW_SHARED));
  CHECK_FAILS(kvsnap_prefix_cache_load(other, shared, "m"), KVSNAP_ERROR, "");
  CHECK(strstr(kvsnap_last_error(), "allow_shared") != NULL);
  CHECK_FAILS(kvsnap_prefix_cache_load_with(other, shared, "m", KVSNAP_SAVE_SHARED),
              KVSNAP_INVALID_ARGUMENT,
              "kvsnap_prefix_cache_load_with: flags 0x1 include 0x1, which this call does not "
              "take (it takes 0x2)");
  int64_t nodes = -1;
  CHECK_OK(kvsnap_prefix_cache_loaded_nodes(other, &nodes));
  CHECK(nodes == 0); /* nothing loaded by the refusals */
  CHECK_OK(kvsnap_prefix_cache_load_with(other, shared, "m", KVSNAP_LOAD_ALLOW_SHARED));
  CHECK_OK(kvsnap_prefix_cache_loaded_nodes(other, &nodes));
  CHECK(nodes > 0);
  CHECK(serve(other, other_layer) == 5); /* restored from the shared file (the last token is
                                            evaluated again for its logits) */
  CHECK_OK(kvsnap_prefix_cache_load_with(other, private_dir, "m", KVSNAP_LOAD_ALLOW_SHARED));
  CHECK_OK(kvsnap_prefix_cache_load(other, private_dir, "m"));

  kvsnap_prefix_cache_destroy(other);
  kvsnap_prefix_cache_destroy(prefix);
  kvsnap_cache_destroy(other_layer);
  kvsnap_cache_destroy(layer);
}

static void test_snapshot_file_others_can_write(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  append(cache, 3);
  kvsnap_snapshot* s = NULL;
  CHECK_OK(kvsnap_cache_snapshot(cache, 0, &s));
  char path[128];
  snprintf(path, sizeof path, "%s/turn.safetensors", folder);
  const kvsnap_snapshot* layers[1] = {s};
  CHECK_OK(kvsnap_save_snapshots(path, 3, layers, 1));
  CHECK(mode_of(path) == 0600 && chmod(path, 0666) == 0);

  int64_t offset = -1;
  kvsnap_snapshot_list* list = NULL;
  CHECK_FAILS(kvsnap_load_snapshots(path, &offset, &list), KVSNAP_ERROR, "load_snapshots: ");
  CHECK(strstr(kvsnap_last_error(), "refusing the file") != NULL);
  CHECK_FAILS(kvsnap_load_snapshots_with(path, KVSNAP_FILE_PRIVATE, &offset, &list), KVSNAP_ERROR,
              "load_snapshots: ");
  CHECK_FAILS(kvsnap_load_snapshots_with(path, 4 | KVSNAP_LOAD_ALLOW_SHARED, &offset, &list),
              KVSNAP_INVALID_ARGUMENT,
              "kvsnap_load_snapshots_with: flags 0x6 include 0x4, which this call does not take");
  CHECK(offset == -1 && list == NULL); /* refusals write no out-parameter */
  CHECK_OK(kvsnap_load_snapshots_with(path, KVSNAP_LOAD_ALLOW_SHARED, &offset, &list));
  CHECK(offset == 3 && kvsnap_snapshot_list_size(list) == 1);
  kvsnap_snapshot_list_destroy(list);

  /* Into a folder others can write: refused unless shared (0644), which its loads then allow. */
  char shared[96], in_shared[128];
  snprintf(shared, sizeof shared, "%s/shared_files", folder);
  snprintf(in_shared, sizeof in_shared, "%s/turn.safetensors", shared);
  CHECK(mkdir(shared, 0700) == 0 && chmod(shared, 0777) == 0);
  CHECK_FAILS(kvsnap_save_snapshots(in_shared, 3, layers, 1), KVSNAP_ERROR,
              "save_snapshots: refusing the folder");
  CHECK_FAILS(kvsnap_save_snapshots_with(in_shared, 3, layers, 1, KVSNAP_LOAD_ALLOW_SHARED),
              KVSNAP_INVALID_ARGUMENT,
              "kvsnap_save_snapshots_with: flags 0x2 include 0x2, which this call does not take "
              "(it takes 0x1)");
  struct stat status;
  CHECK(stat(in_shared, &status) != 0); /* nothing written by the refusals */
  CHECK_OK(kvsnap_save_snapshots_with(in_shared, 3, layers, 1, KVSNAP_SAVE_SHARED));
  CHECK(mode_of(in_shared) == 0644);
  list = NULL;
  CHECK_OK(kvsnap_load_snapshots_with(in_shared, KVSNAP_LOAD_ALLOW_SHARED, &offset, &list));
  CHECK(offset == 3 && kvsnap_snapshot_list_size(list) == 1);
  kvsnap_snapshot_list_destroy(list);
  kvsnap_snapshot_destroy(s);
  kvsnap_cache_destroy(cache);
}

static int remove_entry(const char* path, const struct stat* status, int flag, struct FTW* at) {
  (void)status, (void)flag, (void)at;
  return remove(path);
}

int main(void) {
  strcpy(folder, "/tmp/kvsnap_c_files_XXXXXX");
  if (mkdtemp(folder) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  test_prefix_cache_in_a_shared_folder();
  test_snapshot_file_others_can_write();
  nftw(folder, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (failures > 0) fprintf(stderr, "%d checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
