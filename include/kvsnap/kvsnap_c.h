/* kvsnap_c.h — the C API of kvsnap: caches, snapshots, the prefix cache and persistence behind
 * opaque handles, for engines written in C or bound from other languages (Go, Rust, ...).
 *
 * Every call that can fail returns a kvsnap_status; on failure kvsnap_last_error() holds the
 * message (for KVSNAP_ERROR, exactly the C++ kvsnap::Error text) and the objects involved are
 * unchanged (merge and split consume their snapshots either way; a session's begin or close
 * that runs out of memory ends it; after a failed prefill_done, close it: prefix_cache.h). No
 * exception crosses this API. Every handle handed out has a destroy call (NULL is ignored).
 * Pointers passed in are read during the call only, except where a call says it keeps them (a
 * prefix cache's layers; wrapped memory, which lives until its release callback).
 *
 *   kvsnap_cache* cache = NULL;
 *   kvsnap_kv_cache_create(&cache);
 *   int32_t offsets[1] = {0}, lens[1] = {3};
 *   kvsnap_batch batch = {.batch_size = 1, .length = 3, .seq_offsets = offsets,
 *                         .seq_query_lens = lens};
 *   kvsnap_kv_history history = {0};  (keys, values: the engine's [B, H, L, D], wrapped)
 *   if (kvsnap_cache_update(cache, &batch, keys, values, &history) != KVSNAP_OK)
 *     fprintf(stderr, "%s\n", kvsnap_last_error());
 *   kvsnap_snapshot* s = NULL;
 *   kvsnap_cache_snapshot(cache, 0, &s);  (lazy [0, 3): no copy)
 *   kvsnap_kv_history_clear(&history);
 *   kvsnap_snapshot_destroy(s);
 *   kvsnap_cache_destroy(cache);
 *
 * Ranges are half-open [from, to). Offsets count tokens. Threads: caches and prefix caches may
 * be called from several threads at once (the library locks them; calls on one cache run one
 * at a time, sessions on different slots side by side), and a history or an array read from
 * several (every call takes arrays const; a cache's views change with its next write);
 * snapshots, snapshot lists, sessions and speculations one thread at a time. Destroying a handle
 * while another thread is in a call on it, or on one of its sessions, is the caller's to
 * prevent. The last-error message is per thread.
 */
#ifndef KVSNAP_KVSNAP_C_H
#define KVSNAP_KVSNAP_C_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvsnap/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Status and errors ------------------------------------------------------------------- */

typedef enum kvsnap_status {
  KVSNAP_OK = 0,
  KVSNAP_ERROR = 1,            /* kvsnap::Error: a contract violation or bad data */
  KVSNAP_INVALID_ARGUMENT = 2, /* a NULL handle or pointer, an unknown enum value, the wrong
                                  cache kind, a buffer too small, a negative duration */
  KVSNAP_OUT_OF_MEMORY = 3,
  KVSNAP_INTERNAL_ERROR = 4 /* any other failure: a bug in kvsnap */
} kvsnap_status;

/* The message of the last failed call on this thread ("" if none failed yet). Valid until the
 * next failing call on this thread. */
KVSNAP_EXPORT const char* kvsnap_last_error(void);
/* Bytes held by all live kvsnap-allocated arrays (wrapped memory is not counted). */
KVSNAP_EXPORT int64_t kvsnap_live_bytes(void);

/* ---- Arrays -------------------------------------------------------------------------------- */

typedef struct kvsnap_array kvsnap_array;

typedef enum kvsnap_dtype {
  KVSNAP_F32 = 0,
  KVSNAP_F16 = 1,
  KVSNAP_BF16 = 2,
  KVSNAP_I32 = 3,
  /* Not a dtype: makes every non-negative int a value of this type for C++ too, so a wrong
   * value is refused (KVSNAP_INVALID_ARGUMENT) rather than undefined behaviour. */
  KVSNAP_DTYPE_LIMIT = 0x7fffffff
} kvsnap_dtype;

#define KVSNAP_MAX_DIMS 4

typedef struct kvsnap_array_info {
  kvsnap_dtype dtype;
  int ndim;
  int64_t shape[KVSNAP_MAX_DIMS];
  int64_t strides[KVSNAP_MAX_DIMS]; /* in elements */
  void* data;                       /* element [0, ..., 0]; treat cache views as read-only */
} kvsnap_array_info;

/* A compact array of zeros. */
KVSNAP_EXPORT kvsnap_status kvsnap_array_zeros(kvsnap_dtype dtype, int ndim, const int64_t* shape,
                                               kvsnap_array** out);
/* A compact array holding a copy of `data` (row-major, `dtype` elements). */
KVSNAP_EXPORT kvsnap_status kvsnap_array_from_data(kvsnap_dtype dtype, int ndim,
                                                   const int64_t* shape, const void* data,
                                                   kvsnap_array** out);
/* An array over memory kvsnap does not own (an engine's buffer), without copying it. `strides`
 * are in elements, non-negative (NULL: row-major). `release(context)` runs once, when the last
 * array, view, snapshot or cache state naming the memory goes away (possibly after
 * kvsnap_array_destroy of this handle); it may be NULL. On failure `release` is not called.
 * Wrapped memory does not count in kvsnap_live_bytes(). */
KVSNAP_EXPORT kvsnap_status kvsnap_array_wrap(void* data, kvsnap_dtype dtype, int ndim,
                                              const int64_t* shape, const int64_t* strides,
                                              void (*release)(void* context), void* context,
                                              kvsnap_array** out);
/* The dtype, shape, strides and data pointer of `array`. */
KVSNAP_EXPORT kvsnap_status kvsnap_array_get_info(const kvsnap_array* array,
                                                  kvsnap_array_info* out);
/* A view of [start, stop) along `axis`, sharing storage. */
KVSNAP_EXPORT kvsnap_status kvsnap_array_slice(const kvsnap_array* array, int axis, int64_t start,
                                               int64_t stop, kvsnap_array** out);
/* Copies the elements in logical row-major order into `destination` (`capacity` bytes, at
 * least the array's size in bytes; any alignment). */
KVSNAP_EXPORT kvsnap_status kvsnap_array_copy_to(const kvsnap_array* array, void* destination,
                                                 size_t capacity);
/* True when both name the same buffer (false if either is NULL). */
KVSNAP_EXPORT bool kvsnap_array_shares_storage(const kvsnap_array* a, const kvsnap_array* b);
KVSNAP_EXPORT void kvsnap_array_destroy(kvsnap_array* array);

/* DLPack (dlpack/dlpack.h, v0.6): an array from a DLManagedTensor in CPU memory (kDLCPU, or
 * pinned host memory: kDLCUDAHost, kDLROCMHost; f32, f16, bf16, i32, up to 4-d), zero-copy; kvsnap
 * calls its deleter when the last array naming it goes away. On failure the tensor is not consumed.
 */
struct DLManagedTensor;
KVSNAP_EXPORT kvsnap_status kvsnap_array_from_dlpack(struct DLManagedTensor* tensor,
                                                     kvsnap_array** out);
/* A DLManagedTensor viewing `array` (no copy), which it keeps alive until its deleter runs.
 * DLPack 0.6 has no read-only flag: the tensor of a read-only view (a cache's state or history,
 * a recurrent state) is read-only too, though nothing marks it so. */
KVSNAP_EXPORT kvsnap_status kvsnap_array_to_dlpack(const kvsnap_array* array,
                                                   struct DLManagedTensor** out);

/* ---- Batches --------------------------------------------------------------------------------
 * What one forward step processes: B rows of L columns; row b holds seq_query_lens[b] real
 * tokens starting at absolute position seq_offsets[b]. Borrowed by every call that takes one. */
typedef struct kvsnap_batch {
  int64_t batch_size;            /* rows B */
  int64_t length;                /* columns L */
  const int32_t* input_ids;      /* [B * L] row-major token ids, or NULL (ids unused) */
  const int32_t* seq_offsets;    /* [B] */
  const int32_t* seq_query_lens; /* [B], or NULL: every row has L real tokens */
  const int32_t* seq_ids;        /* [B] the sequence of each row, or NULL: row b is sequence b */
} kvsnap_batch;

/* ---- Caches and snapshots ---------------------------------------------------------------- */

typedef struct kvsnap_cache kvsnap_cache;
typedef struct kvsnap_snapshot kvsnap_snapshot;
typedef struct kvsnap_snapshot_list kvsnap_snapshot_list;

typedef enum kvsnap_cache_kind {
  KVSNAP_KV_CACHE = 0,          /* append-only attention cache */
  KVSNAP_ROTATING_KV_CACHE = 1, /* sliding-window attention cache */
  KVSNAP_RECURRENT_CACHE = 2,   /* conv tail + gated-delta state */
  KVSNAP_PAGED_KV_CACHE = 3     /* attention cache of shared, reference-counted blocks */
} kvsnap_cache_kind;

typedef struct kvsnap_recurrent_options {
  int conv_tail; /* conv tail [B, conv_tail, conv_dim] in the activation dtype */
  int conv_dim;
  int num_v_heads; /* delta state [B, num_v_heads, head_v_dim, head_k_dim] in f32 */
  int head_v_dim;
  int head_k_dim;
} kvsnap_recurrent_options;

KVSNAP_EXPORT kvsnap_status kvsnap_kv_cache_create(kvsnap_cache** out);
/* Fails unless 1 <= max_size <= 2^60 (no array holds more tokens). */
KVSNAP_EXPORT kvsnap_status kvsnap_rotating_kv_cache_create(int64_t max_size, kvsnap_cache** out);
KVSNAP_EXPORT kvsnap_status kvsnap_recurrent_cache_create(const kvsnap_recurrent_options* options,
                                                          kvsnap_cache** out);
/* A paged attention cache: each sequence is a list of `block_tokens`-token blocks; full blocks
 * are shared by reference count between sequences and snapshots, a write into a shared block
 * copies that block, a restore splices references. The pool grows by chunks of 64 blocks, each
 * one array: fails unless 1 <= block_tokens <= 2^54 (a chunk holds at most 2^60 tokens). */
KVSNAP_EXPORT kvsnap_status kvsnap_paged_kv_cache_create(int64_t block_tokens, kvsnap_cache** out);

typedef struct kvsnap_pool_stats {
  int64_t blocks;        /* blocks the pool has allocated */
  int64_t blocks_in_use; /* referenced by a sequence or a snapshot */
  int64_t bytes_in_use;  /* their keys and values */
  int64_t blocks_copied; /* copies on write and joins at restore */
  int64_t live_blocks;   /* used by sequences (a block shared by several counts once) */
  int64_t live_bytes;    /* their keys and values */
} kvsnap_pool_stats;
/* Paged kind: the blocks of its pool. */
KVSNAP_EXPORT kvsnap_status kvsnap_paged_kv_cache_get_stats(const kvsnap_cache* cache,
                                                            kvsnap_pool_stats* out);

/* Lazy snapshots of the cache outlive it: their slots are copied out first, or, where memory
 * runs out, they keep the cache's buffers instead. */
KVSNAP_EXPORT void kvsnap_cache_destroy(kvsnap_cache* cache);

KVSNAP_EXPORT kvsnap_status kvsnap_cache_get_kind(const kvsnap_cache* cache,
                                                  kvsnap_cache_kind* out);
/* Tokens written so far. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_offset(const kvsnap_cache* cache, int64_t* out);
/* Drops all state and any schedule; offset becomes 0. Never fails for lack of memory (lazy
 * snapshots keep buffers they cannot copy, as at kvsnap_cache_destroy). */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_reset(kvsnap_cache* cache);
/* The live state arrays (read-only views; a paged cache's are copies): keys and values, or conv
 * and delta state; none before the first write. Views show the cache until its next update,
 * restore or reset. Sets *count to their number; fails if it exceeds `capacity` (still setting
 * *count: NULL with capacity 0 asks for it). Any other failure leaves *count as it was. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_state(const kvsnap_cache* cache, kvsnap_array** arrays,
                                               size_t capacity, size_t* count);

/* What an attention cache hands back: keys [B, H, K, D] and values [B, H, K, Dv] (views of the
 * cache's buffers, read-only; the caller destroys them, e.g. with kvsnap_kv_history_clear),
 * and which position each key column holds: column c holds first_position + (c -
 * oldest_column) mod K. `window` > 0 hides keys `window` or more positions before a query.
 * `keys` and `values` are NULL when the cache has no layout to give them (nothing written to it,
 * or to that sequence of a KV cache, yet); otherwise arrays, of 0 columns when none is held. */
typedef struct kvsnap_kv_history {
  kvsnap_array* keys;
  kvsnap_array* values;
  int64_t first_position;
  int64_t oldest_column;
  int64_t window;
} kvsnap_kv_history;

/* Attention kinds: appends the batch's keys [B, H, L, D] and values [B, H, L, Dv] (copied into
 * the cache) and returns the history every query attends to (`out` may be NULL). A paged
 * cache's history comes back as a contiguous copy, allocated before the write (out of memory,
 * nothing is written). A batch whose rows are different sequences has one history per row: use
 * kvsnap_cache_update_rows (with `out` set, this call refuses such a batch before writing). */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_update(kvsnap_cache* cache, const kvsnap_batch* batch,
                                                const kvsnap_array* keys,
                                                const kvsnap_array* values, kvsnap_kv_history* out);
/* Attention kinds, a batch whose rows may be different sequences: as kvsnap_cache_update, with
 * row b's history in rows[b] (`rows` holds batch_size entries, or is NULL). Histories of a
 * paged cache are contiguous copies (all allocated before any row is written), others views. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_update_rows(kvsnap_cache* cache, const kvsnap_batch* batch,
                                                     const kvsnap_array* keys,
                                                     const kvsnap_array* values,
                                                     kvsnap_kv_history* rows);
/* Attention kinds: the current history, without writing. A batch whose rows are different
 * sequences is refused (KVSNAP_INVALID_ARGUMENT): view them with kvsnap_cache_view_history. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_view(const kvsnap_cache* cache, const kvsnap_batch* batch,
                                              kvsnap_kv_history* out);
/* Destroys the history's arrays and zeroes it (NULL and zeroed histories are fine). */
KVSNAP_EXPORT void kvsnap_kv_history_clear(kvsnap_kv_history* history);

/* ---- Histories in place, and attention over them ----------------------------------------
 * kvsnap_cache_update and kvsnap_cache_view hand a paged cache's history back as a contiguous
 * copy: the whole context, per layer, per step. The calls below hand a history back as the
 * cache holds it, nothing copied: views of a KV or rotating cache's buffers, a paged sequence's
 * block table over its pool's chunks, or one history per row of a batch whose rows are
 * different sequences. kvsnap_sdpa attends over any of them; an engine with its own paged
 * attention reads the block table (kvsnap_history_get_paged). A history shows the cache at the
 * call: read it before that cache's next update, restore or reset (each may rewrite columns,
 * reuse a block or wrap a ring). It keeps the buffers it names alive, past the cache's too.
 *
 *   kvsnap_history* h = NULL;
 *   kvsnap_cache_update_history(cache, &batch, keys, values, &h);
 *   kvsnap_attention_mask causal = {.causal = true};
 *   kvsnap_array* out = NULL;   (f32 [B, Hq, L, Dv])
 *   kvsnap_sdpa(&batch, q, h, &causal, 0.125f, &out);
 *   kvsnap_history_destroy(h);
 */
typedef struct kvsnap_history kvsnap_history;

typedef enum kvsnap_history_form {
  KVSNAP_HISTORY_CONTIGUOUS = 0, /* keys [B, H, K, D] and values [B, H, K, Dv] */
  KVSNAP_HISTORY_PAGED = 1,      /* one sequence's columns in the blocks of a paged cache */
  KVSNAP_HISTORY_RAGGED = 2      /* one history per batch row (kvsnap_history_row) */
} kvsnap_history_form;

typedef struct kvsnap_history_info {
  kvsnap_history_form form;
  int64_t length; /* key columns K (ragged: its longest row; 0 before any write) */
  int64_t rows;   /* ragged: the batch's rows; otherwise 1 */
  /* As in kvsnap_kv_history (contiguous and paged forms; ragged: see each row). */
  int64_t first_position;
  int64_t oldest_column;
  int64_t window;
} kvsnap_history_info;

/* Attention kinds: writes as kvsnap_cache_update does (any batch, rows of different sequences
 * included) and sets *out to the history every query attends to, as the cache holds it. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_update_history(kvsnap_cache* cache,
                                                        const kvsnap_batch* batch,
                                                        const kvsnap_array* keys,
                                                        const kvsnap_array* values,
                                                        kvsnap_history** out);
/* Attention kinds: the history `batch`'s queries would attend to, without writing. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_view_history(const kvsnap_cache* cache,
                                                      const kvsnap_batch* batch,
                                                      kvsnap_history** out);
KVSNAP_EXPORT kvsnap_status kvsnap_history_get_info(const kvsnap_history* history,
                                                    kvsnap_history_info* out);
/* A ragged history's row `row` (0 <= row < rows), as a history of its own; another form's row
 * 0 is itself (a new handle). */
KVSNAP_EXPORT kvsnap_status kvsnap_history_row(const kvsnap_history* history, int64_t row,
                                               kvsnap_history** out);
/* The history in contiguous form: a new handle for a contiguous one, a copy of a paged one (its K
 * columns gathered: O(K)); a ragged one is refused (take its rows). */
KVSNAP_EXPORT kvsnap_status kvsnap_history_contiguous(const kvsnap_history* history,
                                                      kvsnap_history** out);
/* A contiguous history's keys and values (views, read-only; the caller destroys them, e.g.
 * with kvsnap_kv_history_clear) and positions; other forms are refused. */
KVSNAP_EXPORT kvsnap_status kvsnap_history_arrays(const kvsnap_history* history,
                                                  kvsnap_kv_history* out);

/* A paged history's blocks. Column k of the sequence is in slot k % block_tokens of block
 * table[k / block_tokens]; block i holds columns [r * T, (r + 1) * T) of chunk
 * i / blocks_per_chunk, where r = i % blocks_per_chunk and T = block_tokens (chunks are
 * [1, H, blocks_per_chunk * T, D], so a head's columns of consecutive blocks are adjacent). */
typedef struct kvsnap_paged_info {
  int64_t block_tokens;
  int64_t blocks_per_chunk;
  int64_t length;       /* columns K; the last block may be partly used */
  const int32_t* table; /* block ids in position order; valid while the history lives */
  size_t table_size;
  size_t chunks; /* chunks of the pool the table may name: [0, chunks) */
} kvsnap_paged_info;
/* A paged history's block table; other forms are refused. */
KVSNAP_EXPORT kvsnap_status kvsnap_history_get_paged(const kvsnap_history* history,
                                                     kvsnap_paged_info* out);
/* Chunk `chunk` of a paged history's pool: keys [1, H, blocks_per_chunk * T, D] and values
 * [1, H, blocks_per_chunk * T, Dv] (views, read-only). */
KVSNAP_EXPORT kvsnap_status kvsnap_history_paged_chunk(const kvsnap_history* history, size_t chunk,
                                                       kvsnap_array** keys, kvsnap_array** values);
KVSNAP_EXPORT void kvsnap_history_destroy(kvsnap_history* history);

/* Which keys each query may see (kvsnap::AttentionMask): every rule set applies (intersected);
 * none set (or a NULL mask) shows every key. Positions are absolute. */
typedef struct kvsnap_attention_mask {
  bool causal;               /* no key after the query */
  int64_t lookback;          /* > 0: no key `lookback` or more positions before the query */
  const kvsnap_array* array; /* or NULL: [B|1, Hq|1, L, P] indexed by batch row, query head,
                               query index and key position; i32 is boolean (nonzero:
                               visible), a float array an additive bias (-inf: hidden) */
} kvsnap_attention_mask;

/* Reference scaled-dot-product attention (kvsnap::sdpa) in f32: q [B, Hq, L, D] (f32, f16 or
 * bf16) over `history` in any form, a paged one read in place; grouped-query attention when Hq
 * is a multiple of the history's H. *out is f32 [B, Hq, L, Dv]:
 *   out[b,h,l] = softmax_k(scale * q[b,h,l]·key[b,h',k] + mask[b,h,l,k]) · value[b,h',k]
 * where the mask is `mask` with the history's own window; a query that sees no key gets
 * zeros. Bitwise the same for every thread count (kvsnap_set_threads) and however the batch's
 * rows share blocks. */
KVSNAP_EXPORT kvsnap_status kvsnap_sdpa(const kvsnap_batch* batch, const kvsnap_array* q,
                                        const kvsnap_history* history,
                                        const kvsnap_attention_mask* mask, float scale,
                                        kvsnap_array** out);
/* Threads kvsnap_sdpa runs on, the calling one included (kvsnap::set_threads; 1 to 256; the
 * default is 1). Process-wide. */
KVSNAP_EXPORT kvsnap_status kvsnap_set_threads(int threads);
KVSNAP_EXPORT int kvsnap_threads(void);

/* Recurrent kind: the live conv and delta state for `batch` (one row: one sequence's state a
 * call; KVSNAP_INVALID_ARGUMENT for more rows), zero-initialized on first use.
 * Views of state that snapshots share (capture copies nothing): read-only, as writing them would
 * change those snapshots. A kernel that updates state in place works on a copy (e.g.
 * kvsnap_array_copy_to into the engine's buffer) and puts that (kvsnap_recurrent_put). */
KVSNAP_EXPORT kvsnap_status kvsnap_recurrent_get(kvsnap_cache* cache, const kvsnap_batch* batch,
                                                 kvsnap_dtype activation_dtype,
                                                 kvsnap_array** conv_state,
                                                 kvsnap_array** delta_state);
/* Recurrent kind: ends a forward of the batch's L tokens with `count` conv and delta states, one
 * per scheduled split point (kvsnap_recurrent_snapshot_splits), then the end state. The cache
 * adopts the arrays (no copy; wrapped memory stays referenced): do not write to them. A row of
 * no tokens leaves its sequence as it is: its arrays are checked, not adopted. */
KVSNAP_EXPORT kvsnap_status kvsnap_recurrent_put(kvsnap_cache* cache, const kvsnap_batch* batch,
                                                 const kvsnap_array* const* conv_states,
                                                 const kvsnap_array* const* delta_states,
                                                 size_t count);
/* Recurrent kind: scheduled offsets strictly inside the next forward of `forward_len` tokens,
 * relative to the offset. Sets *count; fails if it exceeds `capacity` (setting *count as
 * kvsnap_cache_state does). */
KVSNAP_EXPORT kvsnap_status kvsnap_recurrent_snapshot_splits(const kvsnap_cache* cache,
                                                             int64_t forward_len, int64_t* splits,
                                                             size_t capacity, size_t* count);
/* The same for sequence `seq`: a forward whose row is sequence `seq` puts one state per split
 * point of that sequence's schedule (which a prefix cache session on slot `seq` sets). */
KVSNAP_EXPORT kvsnap_status kvsnap_recurrent_snapshot_splits_seq(const kvsnap_cache* cache,
                                                                 int32_t seq, int64_t forward_len,
                                                                 int64_t* splits, size_t capacity,
                                                                 size_t* count);

/* A snapshot of [from_offset, offset) (KV) or of the whole state at the offset (others). *out
 * is NULL when there is nothing to hold (an empty range, or offset 0). */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_snapshot(kvsnap_cache* cache, int64_t from_offset,
                                                  kvsnap_snapshot** out);
/* Schedules captures as writes reach each offset (ascending, unique, >= offset). No offsets
 * schedule nothing (and the cache stays free to move). */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_prepare_snapshots(kvsnap_cache* cache,
                                                           const int64_t* offsets, size_t count);
/* One entry per scheduled offset, in order (NULL entries for zero-width edges); clears the
 * schedule. Fails if an offset is unreached. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_take_snapshots(kvsnap_cache* cache,
                                                        kvsnap_snapshot_list** out);
/* For a forward cut short: the entries for the scheduled offsets already reached. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_take_reached_snapshots(kvsnap_cache* cache,
                                                                kvsnap_snapshot_list** out);
/* Drops the schedule and what it captured. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_cancel_snapshots(kvsnap_cache* cache);
/* Returns the cache to `target` using `snapshot` (NULL: live rewind). *restored is false, and
 * nothing changed, when the target is unreachable. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_restore(kvsnap_cache* cache, kvsnap_snapshot* snapshot,
                                                 int64_t target, bool* restored);
/* Sequence `seq` of a cache serving many (the calls above address sequence 0; a cache serves a
 * sequence once a batch row or a restore names it). Every call naming a sequence refuses an id
 * outside [0, 2^20) (KVSNAP_ERROR). */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_offset_seq(const kvsnap_cache* cache, int32_t seq,
                                                    int64_t* out);
/* Bytes sequence `seq`'s writes may still copy into snapshots already taken (the lazy data they
 * would overwrite): an upper bound (Cache::exposed_bytes). */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_exposed_bytes_seq(const kvsnap_cache* cache, int32_t seq,
                                                           int64_t* out);
/* The sequences the cache has made (written, restored or given a schedule; a reset one stays,
   at offset 0), ascending; sets *count, fails if it exceeds `capacity` (setting *count as
   kvsnap_cache_state does). */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_sequences(const kvsnap_cache* cache, int32_t* seqs,
                                                   size_t capacity, size_t* count);
/* Sequence `seq`'s live state arrays, as kvsnap_cache_state. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_state_seq(const kvsnap_cache* cache, int32_t seq,
                                                   kvsnap_array** arrays, size_t capacity,
                                                   size_t* count);
/* Drops sequence `seq`'s state and schedule (lazy snapshots of it are copied out first). */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_reset_seq(kvsnap_cache* cache, int32_t seq);
KVSNAP_EXPORT kvsnap_status kvsnap_cache_snapshot_seq(kvsnap_cache* cache, int32_t seq,
                                                      int64_t from_offset, kvsnap_snapshot** out);
KVSNAP_EXPORT kvsnap_status kvsnap_cache_prepare_snapshots_seq(kvsnap_cache* cache, int32_t seq,
                                                               const int64_t* offsets,
                                                               size_t count);
KVSNAP_EXPORT kvsnap_status kvsnap_cache_take_snapshots_seq(kvsnap_cache* cache, int32_t seq,
                                                            kvsnap_snapshot_list** out);
KVSNAP_EXPORT kvsnap_status kvsnap_cache_take_reached_snapshots_seq(kvsnap_cache* cache,
                                                                    int32_t seq,
                                                                    kvsnap_snapshot_list** out);
KVSNAP_EXPORT kvsnap_status kvsnap_cache_cancel_snapshots_seq(kvsnap_cache* cache, int32_t seq);
/* Restores sequence `seq`; a paged cache splices another sequence's blocks without copying. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_restore_seq(kvsnap_cache* cache, int32_t seq,
                                                     kvsnap_snapshot* snapshot, int64_t target,
                                                     bool* restored);

/* Joins adjacent snapshots `parent` then `child`. Either may be NULL: NULL in gives NULL out
 * (the other is destroyed). Consumes both, also on failure: do not use or destroy them
 * afterwards. The same snapshot as both is refused (KVSNAP_INVALID_ARGUMENT) and consumed once. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_merge(kvsnap_cache* cache, kvsnap_snapshot* parent,
                                               kvsnap_snapshot* child, kvsnap_snapshot** out);
/* Splits at `at` into before and after (either may come back NULL; `before` and `after` must
 * be different pointers). Consumes `snapshot`, also on failure. */
KVSNAP_EXPORT kvsnap_status kvsnap_cache_split(kvsnap_cache* cache, kvsnap_snapshot* snapshot,
                                               int64_t at, kvsnap_snapshot** before,
                                               kvsnap_snapshot** after);

typedef struct kvsnap_snapshot_info {
  int64_t from; /* KV kinds: [from, to) of tokens held; whole states: from == to == offset */
  int64_t to;
  int64_t size; /* bytes owned: 0 while wholly lazy */
  bool is_lazy; /* names live cache slots for some of its data */
} kvsnap_snapshot_info;

KVSNAP_EXPORT kvsnap_status kvsnap_snapshot_get_info(const kvsnap_snapshot* snapshot,
                                                     kvsnap_snapshot_info* out);
KVSNAP_EXPORT void kvsnap_snapshot_destroy(kvsnap_snapshot* snapshot);

/* Entries in the list (0 for NULL). */
KVSNAP_EXPORT size_t kvsnap_snapshot_list_size(const kvsnap_snapshot_list* list);
/* Moves entry `index` out to the caller (*out NULL for a null entry or one already taken). */
KVSNAP_EXPORT kvsnap_status kvsnap_snapshot_list_take(kvsnap_snapshot_list* list, size_t index,
                                                      kvsnap_snapshot** out);
/* Destroys the list and the entries still in it. */
KVSNAP_EXPORT void kvsnap_snapshot_list_destroy(kvsnap_snapshot_list* list);

/* ---- Persistence --------------------------------------------------------------------------- */

/* Writes `count` snapshots (NULL entries allowed) with `offset` to a safetensors file,
 * atomically, mode 0600. Lazy snapshots are read from their cache, not materialized. Refuses,
 * writing nothing, a folder that a load would refuse (kvsnap_save_snapshots_with saves for a
 * shared folder), and a path that names no file (empty, ending in '/', '.' or '..'). */
KVSNAP_EXPORT kvsnap_status kvsnap_save_snapshots(const char* path, int64_t offset,
                                                  const kvsnap_snapshot* const* snapshots,
                                                  size_t count);
/* Reads a file written by kvsnap_save_snapshots: its offset and one entry per saved layer.
 * Refuses a file, or a folder holding it, that another user owns or that group or others can
 * write (see load_snapshots in persistence.h; kvsnap_load_snapshots_with opts in to shared
 * files). */
KVSNAP_EXPORT kvsnap_status kvsnap_load_snapshots(const char* path, int64_t* offset,
                                                  kvsnap_snapshot_list** out);

/* ---- Prefix cache -------------------------------------------------------------------------- */

typedef struct kvsnap_prefix_cache kvsnap_prefix_cache;
typedef struct kvsnap_session kvsnap_session;

typedef struct kvsnap_prefix_options {
  int64_t max_paged_out_bytes; /* budget for snapshot bytes in the trie; <= 0: the default */
  int32_t slots; /* sequences of the layers served at once (one session each); <= 0: 1 */
} kvsnap_prefix_options;

typedef struct kvsnap_prefix_stats {
  int64_t lookups;           /* begin calls that opened a session */
  int64_t matched_tokens;    /* prompt tokens found in the trie */
  int64_t reused_tokens;     /* tokens restored instead of evaluated */
  int64_t evicted_nodes;     /* trie nodes evicted under the budget */
  int64_t dropped_snapshots; /* whole-state snapshots dropped from the active path */
  int64_t paged_out_bytes;   /* bytes owned by snapshots in the trie */
  int64_t node_count;        /* trie nodes, the root excluded */
} kvsnap_prefix_stats;

/* A prefix cache over `count` layers, borrowed: they must outlive it (a NULL entry is a
 * stateless layer). `options` may be NULL. From now on it drives the layers' offsets. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_create(kvsnap_cache* const* layers, size_t count,
                                                       const kvsnap_prefix_options* options,
                                                       kvsnap_prefix_cache** out);
/* Open sessions are detached (their calls fail; destroying them is fine): no forward over one's
 * remaining() may still run. */
KVSNAP_EXPORT void kvsnap_prefix_cache_destroy(kvsnap_prefix_cache* prefix);
/* Starts a request for `prompt` (at least one token); one session at a time. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_begin(kvsnap_prefix_cache* prefix,
                                                      const int32_t* prompt, size_t count,
                                                      kvsnap_session** out);
/* Starts a request on `slot` (the layers' sequence `slot`; one session per slot at a time). */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_begin_slot(kvsnap_prefix_cache* prefix,
                                                           int32_t slot, const int32_t* prompt,
                                                           size_t count, kvsnap_session** out);
/* The prompt tokens begin would restore on `slot` as it stands (slot < 0: from the trie alone).
 * Changes nothing: for schedulers choosing where to run a request. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_match(const kvsnap_prefix_cache* prefix,
                                                      int32_t slot, const int32_t* prompt,
                                                      size_t count, int64_t* out);
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_get_stats(const kvsnap_prefix_cache* prefix,
                                                          kvsnap_prefix_stats* out);
/* Nodes the last kvsnap_prefix_cache_load found in the file, before its budget evicted any
 * (evicted_nodes counts those, never read); 0 before any load. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_loaded_nodes(const kvsnap_prefix_cache* prefix,
                                                             int64_t* out);
/* The most bytes the trie's snapshots held at any instant since the cache was made or
 * kvsnap_prefix_cache_reset_peak last ran: what max_paged_out_bytes bounds. */
KVSNAP_EXPORT kvsnap_status
kvsnap_prefix_cache_peak_paged_out_bytes(const kvsnap_prefix_cache* prefix, int64_t* out);
/* Starts a new peak measurement from the bytes the trie's snapshots hold now. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_reset_peak(kvsnap_prefix_cache* prefix);
/* KVSNAP_OK when the trie's invariants hold; otherwise KVSNAP_ERROR naming the first violation. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_check(const kvsnap_prefix_cache* prefix);
/* Writes the trie and its snapshots to folder `dir` with `model_id` (NULL: ""), atomically, mode
 * 0600. Refuses, writing nothing, a `dir` a load would refuse (kvsnap_prefix_cache_save_with
 * saves for a shared folder). */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_save(const kvsnap_prefix_cache* prefix,
                                                     const char* dir, const char* model_id);
/* Replaces the trie by the one saved in `dir` for the same layers and `model_id` (NULL: "").
 * Refuses, like kvsnap_load_snapshots, a `dir` or file that is not private to this user. */
KVSNAP_EXPORT kvsnap_status kvsnap_prefix_cache_load(kvsnap_prefix_cache* prefix, const char* dir,
                                                     const char* model_id);
/* Whether `dir` holds a saved trie that kvsnap_prefix_cache_load would not refuse as not
 * private (it then says why); the load still checks the model id and the layers. */
KVSNAP_EXPORT bool kvsnap_prefix_cache_saved_in(const char* dir);

/* The prompt tokens the model must still evaluate; *tokens stays valid until the next call on
 * the session. */
KVSNAP_EXPORT kvsnap_status kvsnap_session_remaining(const kvsnap_session* session,
                                                     const int32_t** tokens, size_t* count);
/* Tokens restored from the cache: the live caches stand at this offset. */
KVSNAP_EXPORT kvsnap_status kvsnap_session_cached(const kvsnap_session* session, int64_t* out);
/* The slot (the layers' sequence) the session runs on. */
KVSNAP_EXPORT kvsnap_status kvsnap_session_slot(const kvsnap_session* session, int32_t* out);
/* Extra restore points (absolute offsets in [cached, prompt size]), before the prefill: user
   nodes. branch_points: guesses (where other prompts may leave this one), ordinary nodes. */
KVSNAP_EXPORT kvsnap_status kvsnap_session_schedule_snapshots(kvsnap_session* session,
                                                              const int64_t* offsets, size_t count);
KVSNAP_EXPORT kvsnap_status kvsnap_session_schedule_branch_points(kvsnap_session* session,
                                                                  const int64_t* offsets,
                                                                  size_t count);
/* After the prefill forward over the remaining tokens. */
KVSNAP_EXPORT kvsnap_status kvsnap_session_prefill_done(kvsnap_session* session);
/* A generated token. */
KVSNAP_EXPORT kvsnap_status kvsnap_session_append_output(kvsnap_session* session, int32_t token);
/* Takes back the last `count` generated tokens (drafts the verification rejected; never paged
 * out). Fails, changing nothing, unless decoding, 0 <= count <= the tokens generated so far, and
 * the layers stand at or past the prompt's end: a rollback never enters the prompt. */
KVSNAP_EXPORT kvsnap_status kvsnap_session_retract_outputs(kvsnap_session* session, int64_t count);
/* Pages the evaluated tokens out into the trie and ends the session (idempotent). */
KVSNAP_EXPORT kvsnap_status kvsnap_session_close(kvsnap_session* session);
/* Closes the session if still open (a failure to page out is dropped), then frees it. */
KVSNAP_EXPORT void kvsnap_session_destroy(kvsnap_session* session);

#ifdef __cplusplus
} /* extern "C" */
#endif

#include "kvsnap/kvsnap_c_files.h"       /* shared folders' saves and loads: likewise */
#include "kvsnap/kvsnap_c_speculation.h" /* speculation's calls: part of this API */

#endif /* KVSNAP_KVSNAP_C_H */
