/* The shared tier from C: a second process's prefix cache restores, through a private folder,
 * what the first evaluated (the tokens' own data, checked); the prefix cache keeps the tier it
 * was given; keys and addresses from private files; every way a call is refused. */
#define _XOPEN_SOURCE 700
#include <ftw.h>
#include <kvsnap/kvsnap_c_tier.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "c_check.h"

static char folder[64];          /* the test's scratch folder */
static atomic_int log_lines;     /* the tier logs from its writer thread too */
static atomic_int trusted_lines; /* lines saying the store is trusted (no key) */

static void on_log(void* context, const char* line) {
  CHECK(context == &log_lines);
  ++log_lines;
  if (strstr(line, "trusted") != NULL) ++trusted_lines;
}

typedef struct process {
  kvsnap_cache* cache;
  kvsnap_tier* tier;
  kvsnap_prefix_cache* prefix;
} process;

static kvsnap_tier_options options_with(const void* key, size_t key_size) {
  kvsnap_tier_options options = kvsnap_tier_options_default();
  options.model_fingerprint = "test model";
  options.model_fingerprint_size = strlen("test model");
  options.chunk_tokens = 4;
  options.lookup_timeout_ms = 5000;
  options.key = key;
  options.key_size = key_size;
  options.log = on_log;
  options.log_context = &log_lines;
  return options;
}

static process open_process(const char* address, const void* key, size_t key_size) {
  process p = {NULL, NULL, NULL};
  CHECK_OK(kvsnap_kv_cache_create(&p.cache));
  kvsnap_cache* layers[2] = {p.cache, NULL};
  const kvsnap_tier_options options = options_with(key, key_size);
  CHECK_OK(kvsnap_tier_open(address, layers, 2, &options, &p.tier));
  CHECK_OK(kvsnap_prefix_cache_create_with_tier(layers, 2, NULL, p.tier, &p.prefix));
  return p;
}

static void close_process(process* p) {
  kvsnap_prefix_cache_destroy(p->prefix);
  kvsnap_tier_destroy(p->tier);
  kvsnap_cache_destroy(p->cache);
}

/* Keys and values [1, 2, n, 4] of `tokens`: element 0 of each head is the token id. */
static float kv_data[2 * 64 * 4];
static kvsnap_array* token_kv(const int32_t* tokens, int64_t n) {
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < 4; ++d)
        kv_data[(h * n + t) * 4 + d] = d == 0 ? (float)tokens[t] : 0.5f;
  const int64_t shape[4] = {1, 2, n, 4};
  kvsnap_array* array = NULL;
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, kv_data, &array));
  return array;
}

/* One request; returns the tokens restored. Its writes are flushed before it returns. */
static int64_t serve(process* p, const int32_t* prompt, size_t count) {
  kvsnap_session* session = NULL;
  int64_t cached = -1;
  CHECK_OK(kvsnap_prefix_cache_begin(p->prefix, prompt, count, &session));
  CHECK_OK(kvsnap_session_cached(session, &cached));
  const int32_t* remaining = NULL;
  size_t left = 0;
  CHECK_OK(kvsnap_session_remaining(session, &remaining, &left));
  int32_t offsets[1] = {(int32_t)cached};
  const kvsnap_batch batch = {.batch_size = 1, .length = (int64_t)left, .seq_offsets = offsets};
  kvsnap_array* kv = token_kv(remaining, (int64_t)left);
  CHECK_OK(kvsnap_cache_update(p->cache, &batch, kv, kv, NULL));
  kvsnap_array_destroy(kv);
  CHECK_OK(kvsnap_session_prefill_done(session));
  CHECK_OK(kvsnap_session_close(session));
  kvsnap_session_destroy(session);
  if (p->tier != NULL) { /* NULL: the prefix cache alone holds it */
    bool drained = false;
    CHECK_OK(kvsnap_tier_flush(p->tier, 10000, &drained));
    CHECK(drained);
  }
  return cached;
}

/* Whether the cache holds exactly `tokens`, in order. */
static bool holds(const kvsnap_cache* cache, const int32_t* tokens, int64_t n) {
  int32_t offsets[1] = {0};
  const kvsnap_batch batch = {.batch_size = 1, .length = 1, .seq_offsets = offsets};
  kvsnap_kv_history history = {0};
  CHECK_OK(kvsnap_cache_view(cache, &batch, &history));
  kvsnap_array_info info;
  CHECK_OK(kvsnap_array_get_info(history.values, &info));
  bool same = info.shape[2] == n;
  static float values[2 * 64 * 4];
  CHECK_OK(kvsnap_array_copy_to(history.values, values, sizeof values));
  for (int64_t t = 0; same && t < n; ++t) same = values[t * 4] == (float)tokens[t];
  kvsnap_kv_history_clear(&history);
  return same;
}

static void test_a_second_process_restores_what_the_first_evaluated(const char* address) {
  int32_t prompt[24];
  for (int i = 0; i < 24; ++i) prompt[i] = 100 + i;
  process first = open_process(address, NULL, 0);
  CHECK(trusted_lines == 1); /* no key: said once, at open */
  CHECK(!kvsnap_tier_authenticated(first.tier));
  CHECK(strcmp(kvsnap_tier_address(first.tier), address) == 0);
  CHECK(serve(&first, prompt, 20) == 0);
  kvsnap_tier_stats stats;
  CHECK_OK(kvsnap_tier_get_stats(first.tier, &stats));
  CHECK(stats.objects_written > 0 && stats.bytes_written > 0 && stats.store_errors == 0);
  close_process(&first);

  process second = open_process(address, NULL, 0); /* nothing in its trie */
  const int64_t cached = serve(&second, prompt, 22);
  CHECK(cached >= 16);                    /* from the tier, to a restore point of the first's */
  CHECK(holds(second.cache, prompt, 22)); /* what it restored, then the new tokens */
  CHECK_OK(kvsnap_tier_get_stats(second.tier, &stats));
  CHECK(stats.hits == 1 && stats.restored_tokens == cached && stats.bytes_read > 0);
  CHECK(stats.rejected == 0);
  close_process(&second);

  /* A prefix cache keeps the tier it was given: the handle goes, the writes still do. */
  process third = open_process(address, NULL, 0);
  kvsnap_tier_destroy(third.tier);
  third.tier = NULL;
  CHECK(serve(&third, prompt, 24) >= 16);
  close_process(&third); /* the tier goes with the prefix cache, its writes flushed */
  process fourth = open_process(address, NULL, 0);
  CHECK(serve(&fourth, prompt, 24) >= 20); /* what the third evaluated */
  close_process(&fourth);
}

static void test_keys_and_addresses_from_private_files(const char* address) {
  char path[128];
  snprintf(path, sizeof path, "%s/tier.key", folder);
  FILE* file = fopen(path, "w");
  CHECK(file != NULL);
  fputs("0123456789abcdef0123456789abcdef\n", file);
  fclose(file);
  CHECK(chmod(path, 0600) == 0);
  char key[64];
  size_t size = 0;
  CHECK_FAILS(kvsnap_load_tier_key(path, key, 8, &size), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_load_tier_key: a buffer of 8 bytes; it needs 32");
  CHECK(size == 32);
  size = 0; /* asking for the size: a NULL buffer of no capacity */
  CHECK_FAILS(kvsnap_load_tier_key(path, NULL, 0, &size), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_load_tier_key: a buffer of 0 bytes; it needs 32");
  CHECK(size == 32);
  size = 7; /* a NULL buffer that claims room: refused, *size untouched */
  CHECK_FAILS(kvsnap_load_tier_key(path, NULL, sizeof key, &size), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_load_tier_key: buffer is NULL");
  CHECK(size == 7);
  CHECK_OK(kvsnap_load_tier_key(path, key, sizeof key, &size));
  CHECK(size == 32 && memcmp(key, "0123456789abcdef0123456789abcdef", 32) == 0);
  process keyed = open_process(address, key, size);
  CHECK(kvsnap_tier_authenticated(keyed.tier));
  close_process(&keyed);
  CHECK(chmod(path, 0644) == 0);
  CHECK_FAILS(kvsnap_load_tier_key(path, key, sizeof key, &size), KVSNAP_ERROR, "");
  CHECK(strstr(kvsnap_last_error(), "tier.key") != NULL);

  snprintf(path, sizeof path, "%s/tier.address", folder);
  file = fopen(path, "w");
  CHECK(file != NULL);
  fputs("redis://:s3cret@127.0.0.1:1/0\n", file);
  fclose(file);
  CHECK(chmod(path, 0600) == 0);
  char text[64];
  CHECK_FAILS(kvsnap_load_tier_address(path, text, 29, &size), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_load_tier_address: a buffer of 29 bytes; it needs 30");
  CHECK_OK(kvsnap_load_tier_address(path, text, sizeof text, &size));
  CHECK(size == 29 && strcmp(text, "redis://:s3cret@127.0.0.1:1/0") == 0);
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  kvsnap_tier* tier = NULL;
  const kvsnap_tier_options options = options_with(NULL, 0);
  CHECK_OK(kvsnap_tier_open(text, &cache, 1, &options, &tier)); /* unreachable: opens anyway */
  CHECK(strcmp(kvsnap_tier_address(tier), "redis://:***@127.0.0.1:1/0") == 0);
  kvsnap_tier_destroy(tier);
  kvsnap_cache_destroy(cache);
}

static void test_refusals(const char* address) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  kvsnap_tier* tier = NULL;
  kvsnap_tier_options options = options_with(NULL, 0);
  CHECK_FAILS(kvsnap_tier_open(address, &cache, 1, NULL, &tier), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_tier_open: options is NULL");
  CHECK_FAILS(kvsnap_tier_open(NULL, &cache, 1, &options, &tier), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_tier_open: address is NULL");
  options.lookup_timeout_ms = -1;
  CHECK_FAILS(kvsnap_tier_open(address, &cache, 1, &options, &tier), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_tier_open: lookup_timeout_ms -1 is negative");
  /* A key with no bytes would open the tier unauthenticated: only NULL asks for that. */
  options = options_with("0123456789abcdef", 0);
  CHECK_FAILS(kvsnap_tier_open(address, &cache, 1, &options, &tier), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_tier_open: key is given with key_size 0");
  options = options_with(NULL, 0);
  options.model_fingerprint_size = 0;
  CHECK_FAILS(kvsnap_tier_open(address, &cache, 1, &options, &tier), KVSNAP_ERROR,
              "Tier::open: the model fingerprint is empty");
  options = options_with(NULL, 0);
  options.max_lookup_bytes = 0;
  CHECK_FAILS(kvsnap_tier_open(address, &cache, 1, &options, &tier), KVSNAP_ERROR,
              "Tier::open: max_lookup_bytes 0 must be in [1, 2^50]");
  options = options_with(NULL, 0);
  CHECK_FAILS(kvsnap_tier_open("http://nowhere", &cache, 1, &options, &tier), KVSNAP_ERROR,
              "tier address http://nowhere");
  CHECK(tier == NULL);
  options = options_with(NULL, 0);
  CHECK_OK(kvsnap_tier_open(address, &cache, 1, &options, &tier));
  kvsnap_cache* other = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&other));
  kvsnap_prefix_cache* prefix = NULL;
  CHECK_FAILS(kvsnap_prefix_cache_create_with_tier(&other, 1, NULL, tier, &prefix), KVSNAP_ERROR,
              "PrefixCache: the tier at");
  CHECK(prefix == NULL);
  bool drained = false;
  CHECK_FAILS(kvsnap_tier_flush(tier, -5, &drained), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_tier_flush: timeout_ms -5 is negative");
  CHECK_FAILS(kvsnap_tier_flush(NULL, 5, &drained), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_tier_flush: tier is NULL");
  kvsnap_tier_stats stats;
  CHECK_FAILS(kvsnap_tier_get_stats(tier, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_tier_get_stats: out is NULL");
  CHECK_OK(kvsnap_tier_get_stats(tier, &stats));
  CHECK(kvsnap_tier_address(NULL) == NULL && !kvsnap_tier_authenticated(NULL));
  kvsnap_tier_destroy(tier);
  kvsnap_tier_destroy(NULL);
  kvsnap_cache_destroy(other);
  kvsnap_cache_destroy(cache);
}

static int remove_entry(const char* path, const struct stat* status, int flag, struct FTW* at) {
  (void)status, (void)flag, (void)at;
  return remove(path);
}

int main(void) {
  strcpy(folder, "/tmp/kvsnap_c_tier_XXXXXX");
  if (mkdtemp(folder) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  char store[96], address[128];
  snprintf(store, sizeof store, "%s/store", folder);
  CHECK(mkdir(store, 0700) == 0);
  snprintf(address, sizeof address, "dir:%s", store);
  test_a_second_process_restores_what_the_first_evaluated(address);
  test_keys_and_addresses_from_private_files(address);
  test_refusals(address);
  nftw(folder, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (failures > 0) fprintf(stderr, "%d checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
