/* The C API from several threads at once, as kvsnap_c.h allows: four threads each serve
 * requests on their own slot of one prefix cache over shared paged and window caches (begin,
 * write, check the history against the tokens, close), and query the prefix cache (match,
 * stats) while the others write; then one thread rewinds and rewrites a paged sequence in place
 * while another views it (each view's copy is made under the cache's lock); then four threads
 * read one array at once (describe, slice, copy, write it into caches of their own). Run under
 * ThreadSanitizer in CI (`make tsan`). */
#include <kvsnap/kvsnap_c.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

enum { kThreads = 4, kRequests = 20, kSystem = 12, kHeads = 2, kDepth = 2 };

static atomic_int failures;

/* A failed check prints where and this thread's last error, and counts. */
#define T_CHECK(condition)                                                              \
  do {                                                                                  \
    if (!(condition)) {                                                                 \
      fprintf(stderr, "%s:%d: CHECK(%s) failed (last error: %s)\n", __FILE__, __LINE__, \
              #condition, kvsnap_last_error());                                         \
      atomic_fetch_add(&failures, 1);                                                   \
    }                                                                                   \
  } while (0)
#define T_OK(call) T_CHECK((call) == KVSNAP_OK)

static kvsnap_cache* layers[2]; /* paged attention, sliding window */
static kvsnap_prefix_cache* prefix;

/* Key element [head, d] of token `token` at `position`: a column names its token and position. */
static float key(int32_t token, int64_t position, int head, int d) {
  return (float)(token * 1000 + position * 4 + head * 2 + d);
}

/* Writes prompt[from, to) to `layer` on sequence `slot` and checks the history it hands back:
 * every column the position it maps to holds that position's token. */
static void write_and_check(kvsnap_cache* layer, int32_t slot, const int32_t* prompt, int64_t from,
                            int64_t to) {
  static _Thread_local float data[kHeads * 64 * kDepth];
  const int64_t n = to - from, shape[4] = {1, kHeads, n, kDepth};
  for (int h = 0; h < kHeads; ++h) {
    for (int64_t c = 0; c < n; ++c) {
      for (int d = 0; d < kDepth; ++d) {
        data[(h * n + c) * kDepth + d] = key(prompt[from + c], from + c, h, d);
      }
    }
  }
  kvsnap_array* keys = NULL;
  T_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, data, &keys));
  const int32_t offsets[1] = {(int32_t)from}, seqs[1] = {slot};
  const kvsnap_batch batch = {
      .batch_size = 1, .length = n, .seq_offsets = offsets, .seq_ids = seqs};
  kvsnap_kv_history history = {0};
  T_OK(kvsnap_cache_update(layer, &batch, keys, keys, &history));
  kvsnap_array_info info;
  T_OK(kvsnap_array_get_info(history.keys, &info));
  const int64_t columns = info.shape[2];
  for (int64_t c = 0; c < columns; ++c) {
    const int64_t position =
        history.first_position + ((c - history.oldest_column) % columns + columns) % columns;
    if (position < 0 || position >= to) continue;
    const float* column = (const float*)info.data + c * info.strides[2];
    T_CHECK(column[info.strides[1]] == key(prompt[position], position, 1, 0));
  }
  kvsnap_kv_history_clear(&history);
  kvsnap_array_destroy(keys);
}

static void* serve(void* argument) {
  const int32_t slot = (int32_t)(intptr_t)argument;
  int32_t prompt[kSystem + 8];
  for (int i = 0; i < kSystem; ++i) prompt[i] = i + 1; /* every thread's system prompt */
  for (int request = 0; request < kRequests; ++request) {
    const int64_t length = kSystem + 1 + request % 7;
    for (int64_t i = kSystem; i < length; ++i) prompt[i] = 100 + slot * 10 + (int32_t)i % 3;
    int64_t match = -1, cached = -1;
    T_OK(kvsnap_prefix_cache_match(prefix, slot, prompt, (size_t)length, &match));
    kvsnap_session* session = NULL;
    T_OK(kvsnap_prefix_cache_begin_slot(prefix, slot, prompt, (size_t)length, &session));
    T_OK(kvsnap_session_cached(session, &cached));
    T_CHECK(cached >= 0 && cached < length);
    for (int l = 0; l < 2; ++l) write_and_check(layers[l], slot, prompt, cached, length);
    T_OK(kvsnap_session_prefill_done(session));
    T_OK(kvsnap_session_append_output(session, 7));
    T_OK(kvsnap_session_close(session));
    kvsnap_session_destroy(session);
    kvsnap_prefix_stats stats;
    T_OK(kvsnap_prefix_cache_get_stats(prefix, &stats));
  }
  return NULL;
}

/* One paged sequence, rewound and rewritten in place by `rewrite` while `view` copies it. */
static kvsnap_cache* rewritten;
static atomic_int rewriting = 1;

static void* rewrite(void* unused) {
  (void)unused;
  int32_t tokens[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  for (int round = 0; round < 200; ++round) {
    bool restored = false;
    T_OK(kvsnap_cache_restore_seq(rewritten, 9, NULL, 2, &restored));
    T_CHECK(restored);
    for (int i = 2; i < 8; ++i) tokens[i] = 50 + (round + i) % 5;
    write_and_check(rewritten, 9, tokens, 2, 8);
  }
  atomic_store(&rewriting, 0);
  return NULL;
}

static void* view(void* unused) {
  (void)unused;
  const int32_t offsets[1] = {8}, lengths[1] = {0}, seqs[1] = {9};
  const kvsnap_batch batch = {.batch_size = 1,
                              .length = 1,
                              .seq_offsets = offsets,
                              .seq_query_lens = lengths,
                              .seq_ids = seqs};
  while (atomic_load(&rewriting)) {
    kvsnap_kv_history history = {0};
    (void)kvsnap_cache_view(rewritten, &batch, &history); /* refused while the sequence is at 2 */
    kvsnap_kv_history_clear(&history);
  }
  return NULL;
}

/* One array read by several threads at once (every call takes arrays const): each describes,
 * slices and copies it, and writes it into a cache of its own as keys and values. */
static kvsnap_array* shared_keys;

static void* read_shared(void* unused) {
  (void)unused;
  kvsnap_cache* own = NULL;
  T_OK(kvsnap_kv_cache_create(&own));
  float copy[kHeads * 4 * kDepth];
  for (int round = 0; round < 50; ++round) {
    kvsnap_array_info info;
    T_OK(kvsnap_array_get_info(shared_keys, &info));
    T_CHECK(info.ndim == 4 && info.shape[2] == 4);
    kvsnap_array* slice = NULL;
    T_OK(kvsnap_array_slice(shared_keys, 2, 1, 3, &slice));
    T_CHECK(kvsnap_array_shares_storage(slice, shared_keys));
    kvsnap_array_destroy(slice);
    T_OK(kvsnap_array_copy_to(shared_keys, copy, sizeof(copy)));
    T_CHECK(copy[kDepth] == key(7, 1, 0, 0));
    const int32_t offsets[1] = {round * 4}, seqs[1] = {0};
    const kvsnap_batch batch = {
        .batch_size = 1, .length = 4, .seq_offsets = offsets, .seq_ids = seqs};
    kvsnap_kv_history history = {0};
    T_OK(kvsnap_cache_update(own, &batch, shared_keys, shared_keys, &history));
    kvsnap_kv_history_clear(&history);
  }
  int64_t offset = 0;
  T_OK(kvsnap_cache_offset_seq(own, 0, &offset));
  T_CHECK(offset == 200);
  kvsnap_cache_destroy(own);
  return NULL;
}

int main(void) {
  if (kvsnap_paged_kv_cache_create(4, &layers[0]) != KVSNAP_OK ||
      kvsnap_rotating_kv_cache_create(6, &layers[1]) != KVSNAP_OK) {
    fprintf(stderr, "%s\n", kvsnap_last_error());
    return 1;
  }
  const kvsnap_prefix_options options = {.max_paged_out_bytes = 1 << 14, .slots = kThreads};
  if (kvsnap_prefix_cache_create(layers, 2, &options, &prefix) != KVSNAP_OK) {
    fprintf(stderr, "%s\n", kvsnap_last_error());
    return 1;
  }
  pthread_t threads[kThreads];
  for (intptr_t t = 0; t < kThreads; ++t) pthread_create(&threads[t], NULL, serve, (void*)t);
  for (int t = 0; t < kThreads; ++t) pthread_join(threads[t], NULL);
  kvsnap_prefix_stats stats;
  T_OK(kvsnap_prefix_cache_get_stats(prefix, &stats));
  T_CHECK(stats.lookups == kThreads * kRequests);
  T_CHECK(stats.reused_tokens > 0);
  T_OK(kvsnap_prefix_cache_check(prefix));
  kvsnap_prefix_cache_destroy(prefix);
  kvsnap_cache_destroy(layers[0]);
  kvsnap_cache_destroy(layers[1]);
  T_OK(kvsnap_paged_kv_cache_create(4, &rewritten));
  const int32_t first[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  write_and_check(rewritten, 9, first, 0, 8);
  pthread_t pair[2];
  pthread_create(&pair[0], NULL, rewrite, NULL);
  pthread_create(&pair[1], NULL, view, NULL);
  for (int t = 0; t < 2; ++t) pthread_join(pair[t], NULL);
  kvsnap_cache_destroy(rewritten);
  float data[kHeads * 4 * kDepth];
  const int64_t shape[4] = {1, kHeads, 4, kDepth};
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < 4; ++c) {
      for (int d = 0; d < kDepth; ++d) data[(h * 4 + c) * kDepth + d] = key(7, c, h, d);
    }
  }
  T_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, data, &shared_keys));
  for (intptr_t t = 0; t < kThreads; ++t) pthread_create(&threads[t], NULL, read_shared, NULL);
  for (int t = 0; t < kThreads; ++t) pthread_join(threads[t], NULL);
  kvsnap_array_destroy(shared_keys);
  if (atomic_load(&failures) > 0) {
    fprintf(stderr, "%d check(s) failed\n", atomic_load(&failures));
    return 1;
  }
  printf("c api, %d threads: every check passed\n", kThreads);
  return 0;
}
