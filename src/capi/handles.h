// Internal: what the C API's opaque handles hold, and the guard that turns every C++ exception
// into a status code and a per-thread message, so none crosses the C boundary.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvsnap/kvsnap.h"
#include "kvsnap/kvsnap_c.h"
#include "kvsnap/kvsnap_c_tier.h"

struct kvsnap_array {
  kvsnap::Array array;
};
struct kvsnap_cache {
  std::unique_ptr<kvsnap::Cache> cache;
  kvsnap_cache_kind kind;
};
struct kvsnap_snapshot {
  kvsnap::SnapshotPtr snapshot;  // never null: a null snapshot is a NULL handle
};
struct kvsnap_snapshot_list {
  std::vector<kvsnap::SnapshotPtr> snapshots;
};
struct kvsnap_prefix_cache {
  std::unique_ptr<kvsnap::PrefixCache> prefix;
};
struct kvsnap_session {
  kvsnap::PrefixCache::Session session;
};
struct kvsnap_history {
  kvsnap::KVHistory history;
};
struct kvsnap_tier {
  std::shared_ptr<kvsnap::Tier> tier;
  std::string address;  // redacted, for kvsnap_tier_address
};
struct kvsnap_speculation {
  std::unique_ptr<kvsnap::Speculation> speculation;
};

namespace kvsnap::capi {

// Misuse the C API catches itself (a NULL handle, an unknown enum value, the wrong cache kind):
// KVSNAP_INVALID_ARGUMENT, where a kvsnap::Error is KVSNAP_ERROR.
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Records `message` as this thread's last error and returns `status`.
kvsnap_status fail(kvsnap_status status, const char* message) noexcept;
// Records "<call>: out of memory" (just "out of memory" when even that cannot be made) and
// returns KVSNAP_OUT_OF_MEMORY.
kvsnap_status fail_out_of_memory(const char* call) noexcept;

// Runs `body` for the C call `call`, mapping what it throws to a status (the message kept for
// kvsnap_last_error; running out of memory names the call).
template <class Body>
kvsnap_status guard(const char* call, Body&& body) noexcept {
  try {
    body();
    return KVSNAP_OK;
  } catch (const InvalidArgument& error) {
    return fail(KVSNAP_INVALID_ARGUMENT, error.what());
  } catch (const Error& error) {
    return fail(KVSNAP_ERROR, error.what());
  } catch (const std::bad_alloc&) {
    return fail_out_of_memory(call);
  } catch (const std::exception& error) {
    return fail(KVSNAP_INTERNAL_ERROR, error.what());
  } catch (...) {
    return fail(KVSNAP_INTERNAL_ERROR, "unknown exception");
  }
}

// `*pointer`, or InvalidArgument "<call>: <name> is NULL".
template <class T>
T& require(T* pointer, const char* call, const char* name) {
  if (pointer == nullptr) throw InvalidArgument(fmt::format("{}: {} is NULL", call, name));
  return *pointer;
}

// Untyped pointers: InvalidArgument "<call>: <name> is NULL" when null.
inline void require_data(const void* pointer, const char* call, const char* name) {
  if (pointer == nullptr) throw InvalidArgument(fmt::format("{}: {} is NULL", call, name));
}

// The calls that hand out `items` into a caller's buffer of `capacity`: *count is written when
// `fill` succeeds, or when the capacity is too small (the count it needs; InvalidArgument naming
// `call` and `what`); any other failure — a NULL buffer (`buffer` is its name) with room needed,
// out of memory in `fill` — leaves it as it was.
template <class Fill>
void hand_out_counted(size_t items, const void* buffer, size_t capacity, size_t* count,
                      const char* call, const char* what, const char* buffer_name, Fill&& fill) {
  require(count, call, "count");
  if (items > capacity) {
    *count = items;
    throw InvalidArgument(
        fmt::format("{}: capacity {} is less than the {} {}", call, capacity, items, what));
  }
  if (items > 0) require_data(buffer, call, buffer_name);
  fill();
  *count = items;
}

// The C++ dtype of a C one; InvalidArgument for a value outside the enum.
DType to_dtype(kvsnap_dtype dtype, const char* call);
// The batch a C description names (ids copied; NULL ids become zeros).
Batch to_batch(const kvsnap_batch* batch, const char* call);
// `ndim` extents from `extents` (NULL only when ndim is 0); InvalidArgument when ndim is not
// in [0, KVSNAP_MAX_DIMS].
Shape to_shape(int ndim, const int64_t* extents, const char* call, const char* name);
// A new handle for `array`.
kvsnap_array* new_array(Array array);
// Adopts a snapshot handle (freeing it): its snapshot, or null for a NULL handle.
SnapshotPtr adopt(kvsnap_snapshot* handle) noexcept;
// A new handle for `snapshot`, or NULL when it is null.
kvsnap_snapshot* new_snapshot(SnapshotPtr snapshot);
// The kind's name in messages ("a paged KV cache").
const char* kind_name(kvsnap_cache_kind kind);
// The attention layer of a cache handle; InvalidArgument for NULL or a recurrent cache.
Attention& attention(const kvsnap_cache* handle, const char* call);
// A write of keys and values to an attention cache, its arguments checked: call it to write.
struct KVWrite {
  Attention& layer;
  Batch batch;
  const Array& keys;
  const Array& values;
  KVHistory operator()() const { return layer.update(batch, keys, values); }
};
KVWrite to_kv_write(kvsnap_cache* cache, const kvsnap_batch* batch, const kvsnap_array* keys,
                    const kvsnap_array* values, const char* call);
// The caches of `count` layer handles (`layers` NULL only when count is 0; a NULL entry is a
// stateless layer, null in the result).
std::vector<Cache*> to_layers(kvsnap_cache* const* layers, size_t count, const char* call);

}  // namespace kvsnap::capi
