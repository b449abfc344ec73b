#include <fmt/format.h>

#include <charconv>
#include <new>
#include <nlohmann/json.hpp>
#include <vector>

#include "cache/snapshot_record.h"
#include "cache/state_snapshot.h"
#include "kvsnap/persistence.h"
#include "persist/files.h"
#include "persist/record_tensors.h"
#include "persist/safetensors.h"

namespace kvsnap {
namespace {

using detail::SnapshotRecord;
using Json = nlohmann::json;

constexpr const char* kSnapshotsFormat = "kvsnap-snapshots";
// Written as a string; files of other versions are refused. 2: the checksum covers every byte
// of the file, rotating snapshots record their window.
constexpr int kVersion = 2;
// Values a layer's metadata entry may hold: its object, a kind and three integers take 5; the
// rest is room for a small forgery to get the message that says what is wrong with it.
constexpr int64_t kMaxLayerValues = 64;
// The largest offset and layer count a file holds.
constexpr int64_t kMaxOffset = int64_t{1} << 40;
constexpr int64_t kMaxLayers = int64_t{1} << 20;

// Metadata value `key` as an integer in [low, high]; throws through `fail`.
template <class Fail>
int64_t integer(const std::map<std::string, std::string>& metadata, const std::string& key,
                int64_t low, int64_t high, const Fail& fail) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) throw fail(fmt::format("metadata \"{}\" is missing", key));
  // Decimal digits after an optional '-', nothing else (std::stoll took " 5" and "+5").
  const std::string& text = it->second;
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error == std::errc() && end == text.data() + text.size() && value >= low && value <= high)
    return value;
  throw fail(fmt::format("metadata \"{}\" = {} is not an integer in [{}, {}]", key,
                         detail::describe_json(Json(text)), low, high));
}

// Why a snapshot of `record` cannot restore a file's `offset` (what restore(s, offset) needs:
// a KV range any offset in [from, to], a window its end, or an earlier offset while it has
// evicted nothing, a recurrent state its own), or empty when it can.
std::string offset_problem(const SnapshotRecord& record, int64_t offset) {
  switch (record.kind) {
    case SnapshotRecord::Kind::kv:
      if (offset >= record.from && offset <= record.to) return "";
      return fmt::format("its KV range [{}, {}) cannot restore offset {}", record.from, record.to,
                         offset);
    case SnapshotRecord::Kind::rotating:
      if (offset == record.to || (offset < record.to && record.to <= record.window)) return "";
      return fmt::format("its window of {} ending at {} cannot restore offset {}", record.window,
                         record.to, offset);
    case SnapshotRecord::Kind::recurrent:
      if (offset == record.to) return "";
      return fmt::format("its recurrent state at {} cannot restore offset {}", record.to, offset);
  }
  return "";
}

}  // namespace

std::string encode_snapshots(int64_t offset, std::span<const Snapshot* const> snapshots) {
  // What a load accepts (decode below), so that nothing is saved that cannot be loaded.
  if (offset < 0 || offset > kMaxOffset) {
    throw Error(fmt::format("save_snapshots: offset {} must be in [0, 2^40]", offset));
  }
  if (snapshots.size() > static_cast<size_t>(kMaxLayers)) {
    throw Error(fmt::format("save_snapshots: {} layers, more than the 2^20 a file holds",
                            snapshots.size()));
  }
  detail::SafetensorsFile file;
  file.metadata["format"] = kSnapshotsFormat;
  file.metadata["version"] = std::to_string(kVersion);
  file.metadata["offset"] = std::to_string(offset);
  file.metadata["layers"] = std::to_string(snapshots.size());
  detail::RecordTensors records;
  for (size_t i = 0; i < snapshots.size(); ++i) {
    const std::string layer = fmt::format("layer.{}", i);
    if (snapshots[i] == nullptr) {
      file.metadata[layer] = Json{{"kind", "none"}}.dump();
      continue;
    }
    const std::optional<detail::RecordToWrite> write = detail::record_to_write(*snapshots[i]);
    const SnapshotRecord* record = write ? &write->record : nullptr;
    if (!record) {
      throw Error(fmt::format(
          "save_snapshots: layer {} holds a snapshot of a kind kvsnap cannot store", i));
    }
    if (const std::string problem = offset_problem(*record, offset); !problem.empty()) {
      throw Error(fmt::format("save_snapshots: layer {}: {}", i, problem));
    }
    switch (record->kind) {
      case SnapshotRecord::Kind::kv:
        file.metadata[layer] =
            Json{{"kind", "kv"}, {"from", record->from}, {"to", record->to}}.dump();
        break;
      case SnapshotRecord::Kind::rotating:
        file.metadata[layer] =
            Json{{"kind", "rotating"}, {"end", record->to}, {"window", record->window}}.dump();
        break;
      case SnapshotRecord::Kind::recurrent:
        file.metadata[layer] = Json{{"kind", "recurrent"}, {"offset", record->to}}.dump();
        break;
    }
    const bool recurrent = record->kind == SnapshotRecord::Kind::recurrent;
    records.add(file, fmt::format("{}.{}", layer, recurrent ? "conv" : "keys"),
                fmt::format("{}.{}", layer, recurrent ? "delta" : "values"), *record,
                write->source);
  }
  try {
    return records.encode_sealed(std::move(file));
  } catch (const detail::HeaderTooLong& e) {
    throw Error(fmt::format("save_snapshots: {}", e.what()));
  }
}

namespace {

LoadedSnapshots decode(const std::string& bytes, const std::string& source) {
  const detail::SafetensorsFile file = detail::decode_safetensors(bytes, source);
  const auto fail = [&](const std::string& what) {
    return Error(fmt::format("{}: {}", source, what));
  };
  const auto meta = [&](const std::string& key) -> const std::string& {
    const auto it = file.metadata.find(key);
    if (it == file.metadata.end()) throw fail(fmt::format("metadata \"{}\" is missing", key));
    return it->second;
  };
  if (const auto why = detail::unknown_format(file.metadata, kSnapshotsFormat,
                                              [&] { detail::check_seal(bytes, file, source); })) {
    throw fail(*why);
  }
  if (meta("version") != std::to_string(kVersion)) {
    throw fail(detail::unknown_version(meta("version"), kVersion,
                                       [&] { detail::check_seal(bytes, file, source); }));
  }
  detail::check_seal(bytes, file, source);
  LoadedSnapshots loaded;
  loaded.offset = integer(file.metadata, "offset", 0, kMaxOffset, fail);
  const int64_t layers = integer(file.metadata, "layers", 0, kMaxLayers, fail);
  size_t claimed = 0;
  const auto tensor = [&](const std::string& name) {
    ++claimed;
    return file.at(name, source.c_str());
  };
  for (int64_t i = 0; i < layers; ++i) {
    const std::string layer = fmt::format("layer.{}", i);
    std::string problem;
    // A kind and at most three integers; more is refused before it is parsed.
    const Json entry = detail::parse_json(meta(layer), kMaxLayerValues, problem);
    if (!problem.empty()) throw fail(fmt::format("metadata \"{}\" {}", layer, problem));
    const auto number = [&](const char* key) {
      if (!entry.contains(key) || !detail::int64_number(entry[key])) {
        throw fail(fmt::format("{} needs an integer \"{}\"", layer, key));
      }
      return entry[key].get<int64_t>();
    };
    const std::string kind =
        entry.is_object() && entry.contains("kind") && entry["kind"].is_string()
            ? entry["kind"].get<std::string>()
            : "";
    SnapshotRecord record;
    if (kind == "none") {
      loaded.snapshots.push_back(nullptr);
      continue;
    } else if (kind == "kv") {
      record = {SnapshotRecord::Kind::kv, tensor(fmt::format("{}.keys", layer)),
                tensor(fmt::format("{}.values", layer)), number("from"), number("to")};
    } else if (kind == "rotating") {
      record = {SnapshotRecord::Kind::rotating,
                tensor(fmt::format("{}.keys", layer)),
                tensor(fmt::format("{}.values", layer)),
                number("end"),
                number("end"),
                number("window")};
    } else if (kind == "recurrent") {
      record = {SnapshotRecord::Kind::recurrent, tensor(fmt::format("{}.conv", layer)),
                tensor(fmt::format("{}.delta", layer)), number("offset"), number("offset")};
    } else {
      throw fail(fmt::format("{} has unknown kind {}", layer, detail::cut_quoted(kind)));
    }
    if (const std::string problem = offset_problem(record, loaded.offset); !problem.empty()) {
      throw fail(fmt::format("{}: {}", layer, problem));
    }
    loaded.snapshots.push_back(
        detail::make_snapshot(std::move(record), fmt::format("{} {}", source, layer)));
  }
  if (claimed != file.tensors.size()) {
    throw fail(fmt::format("{} tensors belong to no layer", file.tensors.size() - claimed));
  }
  return loaded;
}

}  // namespace

LoadedSnapshots decode_snapshots(const std::string& bytes, const std::string& source) {
  try {
    return decode(bytes, source);
  } catch (const std::bad_alloc&) {
    throw Error(fmt::format("{}: out of memory decoding its {} bytes", source, bytes.size()));
  }
}

void save_snapshots(const std::string& path, int64_t offset,
                    std::span<const Snapshot* const> snapshots, const SaveOptions& options) {
  // Before anything else: the cleanup of stale temporaries would take any ".tmp-<pid>..." in the
  // folder for this file's.
  if (detail::names_no_file(path)) {
    throw Error(
        fmt::format("save_snapshots: the path \"{}\" names no file (empty, or a folder)", path));
  }
  detail::check_save_folder(path, "save_snapshots", options.shared);
  detail::write_file_atomically(path, encode_snapshots(offset, snapshots), /*clean_stale=*/true,
                                options.shared ? 0644 : 0600);
}

void save_snapshots(const std::string& path, int64_t offset,
                    const std::vector<SnapshotPtr>& snapshots, const SaveOptions& options) {
  std::vector<const Snapshot*> pointers;
  for (const SnapshotPtr& s : snapshots) pointers.push_back(s.get());
  save_snapshots(path, offset, pointers, options);
}

void save_snapshots(const std::string& path, int64_t offset,
                    std::initializer_list<const Snapshot*> snapshots, const SaveOptions& options) {
  save_snapshots(path, offset,
                 std::span<const Snapshot* const>(snapshots.begin(), snapshots.size()), options);
}

void save_snapshots(const std::string& path, int64_t offset,
                    std::span<const Snapshot* const> snapshots) {
  save_snapshots(path, offset, snapshots, SaveOptions{});
}

void save_snapshots(const std::string& path, int64_t offset,
                    const std::vector<SnapshotPtr>& snapshots) {
  save_snapshots(path, offset, snapshots, SaveOptions{});
}

void save_snapshots(const std::string& path, int64_t offset,
                    std::initializer_list<const Snapshot*> snapshots) {
  save_snapshots(path, offset, snapshots, SaveOptions{});
}

LoadedSnapshots load_snapshots(const std::string& path) { return load_snapshots(path, {}); }

LoadedSnapshots load_snapshots(const std::string& path, const LoadOptions& options) {
  const detail::PrivacyRule rule{.call = "load_snapshots",
                                 .override_with = "set LoadOptions::allow_shared",
                                 .allow_shared = options.allow_shared};
  try {
    const std::string bytes = detail::read_private_file(path, rule);
    // Only now, the folder trusted: one refused is left as it is.
    detail::remove_stale_temporaries_after_load(path, rule);
    return decode_snapshots(bytes, path);
  } catch (const std::bad_alloc&) {
    throw Error(fmt::format("load_snapshots: cannot load {}: out of memory", path));
  }
}

}  // namespace kvsnap
