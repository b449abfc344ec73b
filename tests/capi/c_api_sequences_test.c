/* The C API serving many sequences, from a program compiled as C11: a paged cache whose
 * sequences share blocks, per-sequence snapshots and restores, a batch whose rows are different
 * sequences (one history per row), and a prefix cache over several slots. */
#include <kvsnap/kvsnap_c.h>
#include <stdio.h>
#include <string.h>

#include "c_check.h"

/* Keys or values [rows, 2, tokens, 4]: element i is seed + i (copied into a new array). */
static kvsnap_array* kv_array(int64_t rows, int64_t tokens, float seed) {
  static float buffer[4 * 2 * 64 * 4];
  const int64_t shape[4] = {rows, 2, tokens, 4};
  for (int64_t i = 0; i < rows * 2 * tokens * 4; ++i) buffer[i] = seed + (float)i;
  kvsnap_array* array = NULL;
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, buffer, &array));
  return array;
}

/* Writes `tokens` tokens to sequence `seq` at its offset. */
static void write(kvsnap_cache* cache, int32_t seq, int64_t tokens, float seed) {
  int64_t offset = 0;
  CHECK_OK(kvsnap_cache_offset_seq(cache, seq, &offset));
  const int32_t offsets[1] = {(int32_t)offset}, ids[1] = {seq};
  const kvsnap_batch batch = {
      .batch_size = 1, .length = tokens, .seq_offsets = offsets, .seq_ids = ids};
  kvsnap_array* keys = kv_array(1, tokens, seed);
  kvsnap_array* values = kv_array(1, tokens, -seed);
  CHECK_OK(kvsnap_cache_update(cache, &batch, keys, values, NULL));
  kvsnap_array_destroy(keys);
  kvsnap_array_destroy(values);
}

/* Element [0, head, column, d] of a history's keys. */
static float key_at(const kvsnap_kv_history* history, int64_t head, int64_t column, int64_t d) {
  kvsnap_array_info info;
  CHECK_OK(kvsnap_array_get_info(history->keys, &info));
  const float* data = (const float*)info.data;
  return data[head * info.strides[1] + column * info.strides[2] + d * info.strides[3]];
}

static void test_sequences_share_blocks(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_paged_kv_cache_create(4, &cache));
  kvsnap_cache_kind kind;
  CHECK_OK(kvsnap_cache_get_kind(cache, &kind));
  CHECK(kind == KVSNAP_PAGED_KV_CACHE);
  write(cache, 0, 12, 100);
  kvsnap_snapshot* prefix = NULL;
  CHECK_OK(kvsnap_cache_snapshot_seq(cache, 0, 0, &prefix));
  bool restored = false;
  CHECK_OK(kvsnap_cache_restore_seq(cache, 1, prefix, 12, &restored));
  CHECK(restored);
  CHECK_OK(kvsnap_cache_restore_seq(cache, 2, prefix, 10, &restored));
  CHECK(restored);
  kvsnap_pool_stats stats;
  CHECK_OK(kvsnap_paged_kv_cache_get_stats(cache, &stats));
  CHECK(stats.live_blocks == 3 && stats.blocks_copied == 0); /* three blocks, shared by all */
  int32_t seqs[4];
  size_t count = 0;
  CHECK_OK(kvsnap_cache_sequences(cache, seqs, 4, &count));
  CHECK(count == 3 && seqs[0] == 0 && seqs[1] == 1 && seqs[2] == 2);
  CHECK_FAILS(kvsnap_cache_sequences(cache, seqs, 2, &count), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_sequences: capacity 2 is less than the 3 sequences");
  CHECK(count == 3);
  count = 7; /* a refusal other than the capacity writes nothing */
  CHECK_FAILS(kvsnap_cache_sequences(cache, NULL, 4, &count), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_sequences: seqs is NULL");
  CHECK(count == 7);

  /* A decode row of sequence 2 and a 2-token chunk of sequence 1 in one batch. */
  const int32_t offsets[2] = {10, 12}, lens[2] = {1, 2}, ids[2] = {2, 1};
  const kvsnap_batch batch = {
      .batch_size = 2, .length = 2, .seq_offsets = offsets, .seq_query_lens = lens, .seq_ids = ids};
  kvsnap_array* keys = kv_array(2, 2, 500);
  kvsnap_array* values = kv_array(2, 2, -500);
  kvsnap_kv_history one;
  CHECK_FAILS(kvsnap_cache_update(cache, &batch, keys, values, &one), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_update: rows 0 and 1 are sequences 2 and 1");
  int64_t offset = -1;
  CHECK_OK(kvsnap_cache_offset_seq(cache, 2, &offset));
  CHECK(offset == 10); /* refused before writing */
  /* Sequence 2 stands mid-block in a block others share: its next write copies that block. */
  int64_t exposed = -1;
  CHECK_OK(kvsnap_cache_exposed_bytes_seq(cache, 2, &exposed));
  CHECK(exposed == 4 * 2 * 4 * 2 * 4); /* a block: 4 tokens, 2 heads of 4 keys and 4 values */
  CHECK_OK(kvsnap_cache_exposed_bytes_seq(cache, 0, &exposed));
  CHECK(exposed == 0); /* at a block boundary: full blocks are never written */
  kvsnap_kv_history rows[2];
  CHECK_OK(kvsnap_cache_update_rows(cache, &batch, keys, values, rows));
  kvsnap_array_info info;
  CHECK_OK(kvsnap_array_get_info(rows[0].keys, &info));
  CHECK(info.shape[2] == 11); /* sequence 2: 10 shared tokens and its own */
  CHECK_OK(kvsnap_array_get_info(rows[1].keys, &info));
  CHECK(info.shape[2] == 14);
  CHECK(key_at(&rows[0], 0, 3, 0) == 100 + 3 * 4);       /* prefix token 3, head 0 */
  CHECK(key_at(&rows[0], 0, 10, 0) == 500);              /* row 0's new token */
  CHECK(key_at(&rows[1], 1, 13, 0) == 500 + 16 + 8 + 4); /* row 1, head 1, its 2nd token */
  CHECK_OK(kvsnap_paged_kv_cache_get_stats(cache, &stats));
  CHECK(stats.blocks_copied == 1); /* sequence 2 wrote into the shared third block */
  kvsnap_kv_history_clear(&rows[0]);
  kvsnap_kv_history_clear(&rows[1]);
  kvsnap_array_destroy(keys);
  kvsnap_array_destroy(values);

  CHECK_OK(kvsnap_cache_reset_seq(cache, 2));
  CHECK_OK(kvsnap_cache_offset_seq(cache, 2, &offset));
  CHECK(offset == 0);
  CHECK_OK(kvsnap_cache_offset_seq(cache, 1, &offset));
  CHECK(offset == 14);
  kvsnap_cache* refused = NULL;
  CHECK_FAILS(kvsnap_paged_kv_cache_create(0, &refused), KVSNAP_ERROR,
              "PagedKVCache: block_tokens 0");
  CHECK(refused == NULL);
  /* A pool chunk (64 blocks) of more than 2^60 tokens could never be allocated. */
  CHECK_FAILS(kvsnap_paged_kv_cache_create((int64_t)1 << 58, &refused), KVSNAP_ERROR,
              "PagedKVCache: block_tokens 288230376151711744 times blocks_per_chunk 64 must be at "
              "most 2^60 tokens");
  CHECK(refused == NULL);
  kvsnap_snapshot_destroy(prefix);
  kvsnap_cache_destroy(cache);
}

static void test_scheduled_captures_per_sequence(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&cache));
  write(cache, 3, 2, 1);
  const int64_t at[2] = {4, 6};
  CHECK_OK(kvsnap_cache_prepare_snapshots_seq(cache, 3, at, 2));
  write(cache, 3, 3, 2); /* reaches 4, not 6 */
  kvsnap_snapshot_list* list = NULL;
  CHECK_FAILS(kvsnap_cache_take_snapshots_seq(cache, 3, &list), KVSNAP_ERROR, "KVCache");
  CHECK_OK(kvsnap_cache_take_reached_snapshots_seq(cache, 3, &list));
  CHECK(kvsnap_snapshot_list_size(list) == 1);
  kvsnap_snapshot_list_destroy(list);
  CHECK_OK(kvsnap_cache_prepare_snapshots_seq(cache, 3, at + 1, 1));
  CHECK_OK(kvsnap_cache_cancel_snapshots_seq(cache, 3));
  kvsnap_cache_destroy(cache);
}

/* A recurrent layer serving two sequences: each has its own schedule of split points, which the
 * forward of that sequence's row asks for, and its own state. */
static void test_recurrent_split_points_per_sequence(void) {
  const kvsnap_recurrent_options options = {
      .conv_tail = 1, .conv_dim = 2, .num_v_heads = 1, .head_v_dim = 1, .head_k_dim = 1};
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_recurrent_cache_create(&options, &cache));
  const int64_t at[2] = {2, 3};
  CHECK_OK(kvsnap_cache_prepare_snapshots_seq(cache, 1, at, 2));
  int64_t splits[4] = {0};
  size_t count = 99;
  CHECK_OK(kvsnap_recurrent_snapshot_splits_seq(cache, 1, 4, splits, 4, &count));
  CHECK(count == 2 && splits[0] == 2 && splits[1] == 3);
  CHECK_OK(kvsnap_recurrent_snapshot_splits(cache, 4, splits, 4, &count));
  CHECK(count == 0); /* sequence 0 has no schedule */
  CHECK_FAILS(kvsnap_recurrent_snapshot_splits_seq(cache, 1, 4, splits, 1, &count),
              KVSNAP_INVALID_ARGUMENT,
              "kvsnap_recurrent_snapshot_splits_seq: capacity 1 is less than the 2 split points");
  CHECK(count == 2); /* the count says how much room a retry needs */

  /* Sequence 1's forward of 4 tokens: its two split points, then the end. */
  const int32_t offsets[1] = {0}, ids[1] = {1};
  const kvsnap_batch batch = {.batch_size = 1, .length = 4, .seq_offsets = offsets, .seq_ids = ids};
  kvsnap_array *conv = NULL, *delta = NULL;
  CHECK_OK(kvsnap_recurrent_get(cache, &batch, KVSNAP_F32, &conv, &delta));
  kvsnap_array_destroy(conv);
  kvsnap_array_destroy(delta);
  kvsnap_array* convs[3];
  kvsnap_array* deltas[3];
  const int64_t conv_shape[3] = {1, 1, 2}, delta_shape[4] = {1, 1, 1, 1};
  for (int i = 0; i < 3; ++i) {
    const float c[2] = {(float)i, (float)i}, d[1] = {10.0f + (float)i};
    CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 3, conv_shape, c, &convs[i]));
    CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 4, delta_shape, d, &deltas[i]));
  }
  CHECK_FAILS(kvsnap_recurrent_put(cache, &batch, (const kvsnap_array* const*)convs,
                                   (const kvsnap_array* const*)deltas, 1),
              KVSNAP_ERROR, "RecurrentCache::put: got 1 conv and 1 delta states");
  CHECK_OK(kvsnap_recurrent_put(cache, &batch, (const kvsnap_array* const*)convs,
                                (const kvsnap_array* const*)deltas, 3));
  kvsnap_snapshot_list* list = NULL;
  CHECK_OK(kvsnap_cache_take_snapshots_seq(cache, 1, &list));
  CHECK(kvsnap_snapshot_list_size(list) == 2);
  kvsnap_snapshot_list_destroy(list);

  kvsnap_array* state[2] = {NULL, NULL};
  CHECK_OK(kvsnap_cache_state_seq(cache, 1, state, 2, &count));
  CHECK(count == 2);
  kvsnap_array_info info;
  CHECK_OK(kvsnap_array_get_info(state[1], &info));
  CHECK(((const float*)info.data)[0] == 12.0f); /* the end state */
  kvsnap_array_destroy(state[0]);
  kvsnap_array_destroy(state[1]);
  CHECK_OK(kvsnap_cache_state(cache, state, 2, &count));
  CHECK(count == 0); /* sequence 0 never ran */
  for (int i = 0; i < 3; ++i) {
    kvsnap_array_destroy(convs[i]);
    kvsnap_array_destroy(deltas[i]);
  }
  kvsnap_cache_destroy(cache);
}

static void serve(kvsnap_prefix_cache* prefix, kvsnap_cache* layer, int32_t slot,
                  const int32_t* prompt, size_t length, int64_t* cached) {
  kvsnap_session* session = NULL;
  CHECK_OK(kvsnap_prefix_cache_begin_slot(prefix, slot, prompt, length, &session));
  int32_t on = -1;
  CHECK_OK(kvsnap_session_slot(session, &on));
  CHECK(on == slot);
  CHECK_OK(kvsnap_session_cached(session, cached));
  write(layer, slot, (int64_t)length - *cached, 7);
  CHECK_OK(kvsnap_session_prefill_done(session));
  CHECK_OK(kvsnap_session_close(session));
  kvsnap_session_destroy(session);
}

static void test_prefix_cache_slots(void) {
  kvsnap_cache* layer = NULL;
  CHECK_OK(kvsnap_paged_kv_cache_create(4, &layer));
  kvsnap_prefix_cache* prefix = NULL;
  const kvsnap_prefix_options options = {.slots = 2};
  CHECK_OK(kvsnap_prefix_cache_create(&layer, 1, &options, &prefix));
  const int32_t prompt[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const int32_t follow_up[10] = {1, 2, 3, 4, 5, 6, 7, 8, 50, 51};
  int64_t cached = -1, match = -1;
  serve(prefix, layer, 0, prompt, 10, &cached);
  CHECK(cached == 0);
  CHECK_OK(kvsnap_prefix_cache_match(prefix, -1, follow_up, 10, &match));
  CHECK(match == 8);
  CHECK_OK(kvsnap_prefix_cache_match(prefix, 1, follow_up, 10, &match));
  CHECK(match == 8);
  kvsnap_prefix_stats stats;
  CHECK_OK(kvsnap_prefix_cache_get_stats(prefix, &stats));
  CHECK(stats.lookups == 1); /* match changes nothing */
  serve(prefix, layer, 1, follow_up, 10, &cached);
  CHECK(cached == 8); /* slot 1 restores what slot 0 computed */
  kvsnap_session* session = NULL;
  CHECK_FAILS(kvsnap_prefix_cache_begin_slot(prefix, 2, prompt, 10, &session), KVSNAP_ERROR,
              "PrefixCache::begin");
  CHECK_FAILS(kvsnap_prefix_cache_match(prefix, 0, prompt, 10, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_prefix_cache_match: out is NULL");
  CHECK_OK(kvsnap_prefix_cache_check(prefix));
  kvsnap_prefix_cache_destroy(prefix);
  kvsnap_cache_destroy(layer);
}

int main(void) {
  test_sequences_share_blocks();
  test_scheduled_captures_per_sequence();
  test_recurrent_split_points_per_sequence();
  test_prefix_cache_slots();
  if (failures > 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("c api, many sequences: every check passed\n");
  return 0;
}
