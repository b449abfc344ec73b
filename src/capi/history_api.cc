// The C API for histories as the caches hold them (contiguous, paged, ragged), their parts, and
// reference attention over them.
#include "capi/handles.h"

using namespace kvsnap;
using namespace kvsnap::capi;

namespace {

kvsnap_history_form form_of(const KVHistory& history) {
  if (history.ragged()) return KVSNAP_HISTORY_RAGGED;
  return history.paged() ? KVSNAP_HISTORY_PAGED : KVSNAP_HISTORY_CONTIGUOUS;
}

const PagedColumns& paged_of(const kvsnap_history* handle, const char* call) {
  const KVHistory& history = require(handle, call, "history").history;
  if (!history.paged()) {
    throw InvalidArgument(fmt::format("{}: the history is {}; this call needs a paged one", call,
                                      history.ragged() ? "ragged" : "contiguous"));
  }
  return history.paged_columns();
}

AttentionMask to_mask(const kvsnap_attention_mask* mask, const char* call) {
  AttentionMask logical = AttentionMask::none();
  if (mask == nullptr) return logical;
  if (mask->lookback < 0) {
    throw InvalidArgument(
        fmt::format("{}: mask->lookback {} is negative (0: no lookback)", call, mask->lookback));
  }
  if (mask->causal) logical = logical.intersect(AttentionMask::causal());
  if (mask->lookback > 0) logical = logical.intersect(AttentionMask::lookback(mask->lookback));
  if (mask->array != nullptr)
    logical = logical.intersect(AttentionMask::from_array(mask->array->array));
  return logical;
}

// *out = a new handle for what `make` returns; out is checked first and the handle allocated
// before `make` runs, so a failure to allocate changes nothing.
template <class Make>
void hand_out(kvsnap_history** out, const char* call, Make&& make) {
  require(out, call, "out");
  auto handle = std::make_unique<kvsnap_history>();
  handle->history = make();
  *out = handle.release();
}

}  // namespace

extern "C" {

kvsnap_status kvsnap_cache_update_history(kvsnap_cache* cache, const kvsnap_batch* batch,
                                          const kvsnap_array* keys, const kvsnap_array* values,
                                          kvsnap_history** out) {
  constexpr const char* call = "kvsnap_cache_update_history";
  return guard(call, [&] { hand_out(out, call, to_kv_write(cache, batch, keys, values, call)); });
}

kvsnap_status kvsnap_cache_view_history(const kvsnap_cache* cache, const kvsnap_batch* batch,
                                        kvsnap_history** out) {
  constexpr const char* call = "kvsnap_cache_view_history";
  return guard(call, [&] {
    const Attention& layer = attention(cache, call);
    const Batch b = to_batch(batch, call);
    hand_out(out, call, [&] { return layer.view(b); });
  });
}

kvsnap_status kvsnap_history_get_info(const kvsnap_history* history, kvsnap_history_info* out) {
  constexpr const char* call = "kvsnap_history_get_info";
  return guard(call, [&] {
    const KVHistory& h = require(history, call, "history").history;
    require(out, call, "out") = {form_of(h),         h.length(),        h.rows(),
                                 h.first_position(), h.oldest_column(), h.window()};
  });
}

kvsnap_status kvsnap_history_row(const kvsnap_history* history, int64_t row, kvsnap_history** out) {
  constexpr const char* call = "kvsnap_history_row";
  return guard(call, [&] {
    const KVHistory& h = require(history, call, "history").history;
    if (row < 0 || row >= h.rows()) {
      throw InvalidArgument(
          fmt::format("{}: row {} is outside the history's {} row(s)", call, row, h.rows()));
    }
    hand_out(out, call, [&] { return h.row(row); });
  });
}

kvsnap_status kvsnap_history_contiguous(const kvsnap_history* history, kvsnap_history** out) {
  constexpr const char* call = "kvsnap_history_contiguous";
  return guard(call, [&] {
    const KVHistory& h = require(history, call, "history").history;
    if (h.ragged()) {
      throw InvalidArgument(
          fmt::format("{}: the history is ragged ({} rows of different sequences); take its rows "
                      "(kvsnap_history_row)",
                      call, h.rows()));
    }
    hand_out(out, call, [&] { return h.contiguous(); });
  });
}

kvsnap_status kvsnap_history_arrays(const kvsnap_history* history, kvsnap_kv_history* out) {
  constexpr const char* call = "kvsnap_history_arrays";
  return guard(call, [&] {
    const KVHistory& h = require(history, call, "history").history;
    require(out, call, "out");
    if (h.ragged() || h.paged()) {
      throw InvalidArgument(fmt::format(
          "{}: the history is {}; this call needs a contiguous one (kvsnap_history_contiguous)",
          call, h.ragged() ? "ragged" : "paged"));
    }
    if (h.keys().empty()) {  // no key yet (a sequence never written): no arrays
      *out = {nullptr, nullptr, h.first_position(), h.oldest_column(), h.window()};
      return;
    }
    auto keys = std::make_unique<kvsnap_array>(kvsnap_array{h.keys()});
    auto values = std::make_unique<kvsnap_array>(kvsnap_array{h.values()});
    *out = {keys.release(), values.release(), h.first_position(), h.oldest_column(), h.window()};
  });
}

kvsnap_status kvsnap_history_get_paged(const kvsnap_history* history, kvsnap_paged_info* out) {
  constexpr const char* call = "kvsnap_history_get_paged";
  return guard(call, [&] {
    const PagedColumns& p = paged_of(history, call);
    require(out, call, "out") = {p.block_tokens, p.blocks_per_chunk, p.length,
                                 p.table.data(), p.table.size(),     p.key_chunks.size()};
  });
}

kvsnap_status kvsnap_history_paged_chunk(const kvsnap_history* history, size_t chunk,
                                         kvsnap_array** keys, kvsnap_array** values) {
  constexpr const char* call = "kvsnap_history_paged_chunk";
  return guard(call, [&] {
    const PagedColumns& p = paged_of(history, call);
    require(keys, call, "keys");
    require(values, call, "values");
    if (chunk >= p.key_chunks.size()) {
      throw InvalidArgument(fmt::format("{}: chunk {} is outside the history's {} chunk(s)", call,
                                        chunk, p.key_chunks.size()));
    }
    auto k = std::make_unique<kvsnap_array>(kvsnap_array{p.key_chunks[chunk]});
    auto v = std::make_unique<kvsnap_array>(kvsnap_array{p.value_chunks[chunk]});
    *keys = k.release();
    *values = v.release();
  });
}

void kvsnap_history_destroy(kvsnap_history* history) { delete history; }

kvsnap_status kvsnap_sdpa(const kvsnap_batch* batch, const kvsnap_array* q,
                          const kvsnap_history* history, const kvsnap_attention_mask* mask,
                          float scale, kvsnap_array** out) {
  constexpr const char* call = "kvsnap_sdpa";
  return guard(call, [&] {
    const Batch b = to_batch(batch, call);
    const Array& queries = require(q, call, "q").array;
    const KVHistory& h = require(history, call, "history").history;
    require(out, call, "out");
    const AttentionMask logical = to_mask(mask, call);
    auto handle = std::make_unique<kvsnap_array>();
    handle->array = sdpa(b, queries, h, logical, scale);
    *out = handle.release();
  });
}

kvsnap_status kvsnap_set_threads(int threads) {
  return guard("kvsnap_set_threads", [&] { set_threads(threads); });
}

int kvsnap_threads(void) {
  try {
    return threads();
  } catch (...) {  // out of memory making the pool on first use: none runs, the caller's only
    return 1;
  }
}

}  // extern "C"
