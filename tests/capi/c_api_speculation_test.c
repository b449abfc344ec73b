/* The C API's speculation rounds, from a program compiled as C11: a verify forward over a KV
 * cache and a sliding window past its size, rolled back to the accepted drafts (the KV cache
 * rewinds, the window restores what the forward captured), with a prefix cache session that
 * learned the drafts up front and takes the rejected ones back. */
#include <kvsnap/kvsnap_c.h>
#include <stdio.h>
#include <string.h>

#include "c_check.h"

enum { kWindow = 4 };

/* Writes the token at position `position` of sequence 0: keys [1, 2, 1, 4] of element i
 * 1000 * position + i, values their negatives, so a column's content names its position. */
static void write_position(kvsnap_cache* cache, int64_t position) {
  float keys_data[8], values_data[8];
  for (int i = 0; i < 8; ++i) {
    keys_data[i] = 1000.0f * (float)position + (float)i;
    values_data[i] = -keys_data[i];
  }
  const int64_t shape[4] = {1, 2, 1, 4};
  kvsnap_array *keys = NULL, *values = NULL;
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, keys_data, &keys));
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, values_data, &values));
  const int32_t offsets[1] = {(int32_t)position};
  const kvsnap_batch batch = {.batch_size = 1, .length = 1, .seq_offsets = offsets};
  CHECK_OK(kvsnap_cache_update(cache, &batch, keys, values, NULL));
  kvsnap_array_destroy(keys);
  kvsnap_array_destroy(values);
}

/* Whether the window at `offset` shows a query there exactly the kWindow - 1 positions before
 * it, each column the keys written for the position it maps to. */
static int window_holds_last_positions(const kvsnap_cache* window, int64_t offset) {
  const int32_t offsets[1] = {(int32_t)offset};
  const kvsnap_batch batch = {.batch_size = 1, .length = 1, .seq_offsets = offsets};
  kvsnap_kv_history history;
  CHECK_OK(kvsnap_cache_view(window, &batch, &history));
  kvsnap_array_info info;
  CHECK_OK(kvsnap_array_get_info(history.keys, &info));
  const int64_t columns = info.shape[2];
  int ok = columns == kWindow - 1;
  for (int64_t c = 0; ok && c < columns; ++c) {
    const int64_t position =
        history.first_position + ((c - history.oldest_column) % columns + columns) % columns;
    const float key = ((const float*)info.data)[c * info.strides[2]];
    ok = position >= offset - columns && position < offset && key == 1000.0f * (float)position;
  }
  kvsnap_kv_history_clear(&history);
  return ok;
}

static void test_round_with_a_session(void) {
  kvsnap_cache *attention = NULL, *window = NULL;
  CHECK_OK(kvsnap_kv_cache_create(&attention));
  CHECK_OK(kvsnap_rotating_kv_cache_create(kWindow, &window));
  kvsnap_cache* layers[3] = {attention, NULL, window}; /* NULL: a stateless layer */
  kvsnap_prefix_cache* prefix = NULL;
  CHECK_OK(kvsnap_prefix_cache_create(layers, 3, NULL, &prefix));
  kvsnap_speculation* round = NULL;
  CHECK_OK(kvsnap_speculation_create(layers, 3, 0, &round));

  const int32_t prompt[6] = {1, 2, 3, 4, 5, 6};
  kvsnap_session* session = NULL;
  CHECK_OK(kvsnap_prefix_cache_begin(prefix, prompt, 6, &session));
  CHECK_FAILS(kvsnap_session_retract_outputs(session, 0), KVSNAP_ERROR,
              "Session::retract_outputs: count 0 must be in [0, 0]");
  for (int64_t p = 0; p < 6; ++p) {
    write_position(attention, p);
    write_position(window, p);
  }
  CHECK_OK(kvsnap_session_prefill_done(session));
  CHECK_OK(kvsnap_session_append_output(session, 7)); /* the model's token after the prompt */

  /* Three drafts after 7, appended up front; the verify forward feeds 7 and the drafts. */
  CHECK_FAILS(kvsnap_speculation_accept(round, 0), KVSNAP_ERROR, "Speculation::accept");
  CHECK_FAILS(kvsnap_speculation_begin(round, -1), KVSNAP_ERROR, "Speculation::begin");
  CHECK_OK(kvsnap_speculation_begin(round, 3));
  bool open = false;
  int64_t start = -1, drafts = -1;
  CHECK_OK(kvsnap_speculation_get_round(round, &open, &start, &drafts));
  CHECK(open && start == 6 && drafts == 3);
  CHECK_FAILS(kvsnap_speculation_begin(round, 1), KVSNAP_ERROR, "Speculation::begin");
  for (int32_t draft = 8; draft <= 10; ++draft) {
    CHECK_OK(kvsnap_session_append_output(session, draft));
  }
  for (int64_t p = 6; p < 10; ++p) {
    write_position(attention, p);
    write_position(window, p);
  }
  CHECK_FAILS(kvsnap_speculation_accept(round, 4), KVSNAP_ERROR, "Speculation::accept");
  CHECK_OK(kvsnap_speculation_accept(round, 1)); /* 8 confirmed, 9 rejected */
  int64_t offset = -1;
  CHECK_OK(kvsnap_cache_offset(attention, &offset));
  CHECK(offset == 8);
  CHECK_OK(kvsnap_cache_offset(window, &offset));
  CHECK(offset == 8);
  CHECK(window_holds_last_positions(window, 8)); /* 5..7: restored, not recomputed */
  kvsnap_speculation_stats stats;
  CHECK_OK(kvsnap_speculation_get_stats(round, &stats));
  CHECK(stats.rounds == 1 && stats.drafted == 3 && stats.accepted == 1);
  CHECK(stats.rewinds == 1 && stats.restores == 1);
  CHECK_OK(kvsnap_speculation_get_round(round, &open, NULL, NULL));
  CHECK(!open);

  /* The session takes the rejected drafts 9 and 10 back, never more than it generated. */
  CHECK_FAILS(kvsnap_session_retract_outputs(session, 5), KVSNAP_ERROR,
              "Session::retract_outputs: count 5 must be in [0, 4]");
  /* A rollback into the prompt is refused: here the KV layer alone went back to 5. */
  bool restored = false;
  CHECK_OK(kvsnap_cache_restore(attention, NULL, 5, &restored));
  CHECK(restored);
  CHECK_FAILS(kvsnap_session_retract_outputs(session, 2), KVSNAP_ERROR,
              "Session::retract_outputs: layer 0 stands at offset 5, inside the 6-token prompt");
  for (int64_t p = 5; p < 8; ++p) write_position(attention, p);
  CHECK_OK(kvsnap_session_retract_outputs(session, 2));
  CHECK_OK(kvsnap_session_close(session));
  kvsnap_session_destroy(session);

  /* The accepted draft was paged out, the rejected one never. */
  const int32_t accepted[9] = {1, 2, 3, 4, 5, 6, 7, 8, 99};
  const int32_t rejected[9] = {1, 2, 3, 4, 5, 6, 7, 9, 99};
  int64_t match = -1;
  CHECK_OK(kvsnap_prefix_cache_match(prefix, -1, accepted, 9, &match));
  CHECK(match == 8);
  CHECK_OK(kvsnap_prefix_cache_match(prefix, -1, rejected, 9, &match));
  CHECK(match <= 7);
  CHECK_OK(kvsnap_prefix_cache_check(prefix));

  CHECK_OK(kvsnap_speculation_cancel(round)); /* no round: nothing to do */
  kvsnap_speculation_destroy(round);
  kvsnap_prefix_cache_destroy(prefix);
  kvsnap_cache_destroy(window);
  kvsnap_cache_destroy(attention);
}

static void test_misuse(void) {
  kvsnap_speculation* round = NULL;
  CHECK_FAILS(kvsnap_speculation_create(NULL, 1, 0, &round), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_speculation_create: layers is NULL");
  CHECK_FAILS(kvsnap_speculation_create(NULL, 0, 0, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_speculation_create: out is NULL");
  CHECK_FAILS(kvsnap_speculation_begin(NULL, 1), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_speculation_begin: speculation is NULL");
  CHECK_FAILS(kvsnap_speculation_accept(NULL, 0), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_speculation_accept: speculation is NULL");
  CHECK_FAILS(kvsnap_speculation_cancel(NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_speculation_cancel: speculation is NULL");
  CHECK_FAILS(kvsnap_speculation_get_round(NULL, NULL, NULL, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_speculation_get_round: speculation is NULL");
  CHECK_FAILS(kvsnap_session_retract_outputs(NULL, 1), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_session_retract_outputs: session is NULL");
  CHECK_FAILS(kvsnap_speculation_create(NULL, 0, -1, &round), KVSNAP_ERROR,
              "Speculation: sequence id -1 outside [0, 1048576)");
  CHECK(round == NULL);
  /* A round over no layers works, and stats need somewhere to go. */
  CHECK_OK(kvsnap_speculation_create(NULL, 0, 0, &round));
  CHECK_FAILS(kvsnap_speculation_get_stats(round, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_speculation_get_stats: out is NULL");
  kvsnap_speculation_destroy(round);
  kvsnap_speculation_destroy(NULL);
}

int main(void) {
  test_round_with_a_session();
  test_misuse();
  if (failures > 0) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("c_api_speculation: all checks passed\n");
  return 0;
}
