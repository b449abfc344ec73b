#include "cache/snapshot_record.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cache/block_pool.h"
#include "cache/kv_store.h"
#include "cache/state_snapshot.h"
#include "kvsnap/recurrent_cache.h"
#include "kvsnap/rotating_kv_cache.h"

namespace kvsnap::detail {

std::optional<SnapshotRecord> snapshot_record(const Snapshot& snapshot) {
  const StateSnapshot* state = as_state_snapshot(&snapshot);
  if (state == nullptr) return std::nullopt;
  return state->record();
}

SnapshotPtr make_kv_snapshot(Array keys, Array values, int64_t from) {
  const KVLayout layout = KVLayout::of(keys, values);
  const int64_t to = from + keys.dim(2);
  return std::make_unique<KVStateSnapshot>(SnapshotRecord::Kind::kv, layout, std::move(keys),
                                           std::move(values), from, to, 0);
}

SnapshotPtr make_rotating_snapshot(Array keys, Array values, int64_t end, int64_t window) {
  const KVLayout layout = KVLayout::of(keys, values);
  return std::make_unique<KVStateSnapshot>(SnapshotRecord::Kind::rotating, layout, std::move(keys),
                                           std::move(values), end, end, window);
}

SnapshotPtr make_snapshot(SnapshotRecord record, const std::string& context) {
  const Array& a = record.first;
  const Array& b = record.second;
  const auto fail = [&](const std::string& rule) {
    return Error(fmt::format("{}: {} and {}: {}", context, a.describe(), b.describe(), rule));
  };
  const bool floats =
      !a.empty() && !b.empty() && a.dtype() != DType::i32 && b.dtype() != DType::i32;
  switch (record.kind) {
    case SnapshotRecord::Kind::kv:
    case SnapshotRecord::Kind::rotating: {
      if (!floats || a.ndim() != 4 || b.ndim() != 4 || a.dim(0) != b.dim(0) ||
          a.dim(1) != b.dim(1) || a.dim(2) != b.dim(2)) {
        throw fail("keys and values must be float [B, H, T, D] with equal B, H and T");
      }
      if (a.dim(0) < 1 || a.dim(1) < 1 || a.dim(3) < 1 || b.dim(3) < 1) {
        throw fail("B, H, D and Dv must be >= 1");
      }
      if (record.kind == SnapshotRecord::Kind::kv) {
        if (record.from < 0 || a.dim(2) == 0 || record.to < record.from ||
            record.to - record.from != a.dim(2)) {
          throw fail(fmt::format("range [{}, {}) does not hold {} tokens (> 0)", record.from,
                                 record.to, a.dim(2)));
        }
        return make_kv_snapshot(std::move(record.first), std::move(record.second), record.from);
      }
      if (record.window < 1 || record.to < 1 ||
          a.dim(2) != rotating_window_tokens(record.to, record.window)) {
        throw fail(fmt::format(
            "a window of {} ending at offset {} holds {} tokens, not {}", record.window, record.to,
            record.window < 1 || record.to < 1 ? 0
                                               : rotating_window_tokens(record.to, record.window),
            a.dim(2)));
      }
      return make_rotating_snapshot(std::move(record.first), std::move(record.second), record.to,
                                    record.window);
    }
    case SnapshotRecord::Kind::recurrent:
      if (!floats || a.ndim() != 3 || b.ndim() != 4 || b.dtype() != DType::f32 ||
          a.dim(0) != b.dim(0) || record.to <= 0) {
        throw fail(
            fmt::format("need conv [B, W-1, C] (float) and delta f32 [B, Hv, Dv, Dk] at an offset "
                        "> 0 (got {})",
                        record.to));
      }
      return make_recurrent_snapshot(std::move(record.first), std::move(record.second), record.to);
  }
  throw fail("unknown kind");
}

const char* snapshot_kind_name(SnapshotRecord::Kind kind) {
  switch (kind) {
    case SnapshotRecord::Kind::kv:
      return "kv";
    case SnapshotRecord::Kind::rotating:
      return "rotating";
    case SnapshotRecord::Kind::recurrent:
      return "recurrent";
  }
  return "?";
}

std::string describe_layer(const Cache* layer) {
  using Json = nlohmann::json;
  if (layer == nullptr) return Json{{"kind", "none"}}.dump();
  if (auto* r = dynamic_cast<const RotatingKVCache*>(layer)) {
    return Json{{"kind", "rotating"}, {"max_size", r->max_size()}}.dump();
  }
  if (auto* r = dynamic_cast<const RecurrentCache*>(layer)) {
    return Json{{"kind", "recurrent"},       {"conv_tail", r->conv_tail()},
                {"conv_dim", r->conv_dim()}, {"v_heads", r->num_v_heads()},
                {"v_dim", r->head_v_dim()},  {"k_dim", r->head_k_dim()}}
        .dump();
  }
  if (layer->restore_rule().kind == RestoreRule::Kind::ranges) return Json{{"kind", "kv"}}.dump();
  return Json{{"kind", "other"}}.dump();
}

namespace {

std::string layout_signature(const KVLayout& layout) {
  return fmt::format("keys {}[{}, {}, *, {}] values {}[{}, {}, *, {}]",
                     dtype_name(layout.key_dtype), layout.rows, layout.heads, layout.key_depth,
                     dtype_name(layout.value_dtype), layout.rows, layout.heads, layout.value_depth);
}

}  // namespace

std::string held_signature(const Snapshot& snapshot, const Cache* layer) {
  if (const auto* kv = dynamic_cast<const KVStateSnapshot*>(&snapshot)) {
    return layout_signature(kv->layout);
  }
  if (const auto* paged = dynamic_cast<const PagedSnapshot*>(&snapshot)) {
    return layout_signature(paged->pool()->layout);
  }
  const StateSnapshot* state = as_state_snapshot(&snapshot);
  return state == nullptr ? "" : snapshot_signature(state->record(), layer);  // whole states
}

std::string snapshot_signature(const SnapshotRecord& record, const Cache* layer) {
  const auto shape = [](const Array& a, bool tokens_free) {
    std::string out = fmt::format("{}[", dtype_name(a.dtype()));
    for (int axis = 0; axis < a.ndim(); ++axis) {
      out += axis > 0 ? ", " : "";
      out += tokens_free && axis == 2 ? "*" : std::to_string(a.dim(axis));
    }
    return out + "]";
  };
  if (record.kind != SnapshotRecord::Kind::recurrent) {
    return fmt::format("keys {} values {}", shape(record.first, true), shape(record.second, true));
  }
  const auto* r = dynamic_cast<const RecurrentCache*>(layer);
  const int64_t rows = record.first.ndim() > 0 ? record.first.dim(0) : 0;
  if (r != nullptr &&
      (record.first.shape() != Shape{rows, r->conv_tail(), r->conv_dim()} ||
       record.second.shape() != Shape{rows, r->num_v_heads(), r->head_v_dim(), r->head_k_dim()})) {
    return "";  // not this layer's shapes
  }
  return fmt::format("conv {} delta {}", shape(record.first, false), shape(record.second, false));
}

SnapshotPtr join_kv_snapshots(const Snapshot& parent, const Snapshot& child, const char* call,
                              int64_t& copied) {
  const SnapshotRecord first = as_state_snapshot(&parent)->record();
  const SnapshotRecord second = as_state_snapshot(&child)->record();
  const auto layout = KVLayout::of(first.first, first.second);
  const auto other = KVLayout::of(second.first, second.second);
  if (other != layout) {
    throw Error(
        fmt::format("{}: the parent's layout {} differs from the child's {}; a snapshot "
                    "joins one of its own layout",
                    call, layout.describe(), other.describe()));
  }
  const int64_t tokens = child.to() - parent.from();
  auto [keys, values] = layout.allocate_uninitialized(tokens);
  keys.assign_slice(2, 0, first.first);
  keys.assign_slice(2, first.first.dim(2), second.first);
  values.assign_slice(2, 0, first.second);
  values.assign_slice(2, first.second.dim(2), second.second);
  SnapshotPtr joined = make_kv_snapshot(std::move(keys), std::move(values), parent.from());
  copied += tokens * layout.token_bytes();
  return joined;
}

}  // namespace kvsnap::detail
