// The C API for snapshots: capture (at once or scheduled), restore, merge, split, lists of
// snapshots, and snapshot files.
#include "capi/handles.h"

using namespace kvsnap;
using namespace kvsnap::capi;

namespace {

Cache& layer(const kvsnap_cache* cache, const char* call) {
  return *require(cache, call, "cache").cache;
}

// Hands `snapshots` out as a new list; the list is made before `take` runs, so a failure to
// allocate it loses no snapshot.
kvsnap_status take_into(kvsnap_snapshot_list** out, const char* call,
                        const std::function<std::vector<SnapshotPtr>()>& take) {
  return guard(call, [&] {
    require(out, call, "out");
    auto list = std::make_unique<kvsnap_snapshot_list>();
    list->snapshots = take();
    *out = list.release();
  });
}

}  // namespace

extern "C" {

kvsnap_status kvsnap_cache_snapshot(kvsnap_cache* cache, int64_t from_offset,
                                    kvsnap_snapshot** out) {
  constexpr const char* call = "kvsnap_cache_snapshot";
  return guard(call, [&] {
    Cache& c = layer(cache, call);
    require(out, call, "out");
    auto handle = std::make_unique<kvsnap_snapshot>();
    handle->snapshot = c.snapshot(from_offset);
    *out = handle->snapshot != nullptr ? handle.release() : nullptr;
  });
}

kvsnap_status kvsnap_cache_prepare_snapshots(kvsnap_cache* cache, const int64_t* offsets,
                                             size_t count) {
  constexpr const char* call = "kvsnap_cache_prepare_snapshots";
  return guard(call, [&] {
    Cache& c = layer(cache, call);
    if (count > 0) require_data(offsets, call, "offsets");
    c.prepare_snapshots({offsets, count});
  });
}

kvsnap_status kvsnap_cache_take_snapshots(kvsnap_cache* cache, kvsnap_snapshot_list** out) {
  constexpr const char* call = "kvsnap_cache_take_snapshots";
  return take_into(out, call, [&] { return layer(cache, call).take_snapshots(); });
}

kvsnap_status kvsnap_cache_take_reached_snapshots(kvsnap_cache* cache, kvsnap_snapshot_list** out) {
  constexpr const char* call = "kvsnap_cache_take_reached_snapshots";
  return take_into(out, call, [&] { return layer(cache, call).take_reached_snapshots(); });
}

kvsnap_status kvsnap_cache_cancel_snapshots(kvsnap_cache* cache) {
  return guard("kvsnap_cache_cancel_snapshots",
               [&] { layer(cache, "kvsnap_cache_cancel_snapshots").cancel_snapshots(); });
}

kvsnap_status kvsnap_cache_restore(kvsnap_cache* cache, kvsnap_snapshot* snapshot, int64_t target,
                                   bool* restored) {
  constexpr const char* call = "kvsnap_cache_restore";
  return guard(call, [&] {
    Cache& c = layer(cache, call);
    bool& result = require(restored, call, "restored");
    result = c.restore(snapshot != nullptr ? snapshot->snapshot.get() : nullptr, target);
  });
}

kvsnap_status kvsnap_cache_offset_seq(const kvsnap_cache* cache, int32_t seq, int64_t* out) {
  constexpr const char* call = "kvsnap_cache_offset_seq";
  return guard(call, [&] { require(out, call, "out") = layer(cache, call).offset(seq); });
}

kvsnap_status kvsnap_cache_exposed_bytes_seq(const kvsnap_cache* cache, int32_t seq, int64_t* out) {
  constexpr const char* call = "kvsnap_cache_exposed_bytes_seq";
  return guard(call, [&] { require(out, call, "out") = layer(cache, call).exposed_bytes(seq); });
}

kvsnap_status kvsnap_cache_sequences(const kvsnap_cache* cache, int32_t* seqs, size_t capacity,
                                     size_t* count) {
  constexpr const char* call = "kvsnap_cache_sequences";
  return guard(call, [&] {
    const std::vector<SeqId> held = layer(cache, call).sequences();
    hand_out_counted(held.size(), seqs, capacity, count, call, "sequences", "seqs",
                     [&] { std::copy(held.begin(), held.end(), seqs); });
  });
}

kvsnap_status kvsnap_cache_reset_seq(kvsnap_cache* cache, int32_t seq) {
  return guard("kvsnap_cache_reset_seq",
               [&] { layer(cache, "kvsnap_cache_reset_seq").reset(seq); });
}

kvsnap_status kvsnap_cache_snapshot_seq(kvsnap_cache* cache, int32_t seq, int64_t from_offset,
                                        kvsnap_snapshot** out) {
  constexpr const char* call = "kvsnap_cache_snapshot_seq";
  return guard(call, [&] {
    Cache& c = layer(cache, call);
    require(out, call, "out");
    auto handle = std::make_unique<kvsnap_snapshot>();
    handle->snapshot = c.snapshot(seq, from_offset);
    *out = handle->snapshot != nullptr ? handle.release() : nullptr;
  });
}

kvsnap_status kvsnap_cache_prepare_snapshots_seq(kvsnap_cache* cache, int32_t seq,
                                                 const int64_t* offsets, size_t count) {
  constexpr const char* call = "kvsnap_cache_prepare_snapshots_seq";
  return guard(call, [&] {
    Cache& c = layer(cache, call);
    if (count > 0) require_data(offsets, call, "offsets");
    c.prepare_snapshots(seq, {offsets, count});
  });
}

kvsnap_status kvsnap_cache_take_snapshots_seq(kvsnap_cache* cache, int32_t seq,
                                              kvsnap_snapshot_list** out) {
  constexpr const char* call = "kvsnap_cache_take_snapshots_seq";
  return take_into(out, call, [&] { return layer(cache, call).take_snapshots(seq); });
}

kvsnap_status kvsnap_cache_take_reached_snapshots_seq(kvsnap_cache* cache, int32_t seq,
                                                      kvsnap_snapshot_list** out) {
  constexpr const char* call = "kvsnap_cache_take_reached_snapshots_seq";
  return take_into(out, call, [&] { return layer(cache, call).take_reached_snapshots(seq); });
}

kvsnap_status kvsnap_cache_cancel_snapshots_seq(kvsnap_cache* cache, int32_t seq) {
  return guard("kvsnap_cache_cancel_snapshots_seq",
               [&] { layer(cache, "kvsnap_cache_cancel_snapshots_seq").cancel_snapshots(seq); });
}

kvsnap_status kvsnap_cache_restore_seq(kvsnap_cache* cache, int32_t seq, kvsnap_snapshot* snapshot,
                                       int64_t target, bool* restored) {
  constexpr const char* call = "kvsnap_cache_restore_seq";
  return guard(call, [&] {
    Cache& c = layer(cache, call);
    bool& result = require(restored, call, "restored");
    result = c.restore(seq, snapshot != nullptr ? snapshot->snapshot.get() : nullptr, target);
  });
}

kvsnap_status kvsnap_cache_merge(kvsnap_cache* cache, kvsnap_snapshot* parent,
                                 kvsnap_snapshot* child, kvsnap_snapshot** out) {
  constexpr const char* call = "kvsnap_cache_merge";
  const bool same = parent != nullptr && parent == child;
  SnapshotPtr before = adopt(parent);  // consumed whatever happens next (once when the same)
  SnapshotPtr after = same ? nullptr : adopt(child);
  return guard(call, [&] {
    if (same) {
      throw InvalidArgument(
          fmt::format("{}: parent and child are the same snapshot (a merge joins two adjacent "
                      "ones); it is consumed",
                      call));
    }
    Cache& c = layer(cache, call);
    require(out, call, "out");
    auto handle = std::make_unique<kvsnap_snapshot>();
    handle->snapshot = c.merge(std::move(before), std::move(after));
    *out = handle->snapshot != nullptr ? handle.release() : nullptr;
  });
}

kvsnap_status kvsnap_cache_split(kvsnap_cache* cache, kvsnap_snapshot* snapshot, int64_t at,
                                 kvsnap_snapshot** before, kvsnap_snapshot** after) {
  constexpr const char* call = "kvsnap_cache_split";
  SnapshotPtr whole = adopt(snapshot);  // consumed whatever happens next
  return guard(call, [&] {
    Cache& c = layer(cache, call);
    require(before, call, "before");
    require(after, call, "after");
    if (before == after) {
      throw InvalidArgument(
          fmt::format("{}: before and after are the same pointer (each part needs its own)", call));
    }
    auto first = std::make_unique<kvsnap_snapshot>();
    auto second = std::make_unique<kvsnap_snapshot>();
    std::tie(first->snapshot, second->snapshot) = c.split(std::move(whole), at);
    *before = first->snapshot != nullptr ? first.release() : nullptr;
    *after = second->snapshot != nullptr ? second.release() : nullptr;
  });
}

kvsnap_status kvsnap_snapshot_get_info(const kvsnap_snapshot* snapshot, kvsnap_snapshot_info* out) {
  constexpr const char* call = "kvsnap_snapshot_get_info";
  return guard(call, [&] {
    const Snapshot& s = *require(snapshot, call, "snapshot").snapshot;
    require(out, call, "out") = {s.from(), s.to(), s.size(), s.is_lazy()};
  });
}

void kvsnap_snapshot_destroy(kvsnap_snapshot* snapshot) { delete snapshot; }

size_t kvsnap_snapshot_list_size(const kvsnap_snapshot_list* list) {
  return list != nullptr ? list->snapshots.size() : 0;
}

kvsnap_status kvsnap_snapshot_list_take(kvsnap_snapshot_list* list, size_t index,
                                        kvsnap_snapshot** out) {
  constexpr const char* call = "kvsnap_snapshot_list_take";
  return guard(call, [&] {
    std::vector<SnapshotPtr>& entries = require(list, call, "list").snapshots;
    require(out, call, "out");
    if (index >= entries.size()) {
      throw InvalidArgument(
          fmt::format("{}: index {} out of range (the list has {})", call, index, entries.size()));
    }
    auto handle = std::make_unique<kvsnap_snapshot>();
    handle->snapshot = std::move(entries[index]);
    *out = handle->snapshot != nullptr ? handle.release() : nullptr;
  });
}

void kvsnap_snapshot_list_destroy(kvsnap_snapshot_list* list) { delete list; }

}  // extern "C"
