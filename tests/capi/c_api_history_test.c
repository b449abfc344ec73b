/* Histories as the caches hold them, from a program compiled as C11: a paged cache's sequences
 * read in place through their block tables (no gather), ragged histories of batches whose rows
 * are different sequences, and kvsnap_sdpa over every form, checked against attention computed
 * here from each sequence's full token history. */
#include <kvsnap/kvsnap_c.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "c_check.h"

enum { kHeads = 2, kDepth = 4, kQueryHeads = 4, kMaxTokens = 64, kSeqs = 3 };

/* Every sequence's keys and values by position, as written (the reference). */
static float ref_keys[kSeqs][kMaxTokens][kHeads][kDepth];
static float ref_values[kSeqs][kMaxTokens][kHeads][kDepth];

static float element(int64_t seq, int64_t pos, int64_t head, int64_t d, float sign) {
  return sign * sinf(0.37f * (float)(pos * 8 + head * 4 + d) + 1.3f * (float)seq);
}

/* Keys and values [rows, kHeads, length, kDepth] for row b = sequence seqs[b] from
 * offsets[b], lens[b] real tokens; recorded in the reference. */
static void make_kv(int64_t rows, int64_t length, const int32_t* seqs, const int32_t* offsets,
                    const int32_t* lens, kvsnap_array** keys, kvsnap_array** values) {
  static float k[kSeqs * kHeads * kMaxTokens * kDepth], v[kSeqs * kHeads * kMaxTokens * kDepth];
  memset(k, 0, sizeof k);
  memset(v, 0, sizeof v);
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t c = 0; c < lens[b]; ++c) {
        for (int64_t d = 0; d < kDepth; ++d) {
          const int64_t pos = offsets[b] + c, at = ((b * kHeads + h) * length + c) * kDepth + d;
          k[at] = ref_keys[seqs[b]][pos][h][d] = element(seqs[b], pos, h, d, 1.0f);
          v[at] = ref_values[seqs[b]][pos][h][d] = element(seqs[b], pos, h, d, -0.5f);
        }
      }
    }
  }
  const int64_t shape[4] = {rows, kHeads, length, kDepth};
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, k, keys));
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, v, values));
}

/* Writes `tokens` tokens to sequence `seq` of `cache` at its offset. */
static void write(kvsnap_cache* cache, int32_t seq, int32_t tokens) {
  int64_t offset = 0;
  CHECK_OK(kvsnap_cache_offset_seq(cache, seq, &offset));
  const int32_t offsets[1] = {(int32_t)offset}, lens[1] = {tokens}, ids[1] = {seq};
  const kvsnap_batch batch = {.batch_size = 1,
                              .length = tokens,
                              .seq_offsets = offsets,
                              .seq_query_lens = lens,
                              .seq_ids = ids};
  kvsnap_array *keys = NULL, *values = NULL;
  make_kv(1, tokens, ids, offsets, lens, &keys, &values);
  CHECK_OK(kvsnap_cache_update(cache, &batch, keys, values, NULL));
  kvsnap_array_destroy(keys);
  kvsnap_array_destroy(values);
}

/* Queries [rows, kQueryHeads, length, kDepth]: element i is a function of i. */
static kvsnap_array* make_queries(int64_t rows, int64_t length) {
  static float q[kSeqs * kQueryHeads * kMaxTokens * kDepth];
  const int64_t n = rows * kQueryHeads * length * kDepth;
  for (int64_t i = 0; i < n; ++i) q[i] = cosf(0.21f * (float)i);
  const int64_t shape[4] = {rows, kQueryHeads, length, kDepth};
  kvsnap_array* array = NULL;
  CHECK_OK(kvsnap_array_from_data(KVSNAP_F32, 4, shape, q, &array));
  return array;
}

static float at4(const kvsnap_array_info* info, int64_t a, int64_t b, int64_t c, int64_t d) {
  const float* data = (const float*)info->data;
  return data[a * info->strides[0] + b * info->strides[1] + c * info->strides[2] +
              d * info->strides[3]];
}

/* Checks `out` [rows, kQueryHeads, length, kDepth] against attention over the reference: row b
 * (sequence seqs[b]) sees its keys at positions [max(0, query - window + 1) or 0, query] for
 * its first lens[b] queries (causal; window 0: no lookback). */
static void check_attention(const kvsnap_array* out, const kvsnap_array* q, int64_t rows,
                            const int32_t* seqs, const int32_t* offsets, const int32_t* lens,
                            int64_t window, float scale) {
  kvsnap_array_info o, qi;
  CHECK_OK(kvsnap_array_get_info(out, &o));
  CHECK_OK(kvsnap_array_get_info(q, &qi));
  CHECK(o.dtype == KVSNAP_F32 && o.ndim == 4 && o.shape[0] == rows && o.shape[1] == kQueryHeads);
  double worst = 0;
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < kQueryHeads; ++h) {
      const int64_t kh = h / (kQueryHeads / kHeads);
      for (int64_t l = 0; l < lens[b]; ++l) {
        const int64_t query = offsets[b] + l;
        const int64_t first = window > 0 && query - window + 1 > 0 ? query - window + 1 : 0;
        double scores[kMaxTokens], top = -1e30, sum = 0;
        for (int64_t p = first; p <= query; ++p) {
          double s = 0;
          for (int64_t d = 0; d < kDepth; ++d)
            s += at4(&qi, b, h, l, d) * ref_keys[seqs[b]][p][kh][d];
          scores[p] = scale * s;
          if (scores[p] > top) top = scores[p];
        }
        for (int64_t p = first; p <= query; ++p) sum += exp(scores[p] - top);
        for (int64_t d = 0; d < kDepth; ++d) {
          double expected = 0;
          for (int64_t p = first; p <= query; ++p)
            expected += exp(scores[p] - top) / sum * ref_values[seqs[b]][p][kh][d];
          const double error = fabs(expected - at4(&o, b, h, l, d));
          if (error > worst) worst = error;
        }
      }
    }
  }
  CHECK(worst < 1e-5);
}

/* Keys [0, head, column, d] of a paged history read through its table and chunks. */
static float paged_key(const kvsnap_history* history, int64_t head, int64_t column, int64_t d) {
  kvsnap_paged_info paged;
  CHECK_OK(kvsnap_history_get_paged(history, &paged));
  const int32_t block = paged.table[column / paged.block_tokens];
  kvsnap_array *keys = NULL, *values = NULL;
  CHECK_OK(kvsnap_history_paged_chunk(history, (size_t)(block / paged.blocks_per_chunk), &keys,
                                      &values));
  kvsnap_array_info info;
  CHECK_OK(kvsnap_array_get_info(keys, &info));
  const int64_t slot =
      (block % paged.blocks_per_chunk) * paged.block_tokens + column % paged.block_tokens;
  const float key = at4(&info, 0, head, slot, d);
  kvsnap_array_destroy(keys);
  kvsnap_array_destroy(values);
  return key;
}

static void test_paged_histories_in_place(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_paged_kv_cache_create(4, &cache));
  write(cache, 0, 14);
  kvsnap_snapshot* prefix = NULL;
  CHECK_OK(kvsnap_cache_snapshot_seq(cache, 0, 0, &prefix));
  bool restored = false;
  CHECK_OK(kvsnap_cache_restore_seq(cache, 1, prefix, 10, &restored));
  CHECK(restored);
  memcpy(ref_keys[1], ref_keys[0], sizeof ref_keys[0]);
  memcpy(ref_values[1], ref_values[0], sizeof ref_values[0]);
  kvsnap_snapshot_destroy(prefix);

  /* A view of sequence 0 holds no copy of its 14 columns; a contiguous one does. */
  const int32_t view_offsets[1] = {14}, view_ids[1] = {0};
  const kvsnap_batch view = {
      .batch_size = 1, .length = 1, .seq_offsets = view_offsets, .seq_ids = view_ids};
  const int64_t before = kvsnap_live_bytes();
  kvsnap_history* whole = NULL;
  CHECK_OK(kvsnap_cache_view_history(cache, &view, &whole));
  CHECK(kvsnap_live_bytes() == before);
  kvsnap_history_info info;
  CHECK_OK(kvsnap_history_get_info(whole, &info));
  CHECK(info.form == KVSNAP_HISTORY_PAGED && info.length == 14 && info.rows == 1);
  kvsnap_paged_info paged;
  CHECK_OK(kvsnap_history_get_paged(whole, &paged));
  CHECK(paged.block_tokens == 4 && paged.length == 14 && paged.table_size == 4 &&
        paged.chunks >= 1);
  kvsnap_kv_history arrays;
  CHECK_FAILS(kvsnap_history_arrays(whole, &arrays), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_history_arrays: the history is paged; this call needs a contiguous one");
  kvsnap_history* copy = NULL;
  CHECK_OK(kvsnap_history_contiguous(whole, &copy));
  CHECK(kvsnap_live_bytes() - before == 14 * kHeads * kDepth * 2 * (int64_t)sizeof(float));
  CHECK_OK(kvsnap_history_get_info(copy, &info));
  CHECK(info.form == KVSNAP_HISTORY_CONTIGUOUS && info.length == 14);
  CHECK_OK(kvsnap_history_arrays(copy, &arrays));
  kvsnap_array_info keys;
  CHECK_OK(kvsnap_array_get_info(arrays.keys, &keys));
  CHECK(keys.shape[2] == 14);
  for (int64_t h = 0; h < kHeads; ++h) {
    for (int64_t c = 0; c < 14; ++c) {
      for (int64_t d = 0; d < kDepth; ++d) {
        CHECK(paged_key(whole, h, c, d) == ref_keys[0][c][h][d]);
        CHECK(at4(&keys, 0, h, c, d) == ref_keys[0][c][h][d]);
      }
    }
  }
  kvsnap_kv_history_clear(&arrays);
  kvsnap_history_destroy(copy);

  /* Sequence 1 decodes a token while sequence 0 takes a 3-token chunk: one history per row. */
  const int32_t seqs[2] = {1, 0}, offsets[2] = {10, 14}, lens[2] = {1, 3};
  const kvsnap_batch batch = {.batch_size = 2,
                              .length = 3,
                              .seq_offsets = offsets,
                              .seq_query_lens = lens,
                              .seq_ids = seqs};
  kvsnap_array *k = NULL, *v = NULL;
  make_kv(2, 3, seqs, offsets, lens, &k, &v);
  int64_t offset = -1;
  CHECK_FAILS(kvsnap_cache_update_history(cache, &batch, k, v, NULL), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_update_history: out is NULL");
  CHECK_OK(kvsnap_cache_offset_seq(cache, 0, &offset));
  CHECK(offset == 14); /* refused before writing */
  kvsnap_history* ragged = NULL;
  CHECK_OK(kvsnap_cache_update_history(cache, &batch, k, v, &ragged));
  CHECK_OK(kvsnap_history_get_info(ragged, &info));
  CHECK(info.form == KVSNAP_HISTORY_RAGGED && info.rows == 2 && info.length == 17);
  CHECK_FAILS(kvsnap_history_get_paged(ragged, &paged), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_history_get_paged: the history is ragged; this call needs a paged one");
  copy = NULL;
  CHECK_FAILS(kvsnap_history_contiguous(ragged, &copy), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_history_contiguous: the history is ragged (2 rows");
  CHECK(copy == NULL);
  kvsnap_history* row = NULL;
  CHECK_FAILS(kvsnap_history_row(ragged, 2, &row), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_history_row: row 2 is outside the history's 2 row(s)");
  CHECK(row == NULL);
  CHECK_OK(kvsnap_history_row(ragged, 0, &row));
  CHECK_OK(kvsnap_history_get_info(row, &info));
  CHECK(info.form == KVSNAP_HISTORY_PAGED && info.length == 11);
  for (int64_t c = 0; c < 11; ++c) CHECK(paged_key(row, 1, c, 2) == ref_keys[1][c][1][2]);
  kvsnap_history_destroy(row);

  /* Attention over the ragged history, each row over its own sequence, causal. */
  kvsnap_array* q = make_queries(2, 3);
  const kvsnap_attention_mask causal = {.causal = true};
  kvsnap_array* out = NULL;
  CHECK_OK(kvsnap_sdpa(&batch, q, ragged, &causal, 0.5f, &out));
  check_attention(out, q, 2, seqs, offsets, lens, 0, 0.5f);
  /* ... and with a lookback of 5, on two threads: the same bits as one. */
  const kvsnap_attention_mask sliding = {.causal = true, .lookback = 5};
  kvsnap_array *one = NULL, *two = NULL;
  CHECK_OK(kvsnap_sdpa(&batch, q, ragged, &sliding, 0.5f, &one));
  check_attention(one, q, 2, seqs, offsets, lens, 5, 0.5f);
  CHECK_OK(kvsnap_set_threads(2));
  CHECK(kvsnap_threads() == 2);
  CHECK_OK(kvsnap_sdpa(&batch, q, ragged, &sliding, 0.5f, &two));
  CHECK_OK(kvsnap_set_threads(1));
  kvsnap_array_info a, b;
  CHECK_OK(kvsnap_array_get_info(one, &a));
  CHECK_OK(kvsnap_array_get_info(two, &b));
  CHECK(memcmp(a.data, b.data, (size_t)(2 * kQueryHeads * 3 * kDepth) * sizeof(float)) == 0);
  CHECK_FAILS(kvsnap_set_threads(0), KVSNAP_ERROR, "set_threads: 0 threads is outside [1, 256]");
  const kvsnap_attention_mask negative = {.lookback = -1};
  kvsnap_array* refused = NULL;
  CHECK_FAILS(kvsnap_sdpa(&batch, q, ragged, &negative, 0.5f, &refused), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_sdpa: mask->lookback -1 is negative");
  CHECK(refused == NULL);
  kvsnap_array_destroy(one);
  kvsnap_array_destroy(two);
  kvsnap_array_destroy(out);
  kvsnap_array_destroy(q);
  kvsnap_array_destroy(k);
  kvsnap_array_destroy(v);

  /* A history keeps the blocks it names alive past the cache. */
  kvsnap_cache_destroy(cache);
  CHECK(paged_key(whole, 0, 13, 3) == ref_keys[0][13][0][3]);
  kvsnap_history_destroy(whole);
  kvsnap_history_destroy(ragged);
}

static void test_other_kinds(void) {
  /* A rotating cache's history is its ring, in place, with its window. */
  kvsnap_cache* window = NULL;
  CHECK_OK(kvsnap_rotating_kv_cache_create(6, &window));
  write(window, 0, 9);
  const int32_t seqs[1] = {0}, offsets[1] = {9}, lens[1] = {1};
  const kvsnap_batch batch = {.batch_size = 1,
                              .length = 1,
                              .seq_offsets = offsets,
                              .seq_query_lens = lens,
                              .seq_ids = seqs};
  kvsnap_array *k = NULL, *v = NULL;
  make_kv(1, 1, seqs, offsets, lens, &k, &v);
  kvsnap_history* history = NULL;
  CHECK_OK(kvsnap_cache_update_history(window, &batch, k, v, &history));
  kvsnap_history_info info;
  CHECK_OK(kvsnap_history_get_info(history, &info));
  CHECK(info.form == KVSNAP_HISTORY_CONTIGUOUS && info.length == 6 && info.window == 6 &&
        info.first_position == 4);
  kvsnap_paged_info paged;
  CHECK_FAILS(kvsnap_history_get_paged(history, &paged), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_history_get_paged: the history is contiguous");
  kvsnap_history* row = NULL;
  CHECK_OK(kvsnap_history_row(history, 0, &row));
  kvsnap_history_destroy(row);
  /* Its arrays are views of the ring, and its contiguous form is itself: nothing copied. */
  const int64_t before = kvsnap_live_bytes();
  kvsnap_history* same = NULL;
  CHECK_OK(kvsnap_history_contiguous(history, &same));
  kvsnap_kv_history arrays;
  CHECK_OK(kvsnap_history_arrays(same, &arrays));
  CHECK(kvsnap_live_bytes() == before);
  kvsnap_array_info keys;
  CHECK_OK(kvsnap_array_get_info(arrays.keys, &keys));
  CHECK(keys.shape[2] == 6 && arrays.first_position == 4 && arrays.window == 6);
  for (int64_t c = 0; c < 6; ++c) {
    const int64_t position = 4 + (c - arrays.oldest_column + 6) % 6;
    CHECK(at4(&keys, 0, 1, c, 3) == ref_keys[0][position][1][3]);
  }
  kvsnap_kv_history_clear(&arrays);
  kvsnap_history_destroy(same);
  kvsnap_array* q = make_queries(1, 1);
  const kvsnap_attention_mask causal = {.causal = true};
  kvsnap_array* out = NULL;
  CHECK_OK(kvsnap_sdpa(&batch, q, history, &causal, 0.5f, &out));
  check_attention(out, q, 1, seqs, offsets, lens, 6, 0.5f);
  kvsnap_array_destroy(out);
  kvsnap_array_destroy(q);
  kvsnap_array_destroy(k);
  kvsnap_array_destroy(v);
  kvsnap_history_destroy(history);
  kvsnap_cache_destroy(window);

  /* A recurrent cache has no history. */
  const kvsnap_recurrent_options options = {1, 4, 1, 2, 2};
  kvsnap_cache* recurrent = NULL;
  CHECK_OK(kvsnap_recurrent_cache_create(&options, &recurrent));
  history = NULL;
  CHECK_FAILS(kvsnap_cache_view_history(recurrent, &batch, &history), KVSNAP_INVALID_ARGUMENT,
              "kvsnap_cache_view_history: the cache is a recurrent cache; this call needs an "
              "attention cache");
  CHECK(history == NULL);
  kvsnap_cache_destroy(recurrent);
  kvsnap_history_destroy(NULL);
}

int main(void) {
  test_paged_histories_in_place();
  test_other_kinds();
  CHECK(kvsnap_live_bytes() == 0);
  if (failures > 0) fprintf(stderr, "%d check(s) failed\n", failures);
  return failures > 0;
}
