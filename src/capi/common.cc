// The C API's shared pieces: the per-thread last error and the conversions every part uses.
#include <climits>
#include <string>

#include "capi/handles.h"

namespace kvsnap::capi {
namespace {

thread_local std::string last_error;
// Set when the message itself could not be stored (no memory for it).
thread_local const char* last_error_fallback = nullptr;

}  // namespace

kvsnap_status fail(kvsnap_status status, const char* message) noexcept {
  try {
    last_error = message;
    last_error_fallback = nullptr;
  } catch (...) {
    last_error_fallback = "out of memory (while recording an error)";
  }
  return status;
}

kvsnap_status fail_out_of_memory(const char* call) noexcept {
  try {
    last_error = fmt::format("{}: out of memory", call);
    last_error_fallback = nullptr;
  } catch (...) {
    last_error_fallback = "out of memory";
  }
  return KVSNAP_OUT_OF_MEMORY;
}

DType to_dtype(kvsnap_dtype dtype, const char* call) {
  switch (dtype) {
    case KVSNAP_F32:
      return DType::f32;
    case KVSNAP_F16:
      return DType::f16;
    case KVSNAP_BF16:
      return DType::bf16;
    case KVSNAP_I32:
      return DType::i32;
    case KVSNAP_DTYPE_LIMIT:
      break;
  }
  throw InvalidArgument(
      fmt::format("{}: dtype {} is not a kvsnap_dtype", call, static_cast<int>(dtype)));
}

Shape to_shape(int ndim, const int64_t* extents, const char* call, const char* name) {
  if (ndim < 0 || ndim > KVSNAP_MAX_DIMS) {
    throw InvalidArgument(
        fmt::format("{}: ndim {} out of range [0, {}]", call, ndim, KVSNAP_MAX_DIMS));
  }
  if (ndim > 0) require(extents, call, name);
  return ndim > 0 ? Shape(extents, extents + ndim) : Shape();
}

Batch to_batch(const kvsnap_batch* description, const char* call) {
  const kvsnap_batch& b = require(description, call, "batch");
  if (b.batch_size < 0 || b.length < 0) {
    throw InvalidArgument(fmt::format("{}: batch of {} rows and {} columns (need both >= 0)", call,
                                      b.batch_size, b.length));
  }
  if (b.length > INT32_MAX) {  // a row's query length is an int32
    throw InvalidArgument(
        fmt::format("{}: batch of {} columns; at most {}", call, b.length, INT32_MAX));
  }
  const auto rows = static_cast<size_t>(b.batch_size);
  if (rows > 0) require(b.seq_offsets, call, "batch->seq_offsets");
  Batch batch;
  // Without ids, placeholder zeros: one element behind every index (zero strides), so a batch
  // of many columns costs nothing (kvsnap reads ids only from batches that carry them).
  alignas(16) static int32_t zero = 0;
  batch.input_ids = b.input_ids != nullptr
                        ? Array::from_ints({b.input_ids, rows * static_cast<size_t>(b.length)},
                                           {b.batch_size, b.length})
                        : Array::wrap(&zero, DType::i32, {b.batch_size, b.length}, {0, 0});
  batch.seq_offsets.assign(b.seq_offsets, b.seq_offsets + rows);
  if (b.seq_query_lens != nullptr) {
    batch.seq_query_lens.assign(b.seq_query_lens, b.seq_query_lens + rows);
  } else {
    batch.seq_query_lens.assign(rows, static_cast<int32_t>(b.length));
  }
  if (b.seq_ids != nullptr) batch.seq_ids.assign(b.seq_ids, b.seq_ids + rows);
  return batch;
}

kvsnap_array* new_array(Array array) { return new kvsnap_array{std::move(array)}; }

SnapshotPtr adopt(kvsnap_snapshot* handle) noexcept {
  if (handle == nullptr) return nullptr;
  SnapshotPtr snapshot = std::move(handle->snapshot);
  delete handle;
  return snapshot;
}

kvsnap_snapshot* new_snapshot(SnapshotPtr snapshot) {
  if (snapshot == nullptr) return nullptr;
  return new kvsnap_snapshot{std::move(snapshot)};
}

std::vector<Cache*> to_layers(kvsnap_cache* const* layers, size_t count, const char* call) {
  if (count > 0) require_data(layers, call, "layers");
  std::vector<Cache*> caches;
  for (size_t i = 0; i < count; ++i) {
    caches.push_back(layers[i] != nullptr ? layers[i]->cache.get() : nullptr);
  }
  return caches;
}

const char* kind_name(kvsnap_cache_kind kind) {
  switch (kind) {
    case KVSNAP_KV_CACHE:
      return "a KV cache";
    case KVSNAP_ROTATING_KV_CACHE:
      return "a rotating KV cache";
    case KVSNAP_RECURRENT_CACHE:
      return "a recurrent cache";
    case KVSNAP_PAGED_KV_CACHE:
      return "a paged KV cache";
  }
  return "an unknown cache";
}

Attention& attention(const kvsnap_cache* handle, const char* call) {
  const kvsnap_cache& cache = require(handle, call, "cache");
  if (cache.kind == KVSNAP_RECURRENT_CACHE) {
    throw InvalidArgument(fmt::format(
        "{}: the cache is {}; this call needs an attention cache (KV, rotating or paged)", call,
        kind_name(cache.kind)));
  }
  return static_cast<Attention&>(*cache.cache);
}

KVWrite to_kv_write(kvsnap_cache* cache, const kvsnap_batch* batch, const kvsnap_array* keys,
                    const kvsnap_array* values, const char* call) {
  Attention& layer = attention(cache, call);
  Batch b = to_batch(batch, call);
  return {layer, std::move(b), require(keys, call, "keys").array,
          require(values, call, "values").array};
}

}  // namespace kvsnap::capi

extern "C" {

const char* kvsnap_last_error(void) {
  using namespace kvsnap::capi;
  return last_error_fallback != nullptr ? last_error_fallback : last_error.c_str();
}

int64_t kvsnap_live_bytes(void) {
  try {
    return kvsnap::live_bytes();
  } catch (...) {  // out of memory making the allocator on first use: it has allocated nothing
    return 0;
  }
}

}  // extern "C"
