#include "prefix/trie_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "cache/snapshot_record.h"
#include "cache/state_snapshot.h"
#include "persist/files.h"
#include "persist/record_tensors.h"
#include "persist/safetensors.h"
#include "prefix/load_plan.h"

namespace kvsnap::detail {
namespace {

using Json = nlohmann::json;
constexpr const char* kFormat = "kvsnap-prefix-cache";
// Written as a string; files of other versions are refused. 2: the checksum covers every byte
// of the file.
constexpr int kVersion = 2;
// Values a forged "layers" or a node of "nodes" may hold beyond what they take, so that a small
// forgery still gets the message that says what is wrong with it.
constexpr int64_t kSpareValues = 64;

// What a layer is, as recorded in the file and compared on load.
Json describe(const LayerInfo& layer) { return Json::parse(describe_layer(layer.cache)); }

std::string signature(const SnapshotRecord& record, const LayerInfo& layer) {
  return snapshot_signature(record, layer.cache);
}

// `id` as text: each byte that is not part of well-formed UTF-8 written as \xNN.
std::string readable(std::string_view id) {
  std::string out;
  for (size_t at = 0; at < id.size();) {
    const size_t length = utf8_length(id, at);
    out += length == 0 ? fmt::format("\\x{:02X}", static_cast<unsigned char>(id[at]))
                       : std::string(id.substr(at, length));
    at += std::max<size_t>(length, 1);
  }
  return out;
}

std::string hex(std::string_view bytes) {
  std::string out;
  for (const char c : bytes) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return out;
}

// A model_id is any bytes (a file path, say), JSON text only UTF-8: an id that is not is kept in
// "model_hex" (and "model" shows it readably), so a load compares exactly the bytes saved.
void record_model(SafetensorsFile& file, const std::string& model_id) {
  file.metadata["model"] = readable(model_id);
  if (file.metadata["model"] != model_id) file.metadata["model_hex"] = hex(model_id);
}
// The model id a file was saved for, as the bytes saved: "model_hex" decoded when it holds one
// (else "model"; "" without either).
std::string saved_model(const SafetensorsFile& file) {
  const auto bytes = file.metadata.find("model_hex");
  if (bytes != file.metadata.end() && bytes->second.size() % 2 == 0 &&
      bytes->second.find_first_not_of("0123456789abcdef") == std::string::npos) {
    std::string out;
    for (size_t at = 0; at < bytes->second.size(); at += 2) {
      out += static_cast<char>(std::stoi(bytes->second.substr(at, 2), nullptr, 16));
    }
    return out;
  }
  const auto text = file.metadata.find("model");
  return text != file.metadata.end() ? text->second : "";
}

bool same_model(const SafetensorsFile& file, const std::string& model_id) {
  const auto bytes = file.metadata.find("model_hex");
  if (bytes != file.metadata.end()) return bytes->second == hex(model_id);
  const auto text = file.metadata.find("model");
  return text != file.metadata.end() && text->second == model_id;
}

}  // namespace

std::string encode_trie(const Trie& trie, const std::string& model_id) {
  SafetensorsFile file;
  file.tensors.emplace_back("edges", Array());  // filled in once every node is read
  RecordTensors records;
  Json layers = Json::array();
  for (const LayerInfo& layer : trie.layers()) layers.push_back(describe(layer));
  std::vector<const Node*> nodes;
  trie.preorder(nodes);
  std::map<const Node*, int64_t> index;
  std::vector<int32_t> edges;
  Json entries = Json::array();
  for (const Node* node : nodes) {
    // A node without one of its KV ranges (a gap, trie.h) cannot be restored through, nor can
    // anything below it: left out, as a loader would refuse it.
    const bool below_gap = node->parent->parent != nullptr && !index.contains(node->parent);
    if (below_gap || trie.lacks_range(*node)) continue;
    const auto id = static_cast<int64_t>(index.size());
    index[node] = id;
    Json snapshots = Json::array();
    for (size_t i = 0; i < node->snapshots.size(); ++i) {
      const SnapshotPtr& s = node->snapshots[i];
      if (s == nullptr) {
        snapshots.push_back(nullptr);
        continue;
      }
      if (layers[i]["kind"] == "other") {  // a load could not give it back to that layer
        throw Error(fmt::format(
            "PrefixCache::save: layer {} is a cache kind kvsnap does not know ({}): its "
            "snapshots cannot be restored from a file, so the trie cannot be saved",
            i, layers[i].dump()));
      }
      const std::optional<RecordToWrite> write = record_to_write(*s);
      if (!write) {
        throw Error(fmt::format(
            "PrefixCache::save: layer {} holds a snapshot of a kind kvsnap cannot store", i));
      }
      const SnapshotRecord* record = &write->record;
      const std::string prefix = fmt::format("node.{}.layer.{}", id, i);
      records.add(file, fmt::format("{}.a", prefix), fmt::format("{}.b", prefix), *record,
                  write->source);
      snapshots.push_back(
          {{"kind", snapshot_kind_name(record->kind)}, {"from", record->from}, {"to", record->to}});
    }
    entries.push_back({{"parent", node->parent->parent == nullptr ? -1 : index.at(node->parent)},
                       {"length", node->edge.size()},
                       {"user", node->user},
                       {"used", node->last_used},
                       {"snapshots", snapshots}});
    edges.insert(edges.end(), node->edge.begin(), node->edge.end());
  }
  file.tensors.front().second = Array::from_ints(edges, {static_cast<int64_t>(edges.size())});
  file.metadata["format"] = kFormat;
  file.metadata["version"] = std::to_string(kVersion);
  record_model(file, model_id);
  file.metadata["layers"] = layers.dump();
  file.metadata["nodes"] = entries.dump();
  file.metadata["clock"] = std::to_string(trie.clock());
  return records.encode_sealed(std::move(file));
}

namespace {

// Reads a trie file's nodes in order, checking each against the layers and the nodes before it.
class TrieDecoder {
 public:
  TrieDecoder(const SafetensorsFile& file, const std::string& source,
              const std::vector<LayerInfo>& layers, std::vector<std::string> serving)
      : file_(file), source_(source), layers_(layers), serving_(std::move(serving)) {}

  Error fail(const std::string& what) const { return Error(fmt::format("{}: {}", source_, what)); }
  const std::string& meta(const char* key) const {
    const auto it = file_.metadata.find(key);
    if (it == file_.metadata.end()) throw fail(fmt::format("metadata \"{}\" is missing", key));
    return it->second;
  }

  // Format, version, checksum (unless `sealed` is null: not read yet), model and the layers'
  // configuration.
  void check_header(const SealedFile* sealed, const std::string& model_id) const {
    const auto seal = [&] { check_seal(*sealed, source_); };
    const std::function<void()> check = sealed != nullptr ? std::function<void()>(seal) : nullptr;
    if (const auto why = unknown_format(file_.metadata, kFormat, check)) throw fail(*why);
    if (meta("version") != std::to_string(kVersion)) {
      throw fail(unknown_version(meta("version"), kVersion, check));
    }
    if (sealed != nullptr) check_seal(*sealed, source_);
    if (!same_model(file_, model_id)) {
      (void)meta("model");  // a file without one is refused saying so
      const std::string saved = saved_model(file_);
      const std::string shown_saved = cut_quoted(readable(saved));
      const std::string shown_ours = cut_quoted(readable(model_id));
      std::string why =
          fmt::format("it was saved for model {}, this cache serves {}", shown_saved, shown_ours);
      if (shown_saved == shown_ours) {  // the beginnings shown are the same: where the bytes part
        const size_t at = static_cast<size_t>(
            std::mismatch(saved.begin(), saved.end(), model_id.begin(), model_id.end()).first -
            saved.begin());
        why += fmt::format(" (they first differ at byte {}: {} in the file, {} here)", at,
                           cut_quoted(readable(saved.substr(at))),
                           cut_quoted(readable(model_id.substr(at))));
      }
      throw fail(why);
    }
    // Each layer's description: an object of its kind and at most six numbers.
    const Json saved = parse("layers", 1 + 8 * static_cast<int64_t>(layers_.size()) + kSpareValues);
    if (!saved.is_array() || saved.size() != layers_.size()) {
      throw fail(fmt::format("it holds {} layers, this cache has {}",
                             saved.is_array() ? saved.size() : 0, layers_.size()));
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (saved[i] != describe(layers_[i])) {
        throw fail(fmt::format("layer {} is {} in the file but {} here", i, describe_json(saved[i]),
                               describe(layers_[i]).dump()));
      }
    }
  }

  LoadedTrie nodes() {
    const Array& edges = file_.at("edges", source_.c_str());
    if (edges.dtype() != DType::i32 || edges.ndim() != 1)
      throw fail("\"edges\" must be a 1-d I32 tensor");
    tokens_ = edges.to_ints();
    LoadedTrie loaded;
    loaded.clock = clock_ = clock();
    // Node by node, each parsed alone (never the whole list as JSON values, which cost several
    // times its length): its object, parent, length, user, used and snapshots, and per layer a
    // null or an object of kind, from and to.
    const int64_t per_node = 6 + 4 * static_cast<int64_t>(layers_.size()) + kSpareValues;
    std::string problem;
    const bool read = for_each_element(
        meta("nodes"), per_node,
        [&](const Json& entry) { loaded.nodes.push_back(node(loaded.nodes.size(), entry)); },
        problem);
    if (problem == kNotAnArray) throw fail("\"nodes\" must be an array");
    if (!read) throw fail(fmt::format("metadata \"nodes\" {}", problem));
    if (position_ != tokens_.size())
      throw fail(fmt::format("{} edge tokens belong to no node", tokens_.size() - position_));
    if (claimed_ != file_.tensors.size())
      throw fail(fmt::format("{} tensors belong to no node", file_.tensors.size() - claimed_));
    return loaded;
  }

 private:
  // The last-use clock: decimal digits only, at most 18 of them (below 10^18, so that no tick
  // from it can overflow).
  int64_t clock() const {
    const std::string& text = meta("clock");
    if (text.empty() || text.size() > 18 ||
        !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      throw fail(fmt::format("\"clock\" {} is not a decimal integer of at most 18 digits",
                             describe_json(Json(text))));
    }
    return std::stoll(text);
  }

  // Metadata `key` parsed, refused before parsing when it holds more than `max_values` values
  // (parse_json): what the file's layers and nodes take bounds it, not its length.
  Json parse(const char* key, int64_t max_values) const {
    std::string problem;
    Json value = parse_json(meta(key), max_values, problem);
    if (!problem.empty()) throw fail(fmt::format("metadata \"{}\" {}", key, problem));
    return value;
  }

  LoadedNode node(size_t n, const Json& e) {
    const auto field = [&](const char* key) -> const Json& {
      if (!e.is_object() || !e.contains(key))
        throw fail(fmt::format("node {} lacks \"{}\"", n, key));
      return e[key];
    };
    if (!int64_number(field("parent")) || !field("length").is_number_unsigned() ||
        !field("user").is_boolean() || !int64_number(field("used")) ||
        !field("snapshots").is_array()) {
      throw fail(fmt::format("node {} has fields of the wrong type", n));
    }
    LoadedNode node;
    node.parent = field("parent").get<int64_t>();
    const auto length = field("length").get<uint64_t>();
    if (node.parent < -1 || node.parent >= static_cast<int64_t>(n)) {
      throw fail(fmt::format("node {} names parent {}, not an earlier node", n, node.parent));
    }
    if (length == 0 || length > tokens_.size() - position_) {
      throw fail(fmt::format("node {} has an edge of {} tokens ({} left in \"edges\")", n, length,
                             tokens_.size() - position_));
    }
    node.edge.assign(tokens_.begin() + static_cast<std::ptrdiff_t>(position_),
                     tokens_.begin() + static_cast<std::ptrdiff_t>(position_ + length));
    position_ += length;
    if (!first_tokens_.emplace(std::pair{node.parent, node.edge.front()}, n).second) {
      throw fail(
          fmt::format("node {} shares its first token {} with a sibling", n, node.edge.front()));
    }
    const int64_t start = node.parent < 0 ? 0 : ends_[static_cast<size_t>(node.parent)];
    ends_.push_back(start + static_cast<int64_t>(length));
    node.user = field("user").get<bool>();
    node.last_used = field("used").get<int64_t>();
    if (node.last_used < 0 || node.last_used > clock_) {
      throw fail(fmt::format("node {} was \"used\" at {}, outside [0, {}] (the \"clock\")", n,
                             node.last_used, clock_));
    }
    const Json& snapshots = field("snapshots");
    if (snapshots.size() != layers_.size())
      throw fail(fmt::format("node {} has {} snapshot slots", n, snapshots.size()));
    for (size_t i = 0; i < layers_.size(); ++i) {
      node.snapshots.push_back(layer_snapshot(n, i, snapshots[i], start, ends_.back()));
    }
    return node;
  }

  // Layer i's snapshot of node n, which spans [start, end), or null: a stateless layer has none,
  // a KV layer's spans every node's edge (a restore through the node needs it), a whole-state
  // layer's is a restore point, which a node may lack.
  SnapshotPtr layer_snapshot(size_t n, size_t i, const Json& s, int64_t start, int64_t end) {
    if (layers_[i].cache == nullptr && !s.is_null()) {
      throw fail(fmt::format("node {} layer {}: a snapshot on a stateless layer", n, i));
    }
    if (layers_[i].ranged() && s.is_null()) {
      throw fail(fmt::format(
          "node {} [{}, {}) layer {}: no KV snapshot (a KV layer's spans every node's edge)", n,
          start, end, i));
    }
    return s.is_null() ? nullptr : snapshot(n, i, s, start, end);
  }

  // Layer i's snapshot of node n, which spans [start, end).
  SnapshotPtr snapshot(size_t n, size_t i, const Json& s, int64_t start, int64_t end) {
    const std::string expected =
        layers_[i].cache == nullptr ? "none" : describe(layers_[i])["kind"].get<std::string>();
    if (expected == "other") {  // no snapshot kvsnap builds is that cache's own (save refuses)
      throw fail(fmt::format(
          "node {} layer {}: a snapshot on a layer of a cache kind kvsnap does not know", n, i));
    }
    if (!s.is_object() || !s.contains("kind") || s["kind"] != expected || !s.contains("from") ||
        !s.contains("to") || !int64_number(s["from"]) || !int64_number(s["to"])) {
      throw fail(fmt::format("node {} layer {}: snapshot {} does not fit a {} layer", n, i,
                             describe_json(s), expected));
    }
    const int64_t from = s["from"].get<int64_t>(), to = s["to"].get<int64_t>();
    const bool ranged = expected == "kv";
    if (ranged ? (from != start || to != end) : (from != end || to != end)) {
      throw fail(
          fmt::format("node {} [{}, {}) layer {}: snapshot range [{}, {}) does not match the node",
                      n, start, end, i, from, to));
    }
    const std::string prefix = fmt::format("node.{}.layer.{}", n, i);
    SnapshotRecord record{
        ranged                   ? SnapshotRecord::Kind::kv
        : expected == "rotating" ? SnapshotRecord::Kind::rotating
                                 : SnapshotRecord::Kind::recurrent,
        file_.at(fmt::format("{}.a", prefix), source_.c_str()),
        file_.at(fmt::format("{}.b", prefix), source_.c_str()),
        from,
        to,
        expected == "rotating" ? describe(layers_[i])["max_size"].get<int64_t>() : 0};
    claimed_ += 2;
    // Every snapshot of a layer must fit one cache: the same batch size, heads, depths and
    // dtypes (a recurrent layer's also its configured shapes).
    const std::string shapes = signature(record, layers_[i]);
    if (shapes.empty()) {
      throw fail(fmt::format(
          "node {} layer {}: recurrent snapshot {} / {} does not have the layer's shapes {}", n, i,
          record.first.describe(), record.second.describe(), describe(layers_[i]).dump()));
    }
    if (i < serving_.size() && !serving_[i].empty() && serving_[i] != shapes) {
      throw fail(fmt::format(
          "node {} layer {}: snapshot {} does not fit what this cache's trie holds for the layer "
          "({}): saved from caches of another dtype, head count or depth",
          n, i, shapes, serving_[i]));
    }
    auto [first, inserted] = layer_shapes_.emplace(i, shapes);
    if (!inserted && first->second != shapes) {
      throw fail(
          fmt::format("node {} layer {}: snapshot {} does not fit the layer's other snapshots ({})",
                      n, i, shapes, first->second));
    }
    return make_snapshot(std::move(record), fmt::format("{} {}", source_, prefix));
  }

  const SafetensorsFile& file_;
  const std::string& source_;
  const std::vector<LayerInfo>& layers_;
  std::vector<int32_t> tokens_;  // every edge, in node order
  int64_t clock_ = 0;            // the file's last-use clock
  size_t position_ = 0;          // edge tokens claimed so far
  size_t claimed_ = 1;           // tensors claimed so far ("edges")
  std::vector<int64_t> ends_;    // per node read: the offset its edge ends at
  std::map<std::pair<int64_t, int32_t>, size_t> first_tokens_;  // (parent, first token) -> node
  std::map<size_t, std::string> layer_shapes_;  // layer -> signature of its first snapshot
  std::vector<std::string> serving_;            // decode_trie's `serving`
};

}  // namespace

LoadedTrie decode_trie(const SealedFile& sealed, const std::string& source,
                       const std::vector<LayerInfo>& layers, const std::string& model_id,
                       const std::vector<std::string>& serving) {
  TrieDecoder decoder(sealed.file, source, layers, serving);
  decoder.check_header(&sealed, model_id);
  return decoder.nodes();
}

namespace {

// The tensors of node `n`'s snapshot of layer `i`.
std::string tensor_name(size_t n, size_t i, char part) {
  return fmt::format("node.{}.layer.{}.{}", n, i, part);
}

// The nodes of `outlined` (its snapshots outlines: sizes without data) for plan_load.
std::vector<PlannedNode> planned_nodes(const LoadedTrie& outlined,
                                       const std::vector<LayerInfo>& layers) {
  std::vector<PlannedNode> out;
  out.reserve(outlined.nodes.size());
  for (const LoadedNode& node : outlined.nodes) {
    PlannedNode planned{node.parent, node.user, node.last_used};
    for (size_t i = 0; i < node.snapshots.size(); ++i) {
      if (node.snapshots[i] == nullptr) continue;
      planned.bytes += node.snapshots[i]->size();
      planned.restore_point = planned.restore_point || layers[i].whole_state();
    }
    out.push_back(planned);
  }
  return out;
}

// What read_trie decides once the edges are read (the first tensor of every file save writes):
// the nodes decoded over outlines, every check run but the seal's, and the tensors of the nodes
// the budget evicts passed over. A check that fails passes over every tensor; its Error comes
// after the seal's (a damaged file is said to be damaged).
struct ReadPlan {
  std::optional<LoadedTrie> outlined;  // none: not planned (read whole), or refused
  LoadPlan plan;
  std::exception_ptr refused;
  std::vector<bool> skip;  // per tensor, in data order
};

ReadPlan plan_reading(const SafetensorsFile& file, const std::string& source,
                      const std::vector<LayerInfo>& layers, const std::string& model_id,
                      const std::vector<std::string>& serving, int64_t budget) {
  ReadPlan out;
  out.skip.assign(file.tensors.size(), false);
  if (file.tensors.front().first != "edges") return out;
  try {
    TrieDecoder decoder(file, source, layers, serving);
    decoder.check_header(nullptr, model_id);
    out.outlined = decoder.nodes();
    out.plan = plan_load(planned_nodes(*out.outlined, layers), budget);
    for (size_t n = 0; n < out.plan.doomed.size(); ++n) {
      for (size_t i = 0; out.plan.doomed[n] && i < layers.size(); ++i) {
        if (out.outlined->nodes[n].snapshots[i] == nullptr) continue;
        out.skip[file.index.at(tensor_name(n, i, 'a'))] = true;
        out.skip[file.index.at(tensor_name(n, i, 'b'))] = true;
      }
    }
  } catch (...) {
    out.refused = std::current_exception();
    out.outlined.reset();
    out.skip.assign(file.tensors.size(), true);
  }
  return out;
}

}  // namespace

LoadedTrie read_trie(const SealedRead& read, const std::string& source,
                     const std::vector<LayerInfo>& layers, const std::string& model_id,
                     const std::vector<std::string>& serving, int64_t budget) {
  ReadPlan reading;  // planned when the first tensor after the edges is about to be read
  const auto keep = [&](size_t index, const SafetensorsFile& file) {
    if (index == 0) return true;
    if (reading.skip.empty())
      reading = plan_reading(file, source, layers, model_id, serving, budget);
    return !reading.skip[index];
  };
  const SealedFile sealed = read(keep);
  TrieDecoder decoder(sealed.file, source, layers, serving);
  decoder.check_header(&sealed, model_id);
  if (reading.refused) std::rethrow_exception(reading.refused);
  // Never planned (a file of one tensor, or one whose first is not "edges"): read whole, left to
  // the eviction after the load.
  if (!reading.outlined) return decoder.nodes();
  const LoadPlan& plan = reading.plan;
  LoadedTrie loaded = std::move(*reading.outlined);
  for (size_t n = 0; n < loaded.nodes.size(); ++n) {
    for (size_t i = 0; i < layers.size(); ++i) {
      SnapshotPtr& snapshot = loaded.nodes[n].snapshots[i];
      if (snapshot == nullptr) continue;
      if (plan.doomed[n]) {
        snapshot.reset();
        continue;
      }
      SnapshotRecord record = *snapshot_record(*snapshot);
      record.first = sealed.file.at(tensor_name(n, i, 'a'), source.c_str());
      record.second = sealed.file.at(tensor_name(n, i, 'b'), source.c_str());
      snapshot = make_snapshot(std::move(record), fmt::format("{} node.{}.layer.{}", source, n, i));
    }
  }
  loaded.doomed = plan.doomed;
  loaded.evicted = plan.evicted;
  return loaded;
}

LoadedTrie decode_trie(const std::string& bytes, const std::string& source,
                       const std::vector<LayerInfo>& layers, const std::string& model_id,
                       const std::vector<std::string>& serving) {
  return decode_trie(read_sealed(bytes, source), source, layers, model_id, serving);
}

std::vector<std::string> held_signatures(const Trie& trie) {
  std::vector<std::string> out(trie.layers().size());
  std::vector<const Node*> nodes;
  trie.preorder(nodes);
  for (size_t i = 0; i < out.size(); ++i) {
    for (const Node* node : nodes) {
      const SnapshotPtr& s = node->snapshots[i];
      if (s == nullptr) continue;
      out[i] = held_signature(*s, trie.layers()[i].cache);
      break;
    }
  }
  return out;
}

std::unique_ptr<Trie> build_trie(const std::vector<LayerInfo>& layers, LoadedTrie loaded) {
  auto trie = std::make_unique<Trie>(layers);
  std::vector<Node*> made;
  made.reserve(loaded.nodes.size());
  for (LoadedNode& node : loaded.nodes) {
    Node& parent = node.parent < 0 ? trie->root() : *made[static_cast<size_t>(node.parent)];
    made.push_back(&trie->add_child(parent, std::move(node.edge), std::move(node.snapshots),
                                    node.user, node.last_used));
  }
  // The doomed nodes (their descendants doomed too) go children first, each a leaf by then.
  // Only nodes that stay merge, as the eviction merged them: a doomed one is never merged, nor
  // merged into (it has no snapshots to merge, and merging it would free a node still listed).
  std::unordered_set<const Node*> doomed;
  for (size_t n = 0; n < loaded.doomed.size(); ++n) {
    if (loaded.doomed[n]) doomed.insert(made[n]);
  }
  const auto unmerged = [&](const Node& node) { return doomed.contains(&node); };
  for (size_t n = loaded.doomed.size(); n-- > 0;) {
    if (!loaded.doomed[n]) continue;
    if (!made[n]->children.empty()) {  // a plan that dooms a node but not its descendants
      throw Error(fmt::format("build_trie: internal error: node {} is doomed, a child is not", n));
    }
    trie->remove_leaf(*made[n], unmerged);
  }
  trie->set_clock(loaded.clock);
  return trie;
}

}  // namespace kvsnap::detail
