// Internal interface for the C API: a PagedKVCache's lock, held across a call and the copy of
// the paged history it returned, so the copy shows the cache as the call left it (another
// thread's write of the same sequence, in place in an unshared block, waits for the copy).
#pragma once

#include <mutex>

#include "kvsnap/paged_kv_cache.h"

namespace kvsnap::detail {

struct PagedCacheAccess {
  // The lock every call of `cache` takes (recursive: the call takes it again inside).
  static std::recursive_mutex& lock(const PagedKVCache& cache);
};

}  // namespace kvsnap::detail
