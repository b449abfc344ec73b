// The C API for caches: the four kinds, their writes and histories, and their live state.
#include "attention/paged_gather.h"
#include "cache/cache_access.h"
#include "capi/handles.h"

using namespace kvsnap;
using namespace kvsnap::capi;

namespace {

RecurrentCache& recurrent(const kvsnap_cache* handle, const char* call) {
  const kvsnap_cache& cache = require(handle, call, "cache");
  if (cache.kind != KVSNAP_RECURRENT_CACHE) {
    throw InvalidArgument(fmt::format("{}: the cache is {}; this call needs a recurrent cache",
                                      call, kind_name(cache.kind)));
  }
  return static_cast<RecurrentCache&>(*cache.cache);
}

PagedKVCache& paged(const kvsnap_cache* handle, const char* call) {
  const kvsnap_cache& cache = require(handle, call, "cache");
  if (cache.kind != KVSNAP_PAGED_KV_CACHE) {
    throw InvalidArgument(fmt::format("{}: the cache is {}; this call needs a paged KV cache", call,
                                      kind_name(cache.kind)));
  }
  return static_cast<PagedKVCache&>(*cache.cache);
}

kvsnap_status create(kvsnap_cache** out, kvsnap_cache_kind kind, const char* call,
                     const std::function<std::unique_ptr<Cache>()>& make) {
  return guard(call, [&] {
    require(out, call, "out");
    *out = new kvsnap_cache{make(), kind};
  });
}

// One history as the C struct: views of a contiguous history, a contiguous copy of a paged one.
// What it allocates is allocated before the write (a failure to allocate then changes nothing):
// the handles, and for a paged cache the arrays the copy goes into (reserve_copy).
struct HistoryHandles {
  std::unique_ptr<kvsnap_array> keys = std::make_unique<kvsnap_array>();
  std::unique_ptr<kvsnap_array> values = std::make_unique<kvsnap_array>();
  KVHistory history;

  // Before `write` to a paged cache: the arrays of row `b`'s copy, [1, H, K, D] and [1, H, K, Dv]
  // with K the row's offset plus its real tokens (its sequence's offset after the write).
  // Nothing for a row the write refuses, which then changes nothing.
  void reserve_copy(const KVWrite& write, int64_t b) {
    const Array &k = write.keys, &v = write.values;
    const Batch& batch = write.batch;
    if (k.ndim() != 4 || v.ndim() != 4 || b >= batch.batch_size()) return;
    const auto row = static_cast<size_t>(b);
    const int64_t query = batch.seq_query_lens[row];
    if (query < 0 || query > k.dim(2)) return;
    try {
      if (write.layer.offset(batch.seq_id(b)) != batch.seq_offsets[row]) return;
    } catch (const Error&) {  // a sequence id the write refuses
      return;
    }
    const int64_t length = batch.seq_offsets[row] + query;
    keys->array = Array::uninitialized(k.dtype(), {1, k.dim(1), length, k.dim(3)});
    values->array = Array::uninitialized(v.dtype(), {1, v.dim(1), length, v.dim(3)});
  }

  // After the write: row's history, a paged one copied into the reserved arrays when they fit
  // (else into new ones).
  void take(const KVHistory& row) {
    if (!row.paged()) {
      history = row;
      return;
    }
    const PagedColumns& p = row.paged_columns();
    const Array &k = keys->array, &v = values->array;
    const auto fits = [&](const Array& reserved, const Array& chunk) {
      return !reserved.empty() && reserved.dtype() == chunk.dtype() &&
             reserved.shape() == Shape{1, chunk.dim(1), p.length, chunk.dim(3)};
    };
    if (p.key_chunks.empty() || !fits(k, p.key_chunks.front()) ||
        !fits(v, p.value_chunks.front())) {
      history = row.contiguous();
      return;
    }
    detail::gather_paged(p, k, v);
    history = KVHistory(k, v, row.first_position(), 0, row.window());
  }

  // A history that holds no key yet (a sequence never written) has no arrays: NULL handles.
  void hand_out(kvsnap_kv_history* out) noexcept {
    keys->array = history.keys();
    values->array = history.values();
    const bool none = keys->array.empty();
    *out = {none ? nullptr : keys.release(), none ? nullptr : values.release(),
            history.first_position(), history.oldest_column(), history.window()};
  }
};

// Hands the history `write` returns out through `rows` (one per batch row, or NULL). Given a
// `batch`, `rows` is one history: the batch must be one sequence's (checked before writing).
// `paged` is the write when it goes to a paged cache (its copies are reserved first). A paged
// cache's `layer` stays locked from the call to the end of the copies: another thread's write
// of the sequence waits for them.
void write_histories(kvsnap_kv_history* rows, size_t count, const Batch* batch, const char* call,
                     const std::function<KVHistory()>& write, const Attention& layer,
                     const KVWrite* paged = nullptr) {
  if (rows != nullptr && batch != nullptr) {
    for (int64_t b = 1; b < batch->batch_size(); ++b) {
      if (batch->seq_id(b) != batch->seq_id(0)) {
        throw InvalidArgument(
            fmt::format("{}: rows 0 and {} are sequences {} and {}: one history per row needs "
                        "kvsnap_cache_update_rows (a write) or kvsnap_cache_view_history (a view)",
                        call, b, batch->seq_id(0), batch->seq_id(b)));
      }
    }
  }
  std::vector<HistoryHandles> handles(rows != nullptr ? count : 0);
  // Locked before the reservations read the sequences' offsets: another thread's write between
  // the two would leave a copy unreserved, allocated after this write (out of memory then
  // reported for a write that happened).
  std::unique_lock<std::recursive_mutex> held;
  if (const auto* pages = dynamic_cast<const PagedKVCache*>(&layer)) {
    held = std::unique_lock(detail::PagedCacheAccess::lock(*pages));
  }
  for (size_t b = 0; paged != nullptr && b < handles.size(); ++b) {
    handles[b].reserve_copy(*paged, static_cast<int64_t>(b));
  }
  const KVHistory history = write();
  if (handles.empty()) return;
  // Every row's history first, then all handed out: a failure hands out none.
  const size_t given = history.ragged() ? count : 1;
  for (size_t b = 0; b < given; ++b) handles[b].take(history.row(static_cast<int64_t>(b)));
  std::fill(rows, rows + count, kvsnap_kv_history{});
  for (size_t b = 0; b < given; ++b) handles[b].hand_out(&rows[b]);
}

// `write` when it goes to a paged cache (`cache`, checked by to_kv_write), else null.
const KVWrite* paged_write(const kvsnap_cache* cache, const KVWrite& write) {
  return cache->kind == KVSNAP_PAGED_KV_CACHE ? &write : nullptr;
}

std::vector<Array> arrays(const kvsnap_array* const* handles, size_t count, const char* call,
                          const char* name) {
  if (count > 0) require(handles, call, name);
  std::vector<Array> result;
  result.reserve(count);
  for (size_t i = 0; i < count; ++i) result.push_back(require(handles[i], call, name).array);
  return result;
}

}  // namespace

extern "C" {

kvsnap_status kvsnap_kv_cache_create(kvsnap_cache** out) {
  return create(out, KVSNAP_KV_CACHE, "kvsnap_kv_cache_create",
                [] { return std::make_unique<KVCache>(); });
}

kvsnap_status kvsnap_rotating_kv_cache_create(int64_t max_size, kvsnap_cache** out) {
  return create(out, KVSNAP_ROTATING_KV_CACHE, "kvsnap_rotating_kv_cache_create",
                [&] { return std::make_unique<RotatingKVCache>(max_size); });
}

kvsnap_status kvsnap_paged_kv_cache_create(int64_t block_tokens, kvsnap_cache** out) {
  return create(out, KVSNAP_PAGED_KV_CACHE, "kvsnap_paged_kv_cache_create", [&] {
    return std::make_unique<PagedKVCache>(PagedKVCache::Options{.block_tokens = block_tokens});
  });
}

kvsnap_status kvsnap_paged_kv_cache_get_stats(const kvsnap_cache* cache, kvsnap_pool_stats* out) {
  constexpr const char* call = "kvsnap_paged_kv_cache_get_stats";
  return guard(call, [&] {
    const PagedKVCache::PoolStats s = paged(cache, call).pool_stats();
    require(out, call, "out") = {s.blocks,        s.blocks_in_use, s.bytes_in_use,
                                 s.blocks_copied, s.live_blocks,   s.live_bytes};
  });
}

kvsnap_status kvsnap_recurrent_cache_create(const kvsnap_recurrent_options* options,
                                            kvsnap_cache** out) {
  constexpr const char* call = "kvsnap_recurrent_cache_create";
  return create(out, KVSNAP_RECURRENT_CACHE, call, [&] {
    const kvsnap_recurrent_options& o = require(options, call, "options");
    return std::make_unique<RecurrentCache>(o.conv_tail, o.conv_dim, o.num_v_heads, o.head_v_dim,
                                            o.head_k_dim);
  });
}

void kvsnap_cache_destroy(kvsnap_cache* cache) { delete cache; }

kvsnap_status kvsnap_cache_get_kind(const kvsnap_cache* cache, kvsnap_cache_kind* out) {
  constexpr const char* call = "kvsnap_cache_get_kind";
  return guard(call, [&] { require(out, call, "out") = require(cache, call, "cache").kind; });
}

kvsnap_status kvsnap_cache_offset(const kvsnap_cache* cache, int64_t* out) {
  constexpr const char* call = "kvsnap_cache_offset";
  return guard(call,
               [&] { require(out, call, "out") = require(cache, call, "cache").cache->offset(); });
}

kvsnap_status kvsnap_cache_reset(kvsnap_cache* cache) {
  return guard("kvsnap_cache_reset",
               [&] { require(cache, "kvsnap_cache_reset", "cache").cache->reset(); });
}

namespace {

// The state arrays into `arrays` (kvsnap_cache_state and its per-sequence form).
void hand_out_state(const std::vector<Array>& state, kvsnap_array** arrays, size_t capacity,
                    size_t* count, const char* call) {
  hand_out_counted(state.size(), arrays, capacity, count, call, "state arrays", "arrays", [&] {
    std::vector<std::unique_ptr<kvsnap_array>> handles;
    for (const Array& array : state)
      handles.push_back(std::unique_ptr<kvsnap_array>(new kvsnap_array{array}));
    for (size_t i = 0; i < handles.size(); ++i) arrays[i] = handles[i].release();
  });
}

// The split points into `splits` (kvsnap_recurrent_snapshot_splits and its per-sequence form).
void hand_out_splits(const std::vector<int64_t>& points, int64_t* splits, size_t capacity,
                     size_t* count, const char* call) {
  hand_out_counted(points.size(), splits, capacity, count, call, "split points", "splits",
                   [&] { std::copy(points.begin(), points.end(), splits); });
}

}  // namespace

kvsnap_status kvsnap_cache_state(const kvsnap_cache* cache, kvsnap_array** arrays, size_t capacity,
                                 size_t* count) {
  constexpr const char* call = "kvsnap_cache_state";
  return guard(call, [&] {
    hand_out_state(require(cache, call, "cache").cache->state(), arrays, capacity, count, call);
  });
}

kvsnap_status kvsnap_cache_state_seq(const kvsnap_cache* cache, int32_t seq, kvsnap_array** arrays,
                                     size_t capacity, size_t* count) {
  constexpr const char* call = "kvsnap_cache_state_seq";
  return guard(call, [&] {
    hand_out_state(require(cache, call, "cache").cache->state(seq), arrays, capacity, count, call);
  });
}

kvsnap_status kvsnap_cache_update(kvsnap_cache* cache, const kvsnap_batch* batch,
                                  const kvsnap_array* keys, const kvsnap_array* values,
                                  kvsnap_kv_history* out) {
  constexpr const char* call = "kvsnap_cache_update";
  return guard(call, [&] {
    const KVWrite write = to_kv_write(cache, batch, keys, values, call);
    write_histories(out, 1, &write.batch, call, std::cref(write), write.layer,
                    paged_write(cache, write));
  });
}

kvsnap_status kvsnap_cache_update_rows(kvsnap_cache* cache, const kvsnap_batch* batch,
                                       const kvsnap_array* keys, const kvsnap_array* values,
                                       kvsnap_kv_history* rows) {
  constexpr const char* call = "kvsnap_cache_update_rows";
  return guard(call, [&] {
    const KVWrite write = to_kv_write(cache, batch, keys, values, call);
    write_histories(rows, static_cast<size_t>(write.batch.batch_size()), nullptr, call,
                    std::cref(write), write.layer, paged_write(cache, write));
  });
}

kvsnap_status kvsnap_cache_view(const kvsnap_cache* cache, const kvsnap_batch* batch,
                                kvsnap_kv_history* out) {
  constexpr const char* call = "kvsnap_cache_view";
  if (out == nullptr) return fail(KVSNAP_INVALID_ARGUMENT, "kvsnap_cache_view: out is NULL");
  return guard(call, [&] {
    const Attention& layer = attention(cache, call);
    const Batch b = to_batch(batch, call);
    write_histories(
        out, 1, &b, call, [&] { return layer.view(b); }, layer);
  });
}

void kvsnap_kv_history_clear(kvsnap_kv_history* history) {
  if (history == nullptr) return;
  delete history->keys;
  delete history->values;
  *history = {};
}

kvsnap_status kvsnap_recurrent_get(kvsnap_cache* cache, const kvsnap_batch* batch,
                                   kvsnap_dtype activation_dtype, kvsnap_array** conv_state,
                                   kvsnap_array** delta_state) {
  constexpr const char* call = "kvsnap_recurrent_get";
  return guard(call, [&] {
    RecurrentCache& layer = recurrent(cache, call);
    require(conv_state, call, "conv_state");
    require(delta_state, call, "delta_state");
    const Batch b = to_batch(batch, call);
    if (b.batch_size() != 1) {
      throw InvalidArgument(fmt::format(
          "{}: a batch of {} rows; the C API reads one sequence's state a call (a batch of one "
          "row, its seq_ids naming the sequence)",
          call, b.batch_size()));
    }
    auto conv = std::make_unique<kvsnap_array>();
    auto delta = std::make_unique<kvsnap_array>();
    const RecurrentHistory history = layer.get(b, to_dtype(activation_dtype, call));
    conv->array = history.conv_state();
    delta->array = history.delta_state();
    *conv_state = conv.release();
    *delta_state = delta.release();
  });
}

kvsnap_status kvsnap_recurrent_put(kvsnap_cache* cache, const kvsnap_batch* batch,
                                   const kvsnap_array* const* conv_states,
                                   const kvsnap_array* const* delta_states, size_t count) {
  constexpr const char* call = "kvsnap_recurrent_put";
  return guard(call, [&] {
    RecurrentCache& layer = recurrent(cache, call);
    const std::vector<Array> conv = arrays(conv_states, count, call, "conv_states");
    const std::vector<Array> delta = arrays(delta_states, count, call, "delta_states");
    layer.put(to_batch(batch, call), conv, delta);
  });
}

kvsnap_status kvsnap_recurrent_snapshot_splits(const kvsnap_cache* cache, int64_t forward_len,
                                               int64_t* splits, size_t capacity, size_t* count) {
  constexpr const char* call = "kvsnap_recurrent_snapshot_splits";
  return guard(call, [&] {
    hand_out_splits(recurrent(cache, call).snapshot_splits(forward_len), splits, capacity, count,
                    call);
  });
}

kvsnap_status kvsnap_recurrent_snapshot_splits_seq(const kvsnap_cache* cache, int32_t seq,
                                                   int64_t forward_len, int64_t* splits,
                                                   size_t capacity, size_t* count) {
  constexpr const char* call = "kvsnap_recurrent_snapshot_splits_seq";
  return guard(call, [&] {
    hand_out_splits(recurrent(cache, call).snapshot_splits(seq, forward_len), splits, capacity,
                    count, call);
  });
}

}  // extern "C"
