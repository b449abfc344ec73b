// TierImpl::store: restore points into objects — KV chunks not yet known to be stored, one
// object per restore point, index entries last (a reader that finds an entry finds its objects:
// one connection writes them in order) — handed to the write-behind.
#include <fmt/format.h>

#include <algorithm>

#include "kvsnap/rotating_kv_cache.h"
#include "tier/object.h"
#include "tier/tier_impl.h"

namespace kvsnap::detail {
void TierImpl::store(std::span<const int32_t> tokens, std::span<const Snapshot* const> ranges,
                     std::span<const TierPoint> points) {
  const CallerTime timed(counters_.caller_microseconds);
  const auto fail = [](const std::string& rule) { return Error("Tier::store: " + rule); };
  if (ranges.size() != layers_.size()) {
    throw fail(fmt::format("{} ranges for {} layers", ranges.size(), layers_.size()));
  }
  int64_t end = 0;
  for (const TierPoint& point : points) {
    if (point.offset < 1 || point.offset > static_cast<int64_t>(tokens.size()) ||
        point.states.size() != layers_.size()) {
      throw fail(
          fmt::format("a point at offset {} with {} states is outside [1, {}] tokens or "
                      "not one state per layer ({})",
                      point.offset, point.states.size(), tokens.size(), layers_.size()));
    }
    end = std::max(end, point.offset);
  }
  if (points.empty()) return;
  std::vector<std::optional<ObjectPart>> kv(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!ranged(i)) continue;
    if (ranges[i] != nullptr) kv[i] = object_part(*ranges[i]);
    const SnapshotRecord* record = kv[i] ? &kv[i]->record : nullptr;
    if (!record || record->kind != SnapshotRecord::Kind::kv || record->from > 0 ||
        record->to < end) {
      throw fail(
          fmt::format("layer {} needs a KV snapshot covering [0, {}){}", i, end,
                      record ? fmt::format(", not [{}, {})", record->from, record->to) : ""));
    }
  }
  // Every snapshot must be of its layer's kind, in the shapes its others have (this process's
  // stores', else the first of this call's; reads teach nothing): a wrong one would be written
  // for every process to reject, and its shapes learned would make this one reject the right ones.
  std::vector<std::string> learned = known_signatures();
  const auto check_fits = [&](size_t i, const SnapshotRecord& record, int64_t offset) {
    const SnapshotRecord::Kind kind = *layer_kind(layers_[i]);
    const std::string shapes = snapshot_signature(record, layers_[i]);
    if (record.kind != kind) {
      throw fail(fmt::format("layer {} at offset {}: a {} snapshot, where the layer takes {} ones",
                             i, offset, record_kind_name(record.kind), record_kind_name(kind)));
    }
    // A window's snapshot holds what a window of its own size keeps: of another size, every
    // reader would find other token counts and reject (and delete) the object.
    const auto* window = dynamic_cast<const RotatingKVCache*>(layers_[i]);
    if (window != nullptr && record.window != window->max_size()) {
      throw fail(fmt::format(
          "layer {} at offset {}: a snapshot of a window of {} tokens, where the layer's is {}", i,
          offset, record.window, window->max_size()));
    }
    if (shapes.empty() || (!learned[i].empty() && shapes != learned[i])) {
      throw fail(fmt::format(
          "layer {} at offset {}: a snapshot of {}, where the layer's have {}", i, offset,
          shapes.empty() ? record.first.describe() + " / " + record.second.describe() : shapes,
          learned[i].empty() ? "the layer's own shapes" : learned[i]));
    }
    if (learned[i].empty()) learned[i] = shapes;  // the call's later points must agree
  };
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (kv[i]) check_fits(i, kv[i]->record, end);
  }
  for (const TierPoint& point : points) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Snapshot* state = point.states[i];
      if (layers_[i] == nullptr || ranged(i)) continue;
      if (state == nullptr || state->to() != point.offset || !snapshot_record(*state)) {
        throw fail(fmt::format("layer {} has no state at offset {}", i, point.offset));
      }
      check_fits(i, *snapshot_record(*state), point.offset);
    }
  }
  std::optional<WriteBatch> batch = encode(tokens, kv, points, end);
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (kv[i]) learn_signature(i, kv[i]->record);
  }
  if (!batch) {
    ++counters_.dropped_batches;  // no room in the write queue: nothing was copied past it
    return;
  }
  if (!batch->empty()) (void)writer_->push(std::move(*batch));
}

template <class Store>
bool TierImpl::guarded(Store&& store) noexcept {
  std::string why;
  try {
    store();
    return true;
  } catch (const std::bad_alloc&) {
    why = "out of memory";
  } catch (const std::exception& e) {
    try {
      why = e.what();
    } catch (...) {
    }
  } catch (...) {  // a custom cache's hook may throw anything
    why = "an exception that is not a std::exception";
  }
  ++counters_.store_errors;
  if (!said_offer_refused_.exchange(true)) {
    try {
      options_.log(
          fmt::format("restore points not written (counted in store_errors; said once): {}", why));
    } catch (...) {
    }
  }
  return false;
}

bool TierImpl::offer(std::span<const int32_t> tokens, std::span<const Snapshot* const> ranges,
                     std::span<const TierPoint> points) noexcept {
  return guarded([&] { store(tokens, ranges, points); });
}

bool TierImpl::offer(std::span<const int32_t> tokens,
                     const std::function<std::vector<SnapshotPtr>()>& take_ranges,
                     std::span<const TierPoint> points) noexcept {
  return guarded([&] {
    const std::vector<SnapshotPtr> owned = take_ranges();
    std::vector<const Snapshot*> ranges(owned.size());
    for (size_t i = 0; i < owned.size(); ++i) ranges[i] = owned[i].get();
    store(tokens, ranges, points);
  });
}

bool TierImpl::too_large(int64_t size) {
  if (size <= options_.max_object_bytes) return false;
  ++counters_.store_errors;
  if (!said_too_large_.exchange(true)) {
    options_.log(fmt::format(
        "objects of {} bytes and more are not written (max_object_bytes {}): lower chunk_tokens "
        "({})",
        size, options_.max_object_bytes, keys_.chunk_tokens()));
  }
  return true;
}

std::optional<WriteBatch> TierImpl::encode(std::span<const int32_t> tokens,
                                           const std::vector<std::optional<ObjectPart>>& kv,
                                           std::span<const TierPoint> points, int64_t end) {
  const int64_t chunk = keys_.chunk_tokens();
  const std::vector<Digest> chain = keys_.chain(tokens, end / chunk);
  WriteBatch batch;
  std::vector<std::optional<ObjectPart>> parts(layers_.size());
  // Each object is copied only when the write queue has room for it and those before it, and
  // written only when the store can take it (max_object_bytes): the data, checked before
  // encoding, and after it the encoded size with the MAC tag the writer appends to it.
  int64_t bytes = 0;
  const int64_t tag = authenticated() ? static_cast<int64_t>(std::tuple_size_v<Digest>) : 0;
  enum class Added { yes, no_room, too_large };
  int64_t stored = 0;  // the size of the last object added, as the store will hold it
  const auto add = [&](const std::string& key, const ObjectSpec& spec) {
    int64_t data = 0;
    for (const std::optional<ObjectPart>& part : parts) {
      if (part) data += part->record.first.nbytes() + part->record.second.nbytes();
    }
    if (too_large(data)) return Added::too_large;
    if (!writer_->has_room(bytes + data)) return Added::no_room;
    std::string value = encode_object(key, keys_.root_hex(), spec, parts);
    if (too_large(static_cast<int64_t>(value.size()) + tag)) return Added::too_large;
    bytes += data;  // only what goes: a refused object takes no room from the next
    stored = static_cast<int64_t>(value.size()) + tag;
    batch.objects.emplace_back(key, std::move(value));
    return Added::yes;
  };
  const bool any_kv = std::ranges::any_of(kv, [](const auto& r) { return r.has_value(); });
  for (int64_t j = 0; any_kv && j < end / chunk; ++j) {
    const std::string key = TierKeys::chunk_key(chain[static_cast<size_t>(j + 1)]);
    if (known_.contains(key)) {
      batch.known.push_back(key);
      continue;
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      parts[i] =
          kv[i] ? std::optional(slice_part(*kv[i], j * chunk, (j + 1) * chunk)) : std::nullopt;
    }
    const Added added = add(key, {ObjectSpec::Kind::chunk, j * chunk, (j + 1) * chunk});
    if (added == Added::no_room) return std::nullopt;
    if (added == Added::too_large) return batch;  // what came before it; its points need it
  }
  for (const TierPoint& point : points) {
    const int64_t base = point.offset / chunk;
    const Digest& digest = chain[static_cast<size_t>(base)];
    const std::string key =
        TierKeys::point_key(digest, point.offset,
                            tokens.subspan(static_cast<size_t>(base * chunk),
                                           static_cast<size_t>(point.offset - base * chunk)));
    if (known_.contains(key)) {
      batch.known.push_back(key);
      // Its size is not known here (nothing was encoded): any member of this offset will do.
      batch.known_index.emplace_back(TierKeys::index_key(digest), point.offset);
      continue;
    }
    const ObjectSpec spec{ObjectSpec::Kind::point, base * chunk, point.offset};
    for (size_t i = 0; i < layers_.size(); ++i) {
      parts[i].reset();
      if (!object_holds(spec, layers_[i])) continue;
      if (kv[i]) {
        parts[i] = slice_part(*kv[i], spec.from, spec.to);
        continue;
      }
      parts[i] = object_part(*point.states[i]);  // a built-in kind: checked by store()
      learn_signature(i, parts[i]->record);
    }
    const Added added = add(key, spec);
    if (added == Added::no_room) return std::nullopt;
    if (added == Added::too_large) continue;
    batch.index.emplace_back(TierKeys::index_key(digest),
                             TierKeys::index_member(point.offset, stored));
  }
  return batch;
}

}  // namespace kvsnap::detail
