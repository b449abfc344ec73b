#include "tier/object.h"

#include <fmt/format.h>

#include "kvsnap/recurrent_cache.h"
#include "kvsnap/rotating_kv_cache.h"
#include "persist/files.h"
#include "persist/record_tensors.h"
#include "persist/safetensors.h"
#include "tier/hashing.h"
#include "tier/keys.h"

namespace kvsnap::detail {
namespace {

constexpr const char* kObjectFormat = "kvsnap-tier";

const char* kind_name(ObjectSpec::Kind kind) {
  return kind == ObjectSpec::Kind::chunk ? "chunk" : "point";
}

std::string tensor_name(size_t layer, char part) { return fmt::format("layer.{}.{}", layer, part); }

}  // namespace

std::optional<SnapshotRecord::Kind> layer_kind(const Cache* layer) {
  if (layer == nullptr) return std::nullopt;
  if (dynamic_cast<const RotatingKVCache*>(layer) != nullptr) return SnapshotRecord::Kind::rotating;
  if (dynamic_cast<const RecurrentCache*>(layer) != nullptr) return SnapshotRecord::Kind::recurrent;
  return SnapshotRecord::Kind::kv;
}

const char* record_kind_name(SnapshotRecord::Kind kind) {
  switch (kind) {
    case SnapshotRecord::Kind::kv:
      return "KV";
    case SnapshotRecord::Kind::rotating:
      return "sliding-window";
    case SnapshotRecord::Kind::recurrent:
      return "recurrent";
  }
  return "unknown";
}

bool object_holds(const ObjectSpec& spec, const Cache* layer) {
  const std::optional<SnapshotRecord::Kind> kind = layer_kind(layer);
  if (!kind) return false;
  if (*kind == SnapshotRecord::Kind::kv) return spec.from < spec.to;
  return spec.kind == ObjectSpec::Kind::point;
}

std::optional<ObjectPart> object_part(const Snapshot& snapshot) {
  std::optional<RecordToWrite> write = record_to_write(snapshot);  // one record(): may copy
  if (!write) return std::nullopt;
  return ObjectPart{std::move(write->record), write->source};
}

ObjectPart slice_part(const ObjectPart& kv, int64_t from, int64_t to) {
  ObjectPart out = kv;
  out.record.first = kv.record.first.slice(2, from - kv.record.from, to - kv.record.from);
  out.record.second = kv.record.second.slice(2, from - kv.record.from, to - kv.record.from);
  out.record.from = from;
  out.record.to = to;
  out.column = kv.column + from - kv.record.from;
  return out;
}

std::string encode_object(const std::string& key, const std::string& root_hex,
                          const ObjectSpec& spec,
                          const std::vector<std::optional<ObjectPart>>& parts) {
  SafetensorsFile file;
  file.metadata["format"] = kObjectFormat;
  file.metadata["version"] = std::to_string(kTierFormatVersion);
  file.metadata["key"] = key;
  file.metadata["root"] = root_hex;
  file.metadata["kind"] = kind_name(spec.kind);
  file.metadata["from"] = std::to_string(spec.from);
  file.metadata["to"] = std::to_string(spec.to);
  RecordTensors records;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i]) continue;
    records.add(file, tensor_name(i, 'a'), tensor_name(i, 'b'), parts[i]->record, parts[i]->source,
                parts[i]->column);
  }
  return records.encode_sealed(std::move(file));
}

void append_tag(std::string& value, const std::string& key, const std::string& mac_key) {
  const Digest tag = object_mac(mac_key, key, value);
  value.append(reinterpret_cast<const char*>(tag.data()), tag.size());
}

uint64_t max_object_header(const std::string& key, size_t layers) {
  return 4096 + 2 * key.size() + 512 * layers;
}

namespace {

// Throws ObjectRejected unless the metadata says the object is `spec` under `key` and `root_hex`.
void check_header(const std::string& bytes, const SafetensorsFile& file, const std::string& key,
                  const std::string& root_hex, const ObjectSpec& spec) {
  const auto meta = [&](const char* name) -> std::string {
    const auto it = file.metadata.find(name);
    if (it == file.metadata.end()) {
      throw ObjectRejected(fmt::format("metadata \"{}\" is missing", name), false);
    }
    return it->second;
  };
  if (meta("format") != kObjectFormat) {
    throw ObjectRejected(fmt::format("format \"{}\" is not {}", meta("format"), kObjectFormat),
                         false);
  }
  if (meta("version") != std::to_string(kTierFormatVersion)) {
    throw ObjectRejected(fmt::format("version \"{}\" is not the version this build reads ({})",
                                     meta("version"), kTierFormatVersion),
                         false);
  }
  try {
    check_seal(bytes, file, key);
  } catch (const Error& e) {
    throw ObjectRejected(e.what(), false);
  }
  if (meta("root") != root_hex) {
    throw ObjectRejected(
        fmt::format("written for another model, layer layout, tenant or key (root {})",
                    meta("root")),
        false);
  }
  if (meta("key") != key) {
    throw ObjectRejected(fmt::format("written as {}, found under another name", meta("key")),
                         false);
  }
  const std::string expected = fmt::format("{} [{}, {})", kind_name(spec.kind), spec.from, spec.to);
  const std::string found = fmt::format("{} [{}, {})", meta("kind"), meta("from"), meta("to"));
  if (found != expected) {
    throw ObjectRejected(fmt::format("holds {}, not {}", found, expected), false);
  }
}

// Layer i's snapshot from the object's tensors, checked against the layer.
SnapshotPtr layer_snapshot(const SafetensorsFile& file, const std::string& key, size_t i,
                           const Cache* layer, SnapshotRecord::Kind kind, const ObjectSpec& spec) {
  const auto tensor = [&](char part) {
    try {
      return file.at(tensor_name(i, part), key.c_str());
    } catch (const Error& e) {
      throw ObjectRejected(e.what(), false);
    }
  };
  SnapshotRecord record{kind, tensor('a'), tensor('b'), spec.from, spec.to};
  if (kind != SnapshotRecord::Kind::kv) record.from = spec.to;
  if (const auto* window = dynamic_cast<const RotatingKVCache*>(layer)) {
    record.window = window->max_size();
  }
  if (kind == SnapshotRecord::Kind::recurrent && snapshot_signature(record, layer).empty()) {
    throw ObjectRejected(
        fmt::format("layer {}: recurrent state {} / {} does not fit {}", i, record.first.describe(),
                    record.second.describe(), describe_layer(layer)),
        false);
  }
  try {
    return make_snapshot(std::move(record), fmt::format("{} layer {}", key, i));
  } catch (const Error& e) {
    throw ObjectRejected(e.what(), false);
  }
}

}  // namespace

std::vector<SnapshotPtr> decode_object(std::string value, const std::string& key,
                                       const std::string& root_hex, const ObjectSpec& spec,
                                       const std::vector<Cache*>& layers,
                                       const std::string& mac_key) {
  if (!mac_key.empty()) {
    const size_t tag_size = std::tuple_size_v<Digest>;
    if (value.size() < tag_size) {
      throw ObjectRejected(fmt::format("{} bytes cannot hold a MAC tag", value.size()), true);
    }
    const std::string tag = value.substr(value.size() - tag_size);
    value.resize(value.size() - tag_size);
    if (!same_tag(object_mac(mac_key, key, value), tag)) {
      throw ObjectRejected(
          "its MAC does not verify (written without this key, for another key name or tenant, "
          "or altered)",
          true);
    }
  }
  SafetensorsFile file;
  try {
    file = decode_safetensors(value, key, max_object_header(key, layers.size()));
  } catch (const Error& e) {
    throw ObjectRejected(e.what(), false);
  }
  check_header(value, file, key, root_hex, spec);
  std::vector<SnapshotPtr> snapshots(layers.size());
  size_t claimed = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!object_holds(spec, layers[i])) continue;
    snapshots[i] = layer_snapshot(file, key, i, layers[i], *layer_kind(layers[i]), spec);
    claimed += 2;
  }
  if (claimed != file.tensors.size()) {
    throw ObjectRejected(
        fmt::format("{} tensors, {} expected for its layers", file.tensors.size(), claimed), false);
  }
  return snapshots;
}

}  // namespace kvsnap::detail
