/* The README's C example (ctest c_api_example): an engine's buffers into a KV cache without a
 * copy, a lazy snapshot, a rewind and a restore, and an error as a status and kvsnap's message. */
#include <kvsnap/kvsnap_c.h>
#include <stdio.h>

int main(void) {
  static float keys[1 * 2 * 4 * 8], values[1 * 2 * 4 * 8]; /* [B, H, L, D], the engine's */
  const int64_t shape[4] = {1, 2, 4, 8};
  kvsnap_array *k = NULL, *v = NULL;
  kvsnap_array_wrap(keys, KVSNAP_F32, 4, shape, NULL, NULL, NULL, &k); /* no copy */
  kvsnap_array_wrap(values, KVSNAP_F32, 4, shape, NULL, NULL, NULL, &v);

  kvsnap_cache* cache = NULL;
  kvsnap_kv_cache_create(&cache);
  int32_t offsets[1] = {0};
  kvsnap_batch batch = {.batch_size = 1, .length = 4, .seq_offsets = offsets};
  kvsnap_kv_history history = {0}; /* keys and values for attention: the cache's buffers */
  if (kvsnap_cache_update(cache, &batch, k, v, &history) != KVSNAP_OK) {
    fprintf(stderr, "kvsnap: %s\n", kvsnap_last_error());
    return 1;
  }

  kvsnap_snapshot* snapshot = NULL;
  bool restored = false;
  kvsnap_cache_snapshot(cache, 0, &snapshot);          /* lazy [0, 4): no copy */
  kvsnap_cache_restore(cache, NULL, 2, &restored);     /* rewind (rejected draft tokens) */
  kvsnap_cache_restore(cache, snapshot, 4, &restored); /* and back */

  const int64_t passed[1] = {1};
  if (kvsnap_cache_prepare_snapshots(cache, passed, 1) == KVSNAP_ERROR) {
    printf("%s\n", kvsnap_last_error()); /* KVCache::prepare_snapshots: offset 1 ... */
  }

  kvsnap_kv_history_clear(&history);
  kvsnap_snapshot_destroy(snapshot);
  kvsnap_cache_destroy(cache);
  kvsnap_array_destroy(k);
  kvsnap_array_destroy(v);
  return restored ? 0 : 1;
}
