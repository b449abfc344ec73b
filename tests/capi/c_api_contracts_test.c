/* Contracts kvsnap_c.h states, each pinned from a program compiled as C11: who owns a DLPack
 * tensor and when its deleter runs, calls that consume their snapshots also when they fail,
 * copies into memory of any alignment, a session's retracted outputs, schedules of no offsets
 * and sequence ids out of range. */
#include <dlpack/dlpack.h>
#include <kvsnap/kvsnap_c.h>
#include <stdio.h>
#include <string.h>

#include "c_check.h"

/* Keys or values [1, 2, tokens, 4]: element i is seed + i (copied into a new array). */
static kvsnap_array* kv_array(int64_t tokens, float seed) {
  static float buffer[2 * 64 * 4];
  const int64_t shape[4] = {1, 2, tokens, 4};
  for (int64_t i = 0; i < 2 * tokens * 4; ++i) buffer[i] = seed + (float)i;
  kvsnap_array* array = NULL;
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, buffer, &array));
  return array;
}

/* Appends `tokens` tokens to an attention cache at its offset. */
static void append(kvsnap_cache* cache, int64_t tokens, float seed) {
  int64_t offset = 0;
  CHECK_OK(kvsnap_cache_offset(cache, &offset));
  const int32_t offsets[1] = {(int32_t)offset};
  const kvsnap_batch batch = {.batch_size = 1, .length = tokens, .seq_offsets = offsets};
  kvsnap_array* keys = kv_array(tokens, seed);
  kvsnap_array* values = kv_array(tokens, -seed);
  CHECK_OK(kvsnap_cache_update(cache, &batch, keys, values, NULL));
  kvsnap_array_destroy(keys);
  kvsnap_array_destroy(values);
}

/* ---- DLPack ---------------------------------------------------------------------------- */

static int deleted = 0;
static void count_deleter(DLManagedTensor* tensor) {
  ++deleted;
  CHECK(tensor->manager_ctx == &deleted);
}

/* A [2, 3] f32 tensor over data[1..]: rows 4 elements apart, 4 bytes of byte_offset. */
static float dl_data[8] = {0, 1, 2, 3, 4, 5, 6, 7};
static int64_t dl_shape[2] = {2, 3};
static int64_t dl_strides[2] = {4, 1};
static DLManagedTensor strided_tensor(void) {
  DLManagedTensor tensor = {.dl_tensor = {.data = dl_data,
                                          .device = {kDLCPU, 0},
                                          .ndim = 2,
                                          .dtype = {kDLFloat, 32, 1},
                                          .shape = dl_shape,
                                          .strides = dl_strides,
                                          .byte_offset = sizeof(float)},
                            .manager_ctx = &deleted,
                            .deleter = count_deleter};
  return tensor;
}

/* A refused tensor is not consumed: its deleter never runs. */
static void test_dlpack_import_failures_leave_the_tensor_to_the_caller(void) {
  kvsnap_array* array = NULL;
  DLManagedTensor tensor = strided_tensor();
  tensor.dl_tensor.device.device_type = kDLCUDA;
  CHECK_FAILS(kvsnap_array_from_dlpack(&tensor, &array), KVSNAP_ERROR,
              "from_dlpack: the tensor is on device type 2; only CPU memory (kDLCPU, or host "
              "memory a GPU runtime pinned: kDLCUDAHost, kDLROCMHost) is supported");
  tensor = strided_tensor();
  tensor.dl_tensor.device.device_type = kDLCUDAManaged; /* may live on the GPU when read */
  CHECK_FAILS(kvsnap_array_from_dlpack(&tensor, &array), KVSNAP_ERROR,
              "from_dlpack: the tensor is on device type 13;");
  tensor = strided_tensor();
  tensor.dl_tensor.dtype.bits = 64;
  CHECK_FAILS(kvsnap_array_from_dlpack(&tensor, &array), KVSNAP_ERROR,
              "from_dlpack: dtype (code 2, 64 bits, 1 lanes) is not supported");
  tensor = strided_tensor();
  tensor.dl_tensor.ndim = 5;
  CHECK_FAILS(kvsnap_array_from_dlpack(&tensor, &array), KVSNAP_ERROR,
              "from_dlpack: the tensor has 5 axes; at most 4 are supported");
  tensor = strided_tensor();
  tensor.dl_tensor.byte_offset = 2; /* not a whole f32 */
  CHECK_FAILS(kvsnap_array_from_dlpack(&tensor, &array), KVSNAP_ERROR, "Array::wrap: data ");
  /* Null data with an offset was a non-null address (0x40) that wrap accepted. */
  tensor = strided_tensor();
  tensor.dl_tensor.data = NULL;
  tensor.dl_tensor.byte_offset = 64;
  CHECK_FAILS(kvsnap_array_from_dlpack(&tensor, &array), KVSNAP_ERROR,
              "from_dlpack: the tensor of shape [2, 3] has null data");
  /* Offsets and strides that reach past 2^62 bytes describe no memory: offsets computed from them
   * would overflow. */
  tensor = strided_tensor();
  tensor.dl_tensor.byte_offset = (uint64_t)1 << 63;
  CHECK_FAILS(kvsnap_array_from_dlpack(&tensor, &array), KVSNAP_ERROR,
              "from_dlpack: byte_offset 9223372036854775808 is more than 2^62");
  {
    int64_t huge[2] = {INT64_MAX / 2, 1};
    tensor = strided_tensor();
    tensor.dl_tensor.strides = huge;
    CHECK_FAILS(kvsnap_array_from_dlpack(&tensor, &array), KVSNAP_ERROR,
                "Array::wrap: strides [4611686018427387903, 1] over shape [2, 3] reach more than "
                "2^62 bytes");
  }
  tensor = strided_tensor();
  tensor.dl_tensor.shape = NULL;
  CHECK_FAILS(kvsnap_array_from_dlpack(&tensor, &array), KVSNAP_ERROR,
              "from_dlpack: the tensor has 2 axes and a null shape");
  CHECK(array == NULL);
  CHECK(deleted == 0);
}

/* An imported tensor honours byte_offset and strides, and its deleter runs exactly once, when
 * the last array naming it (a view here) goes away. */
static void test_dlpack_import_runs_the_deleter_once(void) {
  deleted = 0;
  DLManagedTensor tensor = strided_tensor();
  kvsnap_array *array = NULL, *row = NULL;
  CHECK_OK(kvsnap_array_from_dlpack(&tensor, &array));
  kvsnap_array_info info;
  CHECK_OK(kvsnap_array_get_info(array, &info));
  CHECK(info.data == &dl_data[1] && info.shape[0] == 2 && info.shape[1] == 3);
  CHECK(info.strides[0] == 4 && info.strides[1] == 1);
  float compact[6] = {0};
  CHECK_OK(kvsnap_array_copy_to(array, compact, sizeof compact));
  CHECK(compact[0] == 1 && compact[2] == 3 && compact[3] == 5 && compact[5] == 7);
  CHECK_OK(kvsnap_array_slice(array, 0, 1, 2, &row));
  kvsnap_array_destroy(array);
  CHECK(deleted == 0); /* the view still names the tensor */
  kvsnap_array_destroy(row);
  CHECK(deleted == 1);
}

/* Host memory a GPU runtime pinned (cudaMallocHost, hipHostMalloc) is CPU memory: imported as
 * kDLCPU's is. */
static void test_dlpack_import_takes_pinned_host_memory(void) {
  const DLDeviceType pinned[2] = {kDLCUDAHost, kDLROCMHost};
  for (int i = 0; i < 2; ++i) {
    deleted = 0;
    DLManagedTensor tensor = strided_tensor();
    tensor.dl_tensor.device = (DLDevice){pinned[i], 0};
    kvsnap_array* array = NULL;
    CHECK_OK(kvsnap_array_from_dlpack(&tensor, &array));
    float compact[6] = {0};
    CHECK_OK(kvsnap_array_copy_to(array, compact, sizeof compact));
    CHECK(compact[0] == 1 && compact[5] == 7);
    kvsnap_array_destroy(array);
    CHECK(deleted == 1);
  }
}

/* An exported tensor keeps the array's buffer alive past the array's destroy, until its own
 * deleter runs. */
static void test_dlpack_export_keeps_the_buffer(void) {
  const int64_t before = kvsnap_live_bytes();
  const int64_t shape[1] = {4};
  const float data[4] = {1, 2, 3, 4};
  kvsnap_array* array = NULL;
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 1, shape, data, &array));
  DLManagedTensor* tensor = NULL;
  CHECK_OK(kvsnap_array_to_dlpack(array, &tensor));
  kvsnap_array_destroy(array);
  CHECK(kvsnap_live_bytes() == before + 16);
  CHECK(((const float*)tensor->dl_tensor.data)[3] == 4);
  tensor->deleter(tensor);
  CHECK(kvsnap_live_bytes() == before);
}

/* ---- consuming calls ------------------------------------------------------------------- */

/* Owned (materialized) snapshots [0, 4) and [4, 8) of a KV cache, and their bytes. */
static void owned_halves(kvsnap_snapshot** first, kvsnap_snapshot** second, int64_t* bytes) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  append(cache, 8, 0);
  kvsnap_snapshot* whole = NULL;
  CHECK_OK(kvsnap_cache_snapshot(cache, 0, &whole));
  CHECK_OK(kvsnap_cache_split(cache, whole, 4, first, second));
  kvsnap_cache_destroy(cache); /* copies both out: they own their bytes now */
  kvsnap_snapshot_info a, b;
  CHECK_OK(kvsnap_snapshot_get_info(*first, &a));
  CHECK_OK(kvsnap_snapshot_get_info(*second, &b));
  CHECK(!a.is_lazy && !b.is_lazy && a.size > 0 && b.size > 0);
  *bytes = a.size + b.size;
}

/* merge and split consume their snapshots also when they fail: the bytes go with them (and
 * ASan sees no leak, no double free). */
static void test_failed_merges_and_splits_consume_their_snapshots(void) {
  kvsnap_cache *cache = NULL, *recurrent = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  const kvsnap_recurrent_options options = {2, 4, 1, 2, 2};
  CHECK_OK(kvsnap_recurrent_cache_create(&options, &recurrent));
  const int64_t start = kvsnap_live_bytes();
  kvsnap_snapshot *a = NULL, *b = NULL, *out = NULL, *before = NULL, *after = NULL;
  int64_t bytes = 0;

  owned_halves(&a, &b, &bytes);
  CHECK(kvsnap_live_bytes() == start + bytes);
  CHECK_FAILS(kvsnap_cache_merge(cache, b, a, &out), KVSNAP_ERROR,
              "KVCache::merge: parent [4, 8) and child [0, 4) are not adjacent");
  CHECK(out == NULL && kvsnap_live_bytes() == start);

  owned_halves(&a, &b, &bytes);
  CHECK_FAILS(kvsnap_cache_merge(recurrent, a, b, &out), KVSNAP_ERROR, "RecurrentCache::merge");
  CHECK(kvsnap_live_bytes() == start);
  owned_halves(&a, &b, &bytes);
  CHECK_FAILS(kvsnap_cache_merge(NULL, a, b, &out), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_merge: cache is NULL");
  CHECK(kvsnap_live_bytes() == start);
  owned_halves(&a, &b, &bytes);
  CHECK_FAILS(kvsnap_cache_merge(cache, a, b, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_merge: out is NULL");
  CHECK(kvsnap_live_bytes() == start);

  owned_halves(&a, &b, &bytes);
  kvsnap_snapshot_destroy(b);
  CHECK_FAILS(kvsnap_cache_split(cache, a, 9, &before, &after), KVSNAP_ERROR,
              "KVCache::split: at 9 is outside the snapshot's range [0, 4)");
  CHECK(before == NULL && after == NULL && kvsnap_live_bytes() == start);
  owned_halves(&a, &b, &bytes);
  kvsnap_snapshot_destroy(b);
  CHECK_FAILS(kvsnap_cache_split(cache, a, 2, NULL, &after), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_split: before is NULL");
  CHECK(kvsnap_live_bytes() == start);

  kvsnap_cache_destroy(recurrent);
  kvsnap_cache_destroy(cache);
}

/* The same snapshot as both halves of a merge is refused and consumed once; one pointer for
 * both parts of a split is refused (the second part would overwrite the first). */
static void test_aliased_handles_are_refused(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  const int64_t start = kvsnap_live_bytes();
  kvsnap_snapshot *a = NULL, *b = NULL, *out = NULL;
  int64_t bytes = 0;
  owned_halves(&a, &b, &bytes);
  kvsnap_snapshot_destroy(b);
  CHECK_FAILS(kvsnap_cache_merge(cache, a, a, &out), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_merge: parent and child are the same snapshot (a merge joins two "
              "adjacent ones); it is consumed");
  CHECK(out == NULL && kvsnap_live_bytes() == start);

  owned_halves(&a, &b, &bytes);
  kvsnap_snapshot_destroy(b);
  CHECK_FAILS(kvsnap_cache_split(cache, a, 2, &out, &out), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_split: before and after are the same pointer");
  CHECK(out == NULL && kvsnap_live_bytes() == start);
  kvsnap_cache_destroy(cache);
}

/* ---- arrays ---------------------------------------------------------------------------- */

/* copy_to writes bytes: a destination at an odd address is fine, from a compact array and from
 * a strided view. */
static void test_copy_to_any_alignment(void) {
  const int64_t shape[2] = {2, 3};
  const float data[6] = {1, 2, 3, 4, 5, 6};
  kvsnap_array *a = NULL, *column = NULL;
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 2, shape, data, &a));
  CHECK_OK(kvsnap_array_slice(a, 1, 1, 2, &column));
  unsigned char buffer[1 + sizeof data];
  CHECK_OK(kvsnap_array_copy_to(a, buffer + 1, sizeof data));
  CHECK(memcmp(buffer + 1, data, sizeof data) == 0);
  const float expected[2] = {2, 5};
  CHECK_OK(kvsnap_array_copy_to(column, buffer + 1, sizeof expected));
  CHECK(memcmp(buffer + 1, expected, sizeof expected) == 0);
  kvsnap_array_destroy(column);
  kvsnap_array_destroy(a);
}

/* ---- sessions -------------------------------------------------------------------------- */

/* retract_outputs takes back generated tokens only: the count within what was generated, after
 * prefill_done, with the layers at or past the prompt. The tokens taken back are not paged
 * out. */
static void test_session_retract_outputs(void) {
  kvsnap_cache* layer = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&layer));
  kvsnap_prefix_cache* prefix = NULL;
  CHECK_OK(kvsnap_prefix_cache_create(&layer, 1, NULL, &prefix));
  const int32_t prompt[4] = {1, 2, 3, 4}, outputs[3] = {9, 8, 7};
  kvsnap_session* session = NULL;
  CHECK_OK(kvsnap_prefix_cache_begin(prefix, prompt, 4, &session));
  CHECK_FAILS(kvsnap_session_retract_outputs(session, 1), KVSNAP_ERROR,
              "Session::retract_outputs: count 1 must be in [0, 0] (the tokens generated so far), "
              "after prefill_done()");
  append(layer, 4, 0);
  CHECK_OK(kvsnap_session_prefill_done(session));
  for (int i = 0; i < 3; ++i) {
    CHECK_OK(kvsnap_session_append_output(session, outputs[i]));
    append(layer, 1, 10 + (float)i); /* the forward of the output token */
  }
  CHECK_FAILS(kvsnap_session_retract_outputs(session, 4), KVSNAP_ERROR,
              "Session::retract_outputs: count 4 must be in [0, 3]");
  CHECK_FAILS(kvsnap_session_retract_outputs(session, -1), KVSNAP_ERROR,
              "Session::retract_outputs: count -1 must be in [0, 3]");
  /* A layer rewound into the prompt: no retraction reaches there. */
  kvsnap_snapshot* tail = NULL;
  bool restored = false;
  CHECK_OK(kvsnap_cache_snapshot(layer, 0, &tail));
  CHECK_OK(kvsnap_cache_restore(layer, NULL, 3, &restored));
  CHECK_FAILS(kvsnap_session_retract_outputs(session, 1), KVSNAP_ERROR,
              "Session::retract_outputs: layer 0 stands at offset 3, inside the 4-token prompt");
  CHECK_OK(kvsnap_cache_restore(layer, tail, 7, &restored));
  CHECK(restored);
  kvsnap_snapshot_destroy(tail);
  /* Drafts 8 and 7 rejected: taken back from the session, the layer rewound to match. */
  CHECK_OK(kvsnap_session_retract_outputs(session, 2));
  CHECK_OK(kvsnap_cache_restore(layer, NULL, 5, &restored));
  CHECK(restored);
  CHECK_OK(kvsnap_session_close(session));
  kvsnap_session_destroy(session);
  CHECK_FAILS(kvsnap_session_retract_outputs(NULL, 1), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_session_retract_outputs: session is NULL");
  /* The trie holds 1 2 3 4 9, not 8: a request for 1 2 3 4 9 8 0 restores 5 tokens. */
  const int32_t next[7] = {1, 2, 3, 4, 9, 8, 0};
  int64_t cached = 0;
  CHECK_OK(kvsnap_prefix_cache_match(prefix, -1, next, 7, &cached));
  CHECK(cached == 5);
  kvsnap_prefix_cache_destroy(prefix);
  kvsnap_cache_destroy(layer);
}

/* ---- schedules and sequences ------------------------------------------------------------ */

/* A schedule of no offsets schedules nothing: no sequence appears and a prefix cache over the
 * layer begins as before. */
static void test_an_empty_schedule_schedules_nothing(void) {
  kvsnap_cache* layer = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&layer));
  CHECK_OK(kvsnap_cache_prepare_snapshots(layer, NULL, 0));
  CHECK_OK(kvsnap_cache_prepare_snapshots_seq(layer, 3, NULL, 0));
  size_t count = 1;
  CHECK_OK(kvsnap_cache_sequences(layer, NULL, 0, &count));
  CHECK(count == 0);
  kvsnap_prefix_cache* prefix = NULL;
  CHECK_OK(kvsnap_prefix_cache_create(&layer, 1, NULL, &prefix));
  const int32_t prompt[2] = {1, 2};
  kvsnap_session* session = NULL;
  CHECK_OK(kvsnap_prefix_cache_begin(prefix, prompt, 2, &session));
  kvsnap_session_destroy(session);
  kvsnap_prefix_cache_destroy(prefix);
  kvsnap_cache_destroy(layer);
}

/* Every call naming a sequence refuses an id out of range alike, reads and no-ops included. */
static void test_sequence_ids_out_of_range_are_refused(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  int64_t value = 0;
  kvsnap_snapshot* snapshot = NULL;
  kvsnap_array* arrays[2];
  size_t count = 0;
  const char* rule = "KVCache: sequence id -1 outside [0, 1048576)";
  CHECK_FAILS(kvsnap_cache_offset_seq(cache, -1, &value), KVSNAP_ERROR, rule);
  CHECK_FAILS(kvsnap_cache_reset_seq(cache, -1), KVSNAP_ERROR, rule);
  CHECK_FAILS(kvsnap_cache_exposed_bytes_seq(cache, -1, &value), KVSNAP_ERROR, rule);
  CHECK_FAILS(kvsnap_cache_state_seq(cache, -1, arrays, 2, &count), KVSNAP_ERROR, rule);
  CHECK_FAILS(kvsnap_cache_cancel_snapshots_seq(cache, -1), KVSNAP_ERROR, rule);
  CHECK_FAILS(kvsnap_cache_snapshot_seq(cache, -1, 0, &snapshot), KVSNAP_ERROR, rule);
  CHECK_FAILS(kvsnap_cache_offset_seq(cache, 1 << 20, &value), KVSNAP_ERROR,
              "KVCache: sequence id 1048576 outside [0, 1048576)");
  kvsnap_cache_destroy(cache);
}

int main(void) {
  test_dlpack_import_failures_leave_the_tensor_to_the_caller();
  test_dlpack_import_runs_the_deleter_once();
  test_dlpack_import_takes_pinned_host_memory();
  test_dlpack_export_keeps_the_buffer();
  test_failed_merges_and_splits_consume_their_snapshots();
  test_aliased_handles_are_refused();
  test_copy_to_any_alignment();
  test_session_retract_outputs();
  test_an_empty_schedule_schedules_nothing();
  test_sequence_ids_out_of_range_are_refused();
  if (failures > 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("c_api_contracts: all checks passed\n");
  return 0;
}
