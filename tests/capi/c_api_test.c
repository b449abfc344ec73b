/* The C API from a program compiled as C11: every handle type, and every way a call fails —
 * a NULL handle, an unknown enum value, the wrong cache kind, a too-small buffer (all
 * KVSNAP_INVALID_ARGUMENT), a C++ kvsnap::Error (KVSNAP_ERROR, with its exact message) and
 * running out of memory (KVSNAP_OUT_OF_MEMORY). Usage: c_api_test WORK_DIR */
#include <dlpack/dlpack.h>
#include <kvsnap/kvsnap_c.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "array/sanitizers.h"
#include "c_check.h"

static const char* work_dir = ".";

static void path_in_work_dir(char* path, size_t size, const char* name) {
  snprintf(path, size, "%s/%s", work_dir, name);
}

/* Keys or values [1, 2, tokens, 4] filled with `seed` + position, wrapped without a copy. */
static float kv_buffer[4][1 * 2 * 64 * 4];
static kvsnap_array* kv_array(int slot, int64_t tokens, float seed) {
  int64_t shape[4] = {1, 2, tokens, 4};
  for (int64_t i = 0; i < 2 * tokens * 4; ++i) kv_buffer[slot][i] = seed + (float)i;
  kvsnap_array* array = NULL;
  CHECK_OK(kvsnap_array_wrap(kv_buffer[slot], KVSNAP_F32, 4, shape, NULL, NULL, NULL, &array));
  return array;
}

/* Appends `tokens` tokens to an attention cache at its offset. */
static void append(kvsnap_cache* cache, int64_t tokens, float seed, kvsnap_kv_history* history) {
  int64_t offset = 0;
  CHECK_OK(kvsnap_cache_offset(cache, &offset));
  int32_t offsets[1] = {(int32_t)offset};
  kvsnap_batch batch = {.batch_size = 1, .length = tokens, .seq_offsets = offsets};
  kvsnap_array* keys = kv_array(0, tokens, seed);
  kvsnap_array* values = kv_array(1, tokens, -seed);
  CHECK_OK(kvsnap_cache_update(cache, &batch, keys, values, history));
  kvsnap_array_destroy(keys);
  kvsnap_array_destroy(values);
}

static int released = 0;
static void count_release(void* context) {
  ++released;
  CHECK(context == &released);
}

static void test_arrays(void) {
  const int64_t shape[2] = {2, 3};
  const float data[6] = {1, 2, 3, 4, 5, 6};
  kvsnap_array *a = NULL, *view = NULL;
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 2, shape, data, &a));
  CHECK_OK(kvsnap_array_slice(a, 1, 1, 2, &view));
  CHECK(kvsnap_array_shares_storage(a, view));
  float column[2] = {0, 0};
  CHECK_OK(kvsnap_array_copy_to(view, column, sizeof column));
  CHECK(column[0] == 2 && column[1] == 5);
  kvsnap_array_info info;
  CHECK_OK(kvsnap_array_get_info(view, &info));
  CHECK(info.dtype == KVSNAP_F32 && info.ndim == 2 && info.shape[0] == 2 && info.shape[1] == 1);
  CHECK(info.strides[0] == 3 && info.strides[1] == 1 && *(const float*)info.data == 2);
  CHECK_FAILS(kvsnap_array_copy_to(a, column, sizeof column), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_array_copy_to: capacity 8 bytes is less than the 24 bytes of f32[2, 3]");
  CHECK_FAILS(kvsnap_array_slice(a, 1, 2, 9, &view), KVSNAP_ERROR,
              "Array::slice: range [2, 9) out of range for axis 1 of f32[2, 3]");
  CHECK_FAILS(kvsnap_array_zeros((kvsnap_dtype)9, 2, shape, &view), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_array_zeros: dtype 9 is not a kvsnap_dtype");
  CHECK_FAILS(kvsnap_array_zeros(KVSNAP_F16, 5, shape, &view), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_array_zeros: ndim 5 out of range [0, 4]");
  CHECK_FAILS(kvsnap_array_get_info(NULL, &info), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_array_get_info: array is NULL");
  CHECK(!kvsnap_array_shares_storage(a, NULL));
  kvsnap_array_destroy(view);
  kvsnap_array_destroy(a);
  kvsnap_array_destroy(NULL);
#if !defined(KVSNAP_ADDRESS_SANITIZER) /* ASan aborts on an impossible allocation instead */
  const int64_t huge[2] = {(int64_t)1 << 38, (int64_t)1 << 10}; /* 1 PiB */
  CHECK_FAILS(kvsnap_array_zeros(KVSNAP_F32, 2, huge, &a), KVSNAP_OUT_OF_MEMORY,
              "kvsnap_array_zeros: out of memory");
#endif
}

static void test_wrapped_memory(void) {
  float buffer[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const int64_t shape[2] = {4, 2}, strides[2] = {1, 4}; /* column-major 4x2 */
  const int64_t before = kvsnap_live_bytes();
  kvsnap_array *a = NULL, *row = NULL;
  released = 0;
  CHECK_OK(kvsnap_array_wrap(buffer, KVSNAP_F32, 2, shape, strides, count_release, &released, &a));
  CHECK(kvsnap_live_bytes() == before);
  CHECK_OK(kvsnap_array_slice(a, 0, 1, 2, &row));
  float values[2];
  CHECK_OK(kvsnap_array_copy_to(row, values, sizeof values));
  CHECK(values[0] == 1 && values[1] == 5);
  kvsnap_array_destroy(a);
  CHECK(released == 0); /* the view still names the memory */
  kvsnap_array_destroy(row);
  CHECK(released == 1);
  const int64_t negative[2] = {-1, 4};
  CHECK_FAILS(
      kvsnap_array_wrap(buffer, KVSNAP_F32, 2, shape, negative, count_release, &released, &a),
      KVSNAP_ERROR, "Array::wrap: strides [-1, 4] include a negative one");
  CHECK(released == 1); /* a failed wrap leaves the memory with the caller */
}

static void test_dlpack(void) {
  const int64_t shape[2] = {2, 2};
  const float data[4] = {1, 2, 3, 4};
  kvsnap_array *a = NULL, *back = NULL;
  DLManagedTensor* tensor = NULL;
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 2, shape, data, &a));
  CHECK_OK(kvsnap_array_to_dlpack(a, &tensor));
  CHECK(tensor->dl_tensor.ndim == 2 && tensor->dl_tensor.dtype.code == kDLFloat);
  CHECK(tensor->dl_tensor.dtype.bits == 32 && tensor->dl_tensor.device.device_type == kDLCPU);
  CHECK_OK(kvsnap_array_from_dlpack(tensor, &back)); /* consumes the tensor */
  kvsnap_array_info mine, theirs;
  CHECK_OK(kvsnap_array_get_info(a, &mine));
  CHECK_OK(kvsnap_array_get_info(back, &theirs));
  CHECK(mine.data == theirs.data); /* no copy either way */
  kvsnap_array_destroy(a);
  kvsnap_array_destroy(back); /* runs the tensor's deleter: nothing leaks */

  double doubles[2] = {1, 2};
  int64_t extent = 2;
  DLManagedTensor foreign = {.dl_tensor = {.data = doubles,
                                           .device = {kDLCPU, 0},
                                           .ndim = 1,
                                           .dtype = {kDLFloat, 64, 1},
                                           .shape = &extent}};
  CHECK_FAILS(kvsnap_array_from_dlpack(&foreign, &back), KVSNAP_ERROR,
              "from_dlpack: dtype (code 2, 64 bits, 1 lanes) is not supported");
}

static void test_kv_cache(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  kvsnap_kv_history history = {0};
  /* Before any write the history holds no key: no arrays (not arrays without storage). */
  int32_t start[1] = {0};
  const kvsnap_batch first = {.batch_size = 1, .length = 1, .seq_offsets = start};
  CHECK_OK(kvsnap_cache_view(cache, &first, &history));
  CHECK(history.keys == NULL && history.values == NULL);
  kvsnap_history* in_place = NULL;
  CHECK_OK(kvsnap_cache_view_history(cache, &first, &in_place));
  CHECK_OK(kvsnap_history_arrays(in_place, &history));
  CHECK(history.keys == NULL && history.values == NULL);
  kvsnap_history_destroy(in_place);
  /* A query length past int32 is refused, not truncated to one that may pass. */
  const kvsnap_batch huge = {.batch_size = 1, .length = (int64_t)1 << 32, .seq_offsets = start};
  CHECK_FAILS(kvsnap_cache_view(cache, &huge, &history), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_view: batch of 4294967296 columns; at most 2147483647");
  /* Without input ids, a batch of many columns makes no placeholder ids (here 64 rows of 2^31 - 1
   * columns: 512 GiB of zeros, which once failed the call or the process). */
  const int64_t live = kvsnap_live_bytes();
  int32_t offsets[64] = {0}, lengths[64] = {0}, seqs[64];
  for (int32_t row = 0; row < 64; ++row) seqs[row] = row;
  const kvsnap_batch wide = {.batch_size = 64,
                             .length = 2147483647,
                             .seq_offsets = offsets,
                             .seq_query_lens = lengths,
                             .seq_ids = seqs};
  kvsnap_history* rows = NULL;
  CHECK_OK(kvsnap_cache_view_history(cache, &wide, &rows));
  kvsnap_history_destroy(rows);
  CHECK(kvsnap_live_bytes() == live);
  append(cache, 10, 0, &history);
  kvsnap_array_info keys;
  CHECK_OK(kvsnap_array_get_info(history.keys, &keys));
  CHECK(keys.shape[2] == 10 && history.first_position == 0 && history.window == 0);
  kvsnap_array* state[2] = {NULL, NULL};
  size_t count = 0;
  CHECK_FAILS(kvsnap_cache_state(cache, state, 1, &count), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_state: capacity 1 is less than the 2 state arrays");
  CHECK(count == 2); /* the count a capacity too small needs */
  count = 7;         /* any other refusal writes nothing */
  CHECK_FAILS(kvsnap_cache_state(cache, NULL, 2, &count), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_state: arrays is NULL");
  CHECK(count == 7);
  CHECK_OK(kvsnap_cache_state(cache, state, 2, &count));
  CHECK(count == 2 && kvsnap_array_shares_storage(state[0], history.keys)); /* a view */
  kvsnap_array_destroy(state[0]);
  kvsnap_array_destroy(state[1]);
  kvsnap_kv_history_clear(&history);

  kvsnap_snapshot* s = NULL;
  kvsnap_snapshot_info info;
  CHECK_OK(kvsnap_cache_snapshot(cache, 4, &s));
  CHECK_OK(kvsnap_snapshot_get_info(s, &info));
  CHECK(info.from == 4 && info.to == 10 && info.size == 0 && info.is_lazy);
  bool restored = false;
  CHECK_OK(kvsnap_cache_restore(cache, NULL, 6, &restored));
  CHECK(restored);
  append(cache, 2, 100, NULL); /* overwrites slots 6, 7 that s names: copied out first */
  CHECK_OK(kvsnap_snapshot_get_info(s, &info));
  CHECK(info.size > 0);
  CHECK_OK(kvsnap_cache_restore(cache, s, 10, &restored));
  CHECK(restored);
  CHECK_OK(kvsnap_cache_restore(cache, s, 11, &restored)); /* unreachable: not an error */
  CHECK(!restored);

  kvsnap_snapshot *before = NULL, *after = NULL, *joined = NULL;
  CHECK_OK(kvsnap_cache_split(cache, s, 7, &before, &after)); /* consumes s */
  CHECK_OK(kvsnap_snapshot_get_info(after, &info));
  CHECK(info.from == 7 && info.to == 10);
  CHECK_OK(kvsnap_cache_merge(cache, before, after, &joined)); /* consumes both */
  CHECK_OK(kvsnap_snapshot_get_info(joined, &info));
  CHECK(info.from == 4 && info.to == 10);
  kvsnap_snapshot* early = NULL;
  CHECK_OK(kvsnap_cache_snapshot(cache, 0, &early));
  CHECK_FAILS(kvsnap_cache_merge(cache, joined, early, &s), KVSNAP_ERROR, "KVCache::merge");
  /* Both were consumed by the failed merge: nothing to destroy (ASan checks no leak). */
  CHECK_OK(kvsnap_cache_snapshot(cache, 10, &s));
  CHECK(s == NULL); /* an empty range: nothing to hold */

  kvsnap_array *conv = NULL, *delta = NULL;
  int32_t zero[1] = {0};
  kvsnap_batch batch = {.batch_size = 1, .length = 1, .seq_offsets = zero};
  CHECK_FAILS(kvsnap_recurrent_get(cache, &batch, KVSNAP_F32, &conv, &delta),
              KVSNAP_INVALID_ARGUMENT,
              "kvsnap_recurrent_get: the cache is a KV cache; this call needs a recurrent cache");
  CHECK_OK(kvsnap_cache_reset(cache));
  kvsnap_cache_destroy(cache);
}

static void test_scheduled_capture(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  const int64_t offsets[2] = {3, 8};
  kvsnap_snapshot_list* list = NULL;
  CHECK_OK(kvsnap_cache_prepare_snapshots(cache, offsets, 2));
  append(cache, 5, 0, NULL);
  CHECK_FAILS(kvsnap_cache_take_snapshots(cache, &list), KVSNAP_ERROR, "KVCache::take_snapshots");
  CHECK_OK(kvsnap_cache_take_reached_snapshots(cache, &list));
  CHECK(kvsnap_snapshot_list_size(list) == 1);
  kvsnap_snapshot_list_destroy(list);

  CHECK_FAILS(kvsnap_cache_prepare_snapshots(cache, offsets, 2), KVSNAP_ERROR,
              "KVCache::prepare_snapshots: offset 3 in [3, 8] is already passed");
  const int64_t later[2] = {6, 9};
  CHECK_OK(kvsnap_cache_prepare_snapshots(cache, later, 2));
  append(cache, 5, 1, NULL);
  CHECK_OK(kvsnap_cache_take_snapshots(cache, &list));
  CHECK(kvsnap_snapshot_list_size(list) == 2);
  kvsnap_snapshot* edge = NULL;
  kvsnap_snapshot_info info;
  CHECK_OK(kvsnap_snapshot_list_take(list, 1, &edge));
  CHECK_OK(kvsnap_snapshot_get_info(edge, &info));
  CHECK(info.from == 6 && info.to == 9);
  kvsnap_snapshot_destroy(edge);
  CHECK_OK(kvsnap_snapshot_list_take(list, 1, &edge));
  CHECK(edge == NULL); /* taken already */
  CHECK_FAILS(kvsnap_snapshot_list_take(list, 2, &edge), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_snapshot_list_take: index 2 out of range (the list has 2)");
  kvsnap_snapshot_list_destroy(list); /* destroys the entry not taken */
  CHECK_OK(kvsnap_cache_prepare_snapshots(cache, later + 1, 0));
  CHECK_OK(kvsnap_cache_cancel_snapshots(cache));
  kvsnap_cache_destroy(cache);
}

static void test_rotating_cache(void) {
  kvsnap_cache* cache = NULL;
  CHECK_FAILS(kvsnap_rotating_kv_cache_create(0, &cache), KVSNAP_ERROR, "RotatingKVCache");
  CHECK_FAILS(kvsnap_rotating_kv_cache_create(INT64_MAX, &cache), KVSNAP_ERROR,
              "RotatingKVCache: max_size 9223372036854775807 must be in [1, 2^60]");
  CHECK(cache == NULL);
  CHECK_OK(kvsnap_rotating_kv_cache_create(4, &cache));
  kvsnap_cache_kind kind;
  CHECK_OK(kvsnap_cache_get_kind(cache, &kind));
  CHECK(kind == KVSNAP_ROTATING_KV_CACHE);
  kvsnap_kv_history history = {0};
  append(cache, 6, 0, &history);
  CHECK(history.window == 4);
  kvsnap_kv_history_clear(&history);
  kvsnap_snapshot *s = NULL, *before = NULL, *after = NULL;
  CHECK_OK(kvsnap_cache_snapshot(cache, 0, &s));
  bool restored = true;
  CHECK_OK(kvsnap_cache_restore(cache, s, 3, &restored)); /* the window evicted 0 and 1 */
  CHECK(!restored);
  CHECK_OK(kvsnap_cache_split(cache, s, 3, &before, &after));
  CHECK(before == NULL && after != NULL); /* the window stays with the later half */
  int32_t six[1] = {6};
  kvsnap_batch batch = {.batch_size = 1, .length = 1, .seq_offsets = six};
  CHECK_OK(kvsnap_cache_view(cache, &batch, &history));
  CHECK(history.keys != NULL);
  kvsnap_kv_history_clear(&history);
  kvsnap_kv_history_clear(NULL);
  kvsnap_snapshot_destroy(after);
  kvsnap_cache_destroy(cache);
}

static const kvsnap_recurrent_options kRecurrent = {
    .conv_tail = 2, .conv_dim = 3, .num_v_heads = 1, .head_v_dim = 2, .head_k_dim = 2};

static void test_recurrent_cache(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_recurrent_cache_create(&kRecurrent, &cache));
  int32_t zero[1] = {0};
  kvsnap_batch batch = {.batch_size = 1, .length = 4, .seq_offsets = zero};
  kvsnap_array *conv = NULL, *delta = NULL;
  const int64_t before = kvsnap_live_bytes();
  CHECK_OK(kvsnap_recurrent_get(cache, &batch, KVSNAP_F32, &conv, &delta)); /* zero states */
  kvsnap_array_destroy(conv);
  kvsnap_array_destroy(delta);
  int32_t two_zeros[2] = {0, 0};
  const kvsnap_batch two = {.batch_size = 2, .length = 4, .seq_offsets = two_zeros};
  conv = delta = NULL;
  CHECK_FAILS(kvsnap_recurrent_get(cache, &two, KVSNAP_F32, &conv, &delta), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_recurrent_get: a batch of 2 rows");
  CHECK(conv == NULL && delta == NULL);
  const int64_t offsets[1] = {2};
  CHECK_OK(kvsnap_cache_prepare_snapshots(cache, offsets, 1));
  int64_t splits[1] = {0};
  size_t count = 0;
  CHECK_FAILS(kvsnap_recurrent_snapshot_splits(cache, 4, splits, 0, &count),
              KVSNAP_INVALID_ARGUMENT,
              "kvsnap_recurrent_snapshot_splits: capacity 0 is less than the 1 split points");
  CHECK(count == 1);
  count = 7;
  CHECK_FAILS(kvsnap_recurrent_snapshot_splits(cache, 4, NULL, 1, &count), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_recurrent_snapshot_splits: splits is NULL");
  CHECK(count == 7);
  CHECK_OK(kvsnap_recurrent_snapshot_splits(cache, 4, splits, 1, &count));
  CHECK(count == 1 && splits[0] == 2);

  /* The engine's own state buffers, adopted without a copy. */
  static float conv_memory[2][6], delta_memory[2][4];
  const int64_t conv_shape[3] = {1, 2, 3}, delta_shape[4] = {1, 1, 2, 2};
  kvsnap_array *convs[2], *deltas[2];
  released = 0;
  for (int i = 0; i < 2; ++i) {
    CHECK_OK(kvsnap_array_wrap(conv_memory[i], KVSNAP_F32, 3, conv_shape, NULL, count_release,
                               &released, &convs[i]));
    CHECK_OK(kvsnap_array_wrap(delta_memory[i], KVSNAP_F32, 4, delta_shape, NULL, count_release,
                               &released, &deltas[i]));
  }
  CHECK_FAILS(kvsnap_recurrent_put(cache, &batch, (const kvsnap_array* const*)convs,
                                   (const kvsnap_array* const*)deltas, 1),
              KVSNAP_ERROR,
              "RecurrentCache::put: got 1 conv and 1 delta states for row 0; expected 2");
  CHECK_OK(kvsnap_recurrent_put(cache, &batch, (const kvsnap_array* const*)convs,
                                (const kvsnap_array* const*)deltas, 2));
  CHECK(kvsnap_live_bytes() == before); /* the zero states went, the engine's came in */
  kvsnap_array* state[2] = {NULL, NULL};
  CHECK_OK(kvsnap_cache_state(cache, state, 2, &count));
  CHECK(kvsnap_array_shares_storage(state[0], convs[1]));
  kvsnap_snapshot_list* list = NULL;
  CHECK_OK(kvsnap_cache_take_snapshots(cache, &list));
  for (int i = 0; i < 2; ++i) {
    kvsnap_array_destroy(convs[i]);
    kvsnap_array_destroy(deltas[i]);
    kvsnap_array_destroy(state[i]);
  }
  CHECK(released == 0); /* the cache and the captured snapshot still hold them */
  kvsnap_snapshot_list_destroy(list);
  CHECK(released == 2); /* the interior state, captured at offset 2 */
  CHECK_FAILS(kvsnap_cache_update(cache, &batch, NULL, NULL, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_update: the cache is a recurrent cache; this call needs an attention");
  kvsnap_cache_destroy(cache);
  CHECK(released == 4);
}

static void test_persistence(void) {
  kvsnap_cache *cache = NULL, *fresh = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  append(cache, 5, 0, NULL);
  kvsnap_snapshot* s = NULL;
  CHECK_OK(kvsnap_cache_snapshot(cache, 0, &s));
  char path[512];
  path_in_work_dir(path, sizeof path, "c_api.safetensors");
  const kvsnap_snapshot* layers[2] = {s, NULL};
  CHECK_OK(kvsnap_save_snapshots(path, 5, layers, 2));
  int64_t offset = 0;
  kvsnap_snapshot_list* loaded = NULL;
  CHECK_OK(kvsnap_load_snapshots(path, &offset, &loaded));
  CHECK(offset == 5 && kvsnap_snapshot_list_size(loaded) == 2);
  kvsnap_snapshot* first = NULL;
  CHECK_OK(kvsnap_snapshot_list_take(loaded, 0, &first));
  CHECK_OK(kvsnap_kv_cache_create(&fresh));
  bool restored = false;
  CHECK_OK(kvsnap_cache_restore(fresh, first, 5, &restored));
  CHECK(restored);
  path_in_work_dir(path, sizeof path, "missing.safetensors");
  CHECK_FAILS(kvsnap_load_snapshots(path, &offset, &loaded), KVSNAP_ERROR,
              "load_snapshots: cannot open ");
  CHECK(strstr(kvsnap_last_error(), "missing.safetensors for reading") != NULL);
  kvsnap_snapshot_list_destroy(loaded);
  kvsnap_snapshot_destroy(first);
  kvsnap_snapshot_destroy(s);
  kvsnap_cache_destroy(fresh);
  kvsnap_cache_destroy(cache);
}

/* One request through the prefix cache over a KV layer and a stateless one. */
static void serve(kvsnap_prefix_cache* prefix, kvsnap_cache* layer, const int32_t* prompt,
                  size_t length, int64_t* cached) {
  kvsnap_session* session = NULL;
  CHECK_OK(kvsnap_prefix_cache_begin(prefix, prompt, length, &session));
  CHECK_OK(kvsnap_session_cached(session, cached));
  const int32_t* remaining = NULL;
  size_t count = 0;
  /* A call refused (count is required) writes no out-parameter. */
  CHECK(kvsnap_session_remaining(session, &remaining, NULL) == KVSNAP_INVALID_ARGUMENT);
  CHECK(remaining == NULL);
  CHECK_OK(kvsnap_session_remaining(session, &remaining, &count));
  CHECK(remaining != NULL && (int64_t)count == (int64_t)length - *cached);
  if (*cached <= 4) {
    const int64_t message_end[1] = {4};
    CHECK_OK(kvsnap_session_schedule_snapshots(session, message_end, 1));
  }
  const int64_t guess[1] = {*cached}; /* where another prompt may leave this one */
  CHECK_OK(kvsnap_session_schedule_branch_points(session, guess, 1));
  append(layer, (int64_t)count, 0, NULL);
  CHECK_OK(kvsnap_session_prefill_done(session));
  CHECK_OK(kvsnap_session_append_output(session, 42));
  CHECK_OK(kvsnap_session_close(session));
  kvsnap_session_destroy(session);
}

static void test_prefix_cache(void) {
  kvsnap_cache* layer = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&layer));
  kvsnap_cache* layers[2] = {layer, NULL};
  kvsnap_prefix_cache* prefix = NULL;
  const kvsnap_prefix_options options = {.max_paged_out_bytes = 1 << 20};
  CHECK_OK(kvsnap_prefix_cache_create(layers, 2, &options, &prefix));
  const int32_t prompt[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  int64_t cached = -1;
  serve(prefix, layer, prompt, 8, &cached);
  CHECK(cached == 0);
  serve(prefix, layer, prompt, 6, &cached); /* shares the first 5 tokens */
  CHECK(cached == 5);
  kvsnap_prefix_stats stats;
  CHECK_OK(kvsnap_prefix_cache_get_stats(prefix, &stats));
  CHECK(stats.lookups == 2 && stats.reused_tokens == 5 && stats.node_count > 0);
  CHECK_OK(kvsnap_prefix_cache_check(prefix));

  char dir[512];
  path_in_work_dir(dir, sizeof dir, "c_api_prefix");
  CHECK_OK(kvsnap_prefix_cache_save(prefix, dir, "model"));
  CHECK(kvsnap_prefix_cache_saved_in(dir));
  CHECK(kvsnap_prefix_cache_load(prefix, dir, "another model") == KVSNAP_ERROR);
  CHECK(strstr(kvsnap_last_error(),
               "it was saved for model \"model\", this cache serves \"another model\"") != NULL);
  /* Loaded under a budget that keeps nothing: every node found in the file, none held. */
  kvsnap_cache* fresh = NULL; /* another process's layer */
  CHECK_OK(kvsnap_kv_cache_create(&fresh));
  kvsnap_cache* fresh_layers[2] = {fresh, NULL};
  kvsnap_prefix_cache* small = NULL;
  const kvsnap_prefix_options keeps_nothing = {.max_paged_out_bytes = 1};
  CHECK_OK(kvsnap_prefix_cache_create(fresh_layers, 2, &keeps_nothing, &small));
  int64_t loaded = -1, peak = -1;
  CHECK_OK(kvsnap_prefix_cache_loaded_nodes(small, &loaded));
  CHECK(loaded == 0);
  CHECK_OK(kvsnap_prefix_cache_load(small, dir, "model"));
  CHECK_OK(kvsnap_prefix_cache_loaded_nodes(small, &loaded));
  CHECK(loaded == stats.node_count);
  CHECK_OK(kvsnap_prefix_cache_peak_paged_out_bytes(small, &peak));
  CHECK(peak <= 1);
  kvsnap_prefix_stats small_stats;
  CHECK_OK(kvsnap_prefix_cache_get_stats(small, &small_stats));
  CHECK(small_stats.node_count == 0 && small_stats.evicted_nodes > 0);
  CHECK_FAILS(kvsnap_prefix_cache_loaded_nodes(small, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_prefix_cache_loaded_nodes: out is NULL");
  CHECK_FAILS(kvsnap_prefix_cache_peak_paged_out_bytes(small, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_prefix_cache_peak_paged_out_bytes: out is NULL");
  kvsnap_prefix_cache_destroy(small);
  kvsnap_cache_destroy(fresh);
  CHECK_OK(kvsnap_prefix_cache_peak_paged_out_bytes(prefix, &peak));
  CHECK(peak >= stats.paged_out_bytes && peak > 0);
  CHECK_OK(kvsnap_prefix_cache_reset_peak(prefix));
  CHECK_OK(kvsnap_prefix_cache_get_stats(prefix, &stats));
  CHECK_OK(kvsnap_prefix_cache_peak_paged_out_bytes(prefix, &peak));
  CHECK(peak == stats.paged_out_bytes);

  kvsnap_session *open = NULL, *second = NULL, *closed = NULL;
  CHECK_OK(kvsnap_prefix_cache_begin(prefix, prompt, 8, &closed));
  CHECK_OK(kvsnap_session_close(closed)); /* closed, kept: it must not outlive the cache dangling */
  CHECK_OK(kvsnap_prefix_cache_begin(prefix, prompt, 8, &open));
  CHECK_FAILS(kvsnap_prefix_cache_begin(prefix, prompt, 8, &second), KVSNAP_ERROR,
              "PrefixCache::begin");
  kvsnap_prefix_cache_destroy(prefix); /* detaches the open session */
  CHECK_FAILS(kvsnap_session_prefill_done(open), KVSNAP_ERROR,
              "Session::prefill_done: the PrefixCache this session belongs to was destroyed");
  CHECK_FAILS(kvsnap_session_cached(closed, &cached), KVSNAP_ERROR,
              "Session::cached: the session is closed");
  kvsnap_session_destroy(closed);
  CHECK_FAILS(kvsnap_session_close(NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_session_close: session is NULL");
  kvsnap_session_destroy(open);
  kvsnap_cache_destroy(layer);
}

/* Every call that takes a handle or an out pointer refuses NULL with a message naming it. */
#define CHECK_NULL(call, message) CHECK_FAILS(call, KVSNAP_INVALID_ARGUMENT, message)
static void test_null_arguments_of_arrays_and_caches(void) {
  const int64_t shape[1] = {1};
  kvsnap_array* array = NULL;
  kvsnap_cache* cache = NULL;
  int64_t number = 0;
  size_t count = 0;
  CHECK_NULL(kvsnap_array_zeros(KVSNAP_F32, 1, shape, NULL), "kvsnap_array_zeros: out is NULL");
  CHECK_NULL(kvsnap_array_from_data(KVSNAP_F32, 1, shape, NULL, &array),
             "kvsnap_array_from_data: data is NULL");
  CHECK_NULL(kvsnap_array_wrap(NULL, KVSNAP_F32, 1, shape, NULL, NULL, NULL, NULL),
             "kvsnap_array_wrap: out is NULL");
  CHECK_NULL(kvsnap_array_slice(NULL, 0, 0, 0, &array), "kvsnap_array_slice: array is NULL");
  CHECK_NULL(kvsnap_array_copy_to(NULL, &number, 8), "kvsnap_array_copy_to: array is NULL");
  CHECK_NULL(kvsnap_array_from_dlpack(NULL, &array), "kvsnap_array_from_dlpack: tensor is NULL");
  CHECK_NULL(kvsnap_array_to_dlpack(NULL, NULL), "kvsnap_array_to_dlpack: array is NULL");
  CHECK_NULL(kvsnap_kv_cache_create(NULL), "kvsnap_kv_cache_create: out is NULL");
  CHECK_NULL(kvsnap_rotating_kv_cache_create(4, NULL),
             "kvsnap_rotating_kv_cache_create: out is NULL");
  CHECK_NULL(kvsnap_recurrent_cache_create(NULL, &cache),
             "kvsnap_recurrent_cache_create: options is NULL");
  CHECK_NULL(kvsnap_cache_get_kind(NULL, NULL), "kvsnap_cache_get_kind: cache is NULL");
  CHECK_NULL(kvsnap_cache_offset(NULL, &number), "kvsnap_cache_offset: cache is NULL");
  CHECK_NULL(kvsnap_cache_reset(NULL), "kvsnap_cache_reset: cache is NULL");
  CHECK_NULL(kvsnap_cache_state(NULL, NULL, 0, &count), "kvsnap_cache_state: cache is NULL");
  CHECK_NULL(kvsnap_cache_update(NULL, NULL, NULL, NULL, NULL),
             "kvsnap_cache_update: cache is NULL");
  CHECK_NULL(kvsnap_cache_view(cache, NULL, NULL), "kvsnap_cache_view: out is NULL");
  CHECK_NULL(kvsnap_recurrent_get(NULL, NULL, KVSNAP_F32, &array, &array),
             "kvsnap_recurrent_get: cache is NULL");
  CHECK_NULL(kvsnap_recurrent_put(NULL, NULL, NULL, NULL, 0),
             "kvsnap_recurrent_put: cache is NULL");
  CHECK_NULL(kvsnap_recurrent_snapshot_splits(NULL, 1, NULL, 0, &count),
             "kvsnap_recurrent_snapshot_splits: cache is NULL");
}

static void test_null_arguments_of_snapshots_and_prefix_caches(void) {
  kvsnap_snapshot* snapshot = NULL;
  kvsnap_snapshot_list* list = NULL;
  kvsnap_session* session = NULL;
  int64_t number = 0;
  size_t count = 0;
  bool flag = false;
  CHECK_NULL(kvsnap_cache_snapshot(NULL, 0, &snapshot), "kvsnap_cache_snapshot: cache is NULL");
  CHECK_NULL(kvsnap_cache_prepare_snapshots(NULL, NULL, 0),
             "kvsnap_cache_prepare_snapshots: cache is NULL");
  CHECK_NULL(kvsnap_cache_take_snapshots(NULL, &list),
             "kvsnap_cache_take_snapshots: cache is NULL");
  CHECK_NULL(kvsnap_cache_take_reached_snapshots(NULL, &list),
             "kvsnap_cache_take_reached_snapshots: cache is NULL");
  CHECK_NULL(kvsnap_cache_cancel_snapshots(NULL), "kvsnap_cache_cancel_snapshots: cache is NULL");
  CHECK_NULL(kvsnap_cache_restore(NULL, NULL, 0, &flag), "kvsnap_cache_restore: cache is NULL");
  CHECK_NULL(kvsnap_cache_merge(NULL, NULL, NULL, &snapshot), "kvsnap_cache_merge: cache is NULL");
  CHECK_NULL(kvsnap_cache_split(NULL, NULL, 0, &snapshot, &snapshot),
             "kvsnap_cache_split: cache is NULL");
  CHECK_NULL(kvsnap_snapshot_get_info(NULL, NULL), "kvsnap_snapshot_get_info: snapshot is NULL");
  CHECK_NULL(kvsnap_snapshot_list_take(NULL, 0, &snapshot),
             "kvsnap_snapshot_list_take: list is NULL");
  CHECK_NULL(kvsnap_save_snapshots(NULL, 0, NULL, 0), "kvsnap_save_snapshots: path is NULL");
  CHECK_NULL(kvsnap_load_snapshots(NULL, &number, &list), "kvsnap_load_snapshots: path is NULL");
  CHECK_NULL(kvsnap_prefix_cache_create(NULL, 1, NULL, NULL),
             "kvsnap_prefix_cache_create: out is NULL");
  CHECK_NULL(kvsnap_prefix_cache_begin(NULL, NULL, 0, &session),
             "kvsnap_prefix_cache_begin: prefix is NULL");
  CHECK_NULL(kvsnap_prefix_cache_get_stats(NULL, NULL),
             "kvsnap_prefix_cache_get_stats: prefix is NULL");
  CHECK_NULL(kvsnap_prefix_cache_check(NULL), "kvsnap_prefix_cache_check: prefix is NULL");
  CHECK_NULL(kvsnap_prefix_cache_loaded_nodes(NULL, &number),
             "kvsnap_prefix_cache_loaded_nodes: prefix is NULL");
  CHECK_NULL(kvsnap_prefix_cache_peak_paged_out_bytes(NULL, &number),
             "kvsnap_prefix_cache_peak_paged_out_bytes: prefix is NULL");
  CHECK_NULL(kvsnap_prefix_cache_reset_peak(NULL),
             "kvsnap_prefix_cache_reset_peak: prefix is NULL");
  CHECK_NULL(kvsnap_prefix_cache_save(NULL, "dir", NULL),
             "kvsnap_prefix_cache_save: prefix is NULL");
  CHECK_NULL(kvsnap_prefix_cache_load(NULL, "dir", NULL),
             "kvsnap_prefix_cache_load: prefix is NULL");
  CHECK(!kvsnap_prefix_cache_saved_in(NULL));
  CHECK_NULL(kvsnap_session_remaining(NULL, NULL, &count),
             "kvsnap_session_remaining: session is NULL");
  CHECK_NULL(kvsnap_session_cached(NULL, &number), "kvsnap_session_cached: session is NULL");
  CHECK_NULL(kvsnap_session_schedule_snapshots(NULL, NULL, 0),
             "kvsnap_session_schedule_snapshots: session is NULL");
  CHECK_NULL(kvsnap_session_schedule_branch_points(NULL, NULL, 0),
             "kvsnap_session_schedule_branch_points: session is NULL");
  CHECK_NULL(kvsnap_session_prefill_done(NULL), "kvsnap_session_prefill_done: session is NULL");
  CHECK_NULL(kvsnap_session_append_output(NULL, 1),
             "kvsnap_session_append_output: session is NULL");
  CHECK(kvsnap_snapshot_list_size(NULL) == 0);
  kvsnap_cache_destroy(NULL);
  kvsnap_snapshot_destroy(NULL);
  kvsnap_snapshot_list_destroy(NULL);
  kvsnap_prefix_cache_destroy(NULL);
  kvsnap_session_destroy(NULL);
}

int main(int argc, char** argv) {
  if (argc > 1) work_dir = argv[1];
  CHECK(strcmp(kvsnap_last_error(), "") == 0);
  test_arrays();
  test_wrapped_memory();
  test_dlpack();
  test_kv_cache();
  test_scheduled_capture();
  test_rotating_cache();
  test_recurrent_cache();
  test_persistence();
  test_prefix_cache();
  test_null_arguments_of_arrays_and_caches();
  test_null_arguments_of_snapshots_and_prefix_caches();
  if (failures > 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("c api: every check passed\n");
  return 0;
}
