/* The C API when memory runs out, from a program compiled as C11 (with POSIX fork and
 * setrlimit): a write to a paged cache whose history copy cannot be allocated fails before it
 * writes anything, and hands out no handle. Each case runs in a forked child whose address
 * space may grow by 1 MiB only; the ctest runs it with KVSNAP_POOL_BYTES=0, so no pooled buffer
 * can serve what the limit refuses. */
#define _POSIX_C_SOURCE 200809L

#include <kvsnap/kvsnap_c.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "array/sanitizers.h"
#include "c_check.h"

/* Wide tokens: 4 heads x 128 f32 keys and values, 4 KiB a token: a 2000-token history copy
 * takes 8 MiB. */
#define HEADS 4
#define DEPTH 128
#define MAX_TOKENS 2000
static float keys_buffer[MAX_TOKENS * HEADS * DEPTH], values_buffer[MAX_TOKENS * HEADS * DEPTH];

/* Keys and values [1, HEADS, tokens, DEPTH] over static buffers (no kvsnap allocation): key
 * element [0, h, t, 0] of token t is seed + t. */
static void make_kv(int64_t tokens, float seed, kvsnap_array** keys, kvsnap_array** values) {
  for (int64_t h = 0; h < HEADS; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t d = 0; d < DEPTH; ++d) {
        const int64_t i = (h * tokens + t) * DEPTH + d;
        keys_buffer[i] = d == 0 ? seed + (float)t : 0.5f;
        values_buffer[i] = -keys_buffer[i];
      }
    }
  }
  const int64_t shape[4] = {1, HEADS, tokens, DEPTH};
  CHECK_OK(kvsnap_array_wrap(keys_buffer, KVSNAP_F32, 4, shape, NULL, NULL, NULL, keys));
  CHECK_OK(kvsnap_array_wrap(values_buffer, KVSNAP_F32, 4, shape, NULL, NULL, NULL, values));
}

/* Writes `tokens` tokens to sequence `seq` at `offset`, handing the history out through `out`
 * (NULL: none); returns the status. */
static kvsnap_status write_tokens(kvsnap_cache* cache, int32_t seq, int32_t offset, int64_t tokens,
                                  float seed, kvsnap_kv_history* out) {
  const int32_t offsets[1] = {offset}, ids[1] = {seq};
  const kvsnap_batch batch = {
      .batch_size = 1, .length = tokens, .seq_offsets = offsets, .seq_ids = ids};
  kvsnap_array *keys = NULL, *values = NULL;
  make_kv(tokens, seed, &keys, &values);
  const kvsnap_status status = kvsnap_cache_update(cache, &batch, keys, values, out);
  kvsnap_array_destroy(keys);
  kvsnap_array_destroy(values);
  return status;
}

static int64_t offset_of(const kvsnap_cache* cache, int32_t seq) {
  int64_t offset = -1;
  CHECK_OK(kvsnap_cache_offset_seq(cache, seq, &offset));
  return offset;
}

/* Runs `body` in a forked child whose address space may grow by 1 MiB; the child's failures
 * become this process's (its CHECK messages go to the same stderr). */
static void with_one_mib_of_headroom(void (*body)(kvsnap_cache*), kvsnap_cache* cache) {
  fflush(NULL);
  const pid_t child = fork();
  if (child == 0) {
    long pages = 0;
    FILE* statm = fopen("/proc/self/statm", "r");
    if (statm == NULL || fscanf(statm, "%ld", &pages) != 1) _exit(2);
    fclose(statm);
    struct rlimit limit;
    getrlimit(RLIMIT_AS, &limit);
    limit.rlim_cur = (rlim_t)(pages * sysconf(_SC_PAGESIZE) + (1 << 20));
    setrlimit(RLIMIT_AS, &limit);
    body(cache);
    fflush(NULL);
    _exit(failures > 0 ? 1 : 0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* One token more for a paged sequence of 1999 (no new block: block 15 has room), its 4 MiB
 * history copy refused: out of memory, and the write not made. */
static void update_out_of_memory(kvsnap_cache* cache) {
  kvsnap_kv_history history = {0};
  CHECK_FAILS(write_tokens(cache, 0, 1999, 1, 5000, &history), KVSNAP_OUT_OF_MEMORY,
              "kvsnap_cache_update: out of memory");
  CHECK(offset_of(cache, 0) == 1999);
  CHECK(history.keys == NULL && history.values == NULL);
}

/* Two rows: sequence 1 (8 tokens: a small copy) and sequence 0 (the large one). Neither row is
 * written and no handle is handed out, not even row 0's. */
static void update_rows_out_of_memory(kvsnap_cache* cache) {
  const int32_t offsets[2] = {8, 1999}, ids[2] = {1, 0};
  const kvsnap_batch batch = {.batch_size = 2, .length = 1, .seq_offsets = offsets, .seq_ids = ids};
  const int64_t shape[4] = {2, HEADS, 1, DEPTH};
  kvsnap_array *keys = NULL, *values = NULL;
  CHECK_OK(kvsnap_array_wrap(keys_buffer, KVSNAP_F32, 4, shape, NULL, NULL, NULL, &keys));
  CHECK_OK(kvsnap_array_wrap(values_buffer, KVSNAP_F32, 4, shape, NULL, NULL, NULL, &values));
  kvsnap_kv_history rows[2] = {{0}, {0}};
  CHECK_FAILS(kvsnap_cache_update_rows(cache, &batch, keys, values, rows), KVSNAP_OUT_OF_MEMORY,
              "kvsnap_cache_update_rows: out of memory");
  CHECK(offset_of(cache, 0) == 1999 && offset_of(cache, 1) == 8);
  CHECK(rows[0].keys == NULL && rows[1].keys == NULL);
  kvsnap_array_destroy(keys);
  kvsnap_array_destroy(values);
}

static void test_paged_writes_that_run_out_of_memory_change_nothing(void) {
  kvsnap_cache* cache = NULL;
  CHECK_OK(kvsnap_paged_kv_cache_create(128, &cache));
  CHECK_OK(write_tokens(cache, 0, 0, 1999, 0, NULL));
  CHECK_OK(write_tokens(cache, 1, 0, 8, 100, NULL));
  with_one_mib_of_headroom(update_out_of_memory, cache);
  with_one_mib_of_headroom(update_rows_out_of_memory, cache);
  /* Without the limit the same write succeeds, its copy holding every token. */
  kvsnap_kv_history history = {0};
  CHECK_OK(write_tokens(cache, 0, 1999, 1, 5000, &history));
  kvsnap_array_info info;
  CHECK_OK(kvsnap_array_get_info(history.keys, &info));
  CHECK(info.shape[2] == 2000);
  const float* keys = (const float*)info.data;
  CHECK(keys[0] == 0 && keys[1998 * info.strides[2]] == 1998 &&
        keys[1999 * info.strides[2]] == 5000);
  kvsnap_kv_history_clear(&history);
  kvsnap_cache_destroy(cache);
}

int main(void) {
#if defined(KVSNAP_ADDRESS_SANITIZER)
  (void)test_paged_writes_that_run_out_of_memory_change_nothing; /* built, not run */
  printf("c_api_memory: skipped (AddressSanitizer ignores RLIMIT_AS)\n");
  return 0;
#else
  test_paged_writes_that_run_out_of_memory_change_nothing();
  if (failures > 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("c_api_memory: all checks passed\n");
  return 0;
#endif
}
