// The C API for saved state: prefix cache and snapshot file saves and loads, private by default,
// shared with flags (kvsnap_c_files.h).
#include "capi/handles.h"

using namespace kvsnap;
using namespace kvsnap::capi;

namespace {

// Refuses a flag outside `allowed` (InvalidArgument naming the call and the flags).
void require_flags(uint32_t flags, uint32_t allowed, const char* call) {
  if ((flags & ~allowed) == 0) return;
  throw InvalidArgument(fmt::format(
      "{}: flags {:#x} include {:#x}, which this call does not take (it takes {})", call, flags,
      flags & ~allowed, allowed == 0 ? "none" : fmt::format("{:#x}", allowed)));
}

LoadOptions load_options(uint32_t flags, const char* call) {
  require_flags(flags, KVSNAP_LOAD_ALLOW_SHARED, call);
  return {.allow_shared = (flags & KVSNAP_LOAD_ALLOW_SHARED) != 0};
}

kvsnap_status save(const kvsnap_prefix_cache* prefix, const char* dir, const char* model_id,
                   uint32_t flags, const char* call) {
  return guard(call, [&] {
    const PrefixCache& cache = *require(prefix, call, "prefix").prefix;
    require_data(dir, call, "dir");
    require_flags(flags, KVSNAP_SAVE_SHARED, call);
    cache.save(dir, model_id != nullptr ? model_id : "",
               SaveOptions{.shared = (flags & KVSNAP_SAVE_SHARED) != 0});
  });
}

kvsnap_status load(kvsnap_prefix_cache* prefix, const char* dir, const char* model_id,
                   uint32_t flags, const char* call) {
  return guard(call, [&] {
    PrefixCache& cache = *require(prefix, call, "prefix").prefix;
    require_data(dir, call, "dir");
    cache.load(dir, model_id != nullptr ? model_id : "", load_options(flags, call));
  });
}

bool saved_in(const char* dir, uint32_t flags) {
  if (dir == nullptr || (flags & ~uint32_t{KVSNAP_LOAD_ALLOW_SHARED}) != 0) return false;
  try {
    return PrefixCache::saved_in(dir, load_options(flags, "kvsnap_prefix_cache_saved_in"));
  } catch (...) {
    return false;
  }
}

kvsnap_status save_snapshots(const char* path, int64_t offset,
                             const kvsnap_snapshot* const* snapshots, size_t count, uint32_t flags,
                             const char* call) {
  return guard(call, [&] {
    require_data(path, call, "path");
    if (count > 0) require_data(snapshots, call, "snapshots");
    require_flags(flags, KVSNAP_SAVE_SHARED, call);
    std::vector<const Snapshot*> pointers;
    for (size_t i = 0; i < count; ++i) {
      pointers.push_back(snapshots[i] != nullptr ? snapshots[i]->snapshot.get() : nullptr);
    }
    kvsnap::save_snapshots(path, offset, std::span<const Snapshot* const>(pointers),
                           SaveOptions{.shared = (flags & KVSNAP_SAVE_SHARED) != 0});
  });
}

kvsnap_status load_snapshots(const char* path, uint32_t flags, int64_t* offset,
                             kvsnap_snapshot_list** out, const char* call) {
  return guard(call, [&] {
    require_data(path, call, "path");
    require(offset, call, "offset");
    require(out, call, "out");
    const LoadOptions options = load_options(flags, call);
    auto list = std::make_unique<kvsnap_snapshot_list>();
    LoadedSnapshots loaded = kvsnap::load_snapshots(path, options);
    list->snapshots = std::move(loaded.snapshots);
    *offset = loaded.offset;
    *out = list.release();
  });
}

}  // namespace

extern "C" {

kvsnap_status kvsnap_prefix_cache_save(const kvsnap_prefix_cache* prefix, const char* dir,
                                       const char* model_id) {
  return save(prefix, dir, model_id, KVSNAP_FILE_PRIVATE, "kvsnap_prefix_cache_save");
}

kvsnap_status kvsnap_prefix_cache_save_with(const kvsnap_prefix_cache* prefix, const char* dir,
                                            const char* model_id, uint32_t flags) {
  return save(prefix, dir, model_id, flags, "kvsnap_prefix_cache_save_with");
}

kvsnap_status kvsnap_prefix_cache_load(kvsnap_prefix_cache* prefix, const char* dir,
                                       const char* model_id) {
  return load(prefix, dir, model_id, KVSNAP_FILE_PRIVATE, "kvsnap_prefix_cache_load");
}

kvsnap_status kvsnap_prefix_cache_load_with(kvsnap_prefix_cache* prefix, const char* dir,
                                            const char* model_id, uint32_t flags) {
  return load(prefix, dir, model_id, flags, "kvsnap_prefix_cache_load_with");
}

bool kvsnap_prefix_cache_saved_in(const char* dir) { return saved_in(dir, KVSNAP_FILE_PRIVATE); }

bool kvsnap_prefix_cache_saved_in_with(const char* dir, uint32_t flags) {
  return saved_in(dir, flags);
}

kvsnap_status kvsnap_save_snapshots(const char* path, int64_t offset,
                                    const kvsnap_snapshot* const* snapshots, size_t count) {
  return save_snapshots(path, offset, snapshots, count, KVSNAP_FILE_PRIVATE,
                        "kvsnap_save_snapshots");
}

kvsnap_status kvsnap_save_snapshots_with(const char* path, int64_t offset,
                                         const kvsnap_snapshot* const* snapshots, size_t count,
                                         uint32_t flags) {
  return save_snapshots(path, offset, snapshots, count, flags, "kvsnap_save_snapshots_with");
}

kvsnap_status kvsnap_load_snapshots(const char* path, int64_t* offset, kvsnap_snapshot_list** out) {
  return load_snapshots(path, KVSNAP_FILE_PRIVATE, offset, out, "kvsnap_load_snapshots");
}

kvsnap_status kvsnap_load_snapshots_with(const char* path, uint32_t flags, int64_t* offset,
                                         kvsnap_snapshot_list** out) {
  return load_snapshots(path, flags, offset, out, "kvsnap_load_snapshots_with");
}

}  // extern "C"
