#include "model/model.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "kvsnap/attention.h"
#include "kvsnap/kv_cache.h"
#include "kvsnap/paged_kv_cache.h"
#include "kvsnap/recurrent_cache.h"
#include "kvsnap/rotating_kv_cache.h"
#include "model/weights.h"
#include "persist/files.h"
#include "persist/safetensors.h"

namespace kvsnap {
namespace detail {
namespace {

int64_t element_count(const Shape& shape) {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  return n;
}

}  // namespace
}  // namespace detail

namespace {
// The metadata "format" of the weights Model::save writes (and load requires).
constexpr const char* kModelFormat = "kvsnap-model";
}  // namespace

Model::Model(ModelConfig config, Unfilled) : weights_(std::make_unique<detail::ModelWeights>()) {
  config.validate();
  weights_->config = config;
  for (char kind : config.pattern) {
    detail::LayerWeights layer;
    layer.kind = kind;
    weights_->layers.push_back(std::move(layer));
  }
}

Model::Model(ModelConfig config) : Model(std::move(config), Unfilled{}) {
  std::mt19937_64 rng(weights_->config.seed);
  weights_->for_each(
      [&](const std::string&, detail::Floats& tensor, const Shape& shape, float scale) {
        tensor.resize(static_cast<size_t>(detail::element_count(shape)));
        if (scale == 0.0f) {  // norms start at 1
          std::fill(tensor.begin(), tensor.end(), 1.0f);
        } else if (scale < 0.0f) {  // biases: a constant
          std::fill(tensor.begin(), tensor.end(), -scale);
        } else {
          std::normal_distribution<float> normal(0.0f, scale);
          for (float& value : tensor) value = normal(rng);
        }
      });
  for (detail::LayerWeights& l : weights_->layers) {
    if (l.kind != 'R') continue;
    const int64_t kernel = weights_->config.conv_kernel;
    std::vector<float> conv(static_cast<size_t>(weights_->conv_dim() * kernel));
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(kernel)));
    for (float& value : conv) value = normal(rng);
    l.conv = Array::from_floats(conv, {weights_->conv_dim(), kernel});
  }
  weights_->derive();
}

Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

const ModelConfig& Model::config() const { return weights_->config; }

std::string Model::weights_digest() const {
  XXH3_state_t* const state = XXH3_createState();
  if (state == nullptr) throw std::bad_alloc();
  const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> owner(state,
                                                                              XXH3_freeState);
  XXH3_128bits_reset(state);
  const auto add = [&](const void* data, size_t bytes) { XXH3_128bits_update(state, data, bytes); };
  weights_->for_each([&](const std::string& name, detail::Floats& tensor, const Shape&, float) {
    add(name.data(), name.size() + 1);  // with its NUL: names and values cannot run together
    add(tensor.data(), tensor.size() * sizeof(float));
  });
  for (const detail::LayerWeights& l : weights_->layers) {
    if (l.kind != 'R') continue;
    const std::vector<float> conv = l.conv.to_floats();  // small: conv_dim x kernel
    add(conv.data(), conv.size() * sizeof(float));
  }
  const XXH128_hash_t hash = XXH3_128bits_digest(state);
  return fmt::format("{:016x}{:016x}", hash.high64, hash.low64);
}

namespace {
// A model config file, read by `call`: a regular file of at most 1 MiB (not a FIFO waited on),
// as the caller's to trust.
// The config in the file at `path`; a content error names `call` and the file.
ModelConfig read_config(const std::string& path, const char* call) {
  const std::string text = detail::read_private_file(
      path, detail::PrivacyRule{.call = call, .override_with = "", .allow_shared = true},
      uint64_t{1} << 20);
  try {
    return ModelConfig::from_json(text);
  } catch (const Error& e) {
    throw Error(fmt::format("{} {}: {}", call, path, e.what()));
  }
}
}  // namespace

ModelConfig ModelConfig::from_file(const std::string& path) {
  return read_config(path, "ModelConfig::from_file");
}

void Model::save(const std::string& config_path, const std::string& weights_path) const {
  // One directory entry under two names (the same path, or a folder reached two ways): the
  // config's rename would replace the weights. (Two entries of one file — hard links, a symbolic
  // link — are each replaced alone.)
  namespace fs = std::filesystem;
  const auto entry = [](const std::string& path) {
    std::error_code error;
    const fs::path p = fs::path(path).lexically_normal();
    const fs::path folder =
        fs::weakly_canonical(p.parent_path().empty() ? "." : p.parent_path(), error);
    return error ? fs::path() : folder / p.filename();
  };
  if (const fs::path config_entry = entry(config_path);
      !config_entry.empty() && config_entry == entry(weights_path)) {
    throw Error(
        fmt::format("Model::save: the config {} and the weights {} name one file; save them to two",
                    config_path, weights_path));
  }
  detail::SafetensorsFile file;
  weights_->for_each(
      [&](const std::string& name, detail::Floats& tensor, const Shape& shape, float) {
        file.tensors.emplace_back(name, Array::from_floats(tensor, shape));
      });
  for (size_t i = 0; i < weights_->layers.size(); ++i) {
    if (weights_->layers[i].kind == 'R') {
      file.tensors.emplace_back(fmt::format("layers.{}.conv", i), weights_->layers[i].conv);
    }
  }
  const std::string config = weights_->config.to_json();
  file.metadata["format"] = kModelFormat;
  file.metadata["config"] = config;  // the pair is checked at load
  std::string weights;
  try {
    weights = detail::encode_sealed(std::move(file));
  } catch (const detail::HeaderTooLong& e) {
    throw Error(fmt::format("Model::save: {} layers: {}", weights_->layers.size(), e.what()));
  }
  // Both files are written aside and synced before either replaces its old one, so an error
  // while writing (a full disk) leaves the old pair as it was. The weights are renamed in first:
  // they name their config, so whatever stops the save between the two renames (an error, a
  // crash) leaves a pair that load refuses, saying which config the weights hold — never new
  // weights read with an old config unnoticed.
  const auto prepare = [](const std::string& path, const std::string& bytes) {
    try {
      return detail::prepare_file_atomically(path, bytes);
    } catch (const Error& e) {
      throw Error(fmt::format("Model::save: {} (nothing replaced)", e.what()));
    }
  };
  detail::PreparedFile weights_file = prepare(weights_path, weights);
  detail::PreparedFile config_file = prepare(config_path, config);
  // A folder sync that fails after a rename leaves that file in place (a crash could still undo
  // the rename): the config follows the weights all the same, and the error says so.
  std::string unsynced;
  try {
    weights_file.commit();
  } catch (const Error& e) {
    if (!weights_file.in_place()) {
      throw Error(fmt::format("Model::save: {} (nothing replaced)", e.what()));
    }
    unsynced = e.what();
  }
  try {
    config_file.commit();
  } catch (const Error& e) {
    if (!config_file.in_place()) {
      throw Error(
          fmt::format("Model::save: {} (the weights at {} are this model's; load refuses them "
                      "with the old config: save again)",
                      e.what(), weights_path));
    }
    if (unsynced.empty()) unsynced = e.what();
  }
  if (!unsynced.empty()) {
    throw Error(fmt::format(
        "Model::save: {} (both files are in place; a crash could undo their renames: save again)",
        unsynced));
  }
}

namespace {

// Throws Error naming `context` unless the config the weights were saved with (metadata
// "config", when the file has one: earlier saves did not write it) is `config` (but its seed and
// context length, which loaded weights do not use).
void check_saved_config(const detail::SafetensorsFile& file, const ModelConfig& config,
                        const std::string& config_path, const std::string& context) {
  const auto saved = file.metadata.find("config");
  if (saved == file.metadata.end()) return;
  ModelConfig with, given = config;
  try {
    with = ModelConfig::from_json(saved->second);
  } catch (const Error& e) {
    throw Error(
        fmt::format("{}: metadata \"config\" is not a model config: {}", context, e.what()));
  }
  // Neither the seed nor the context length is a property of loaded weights.
  with.seed = given.seed = 0;
  with.context_length = given.context_length = 0;
  const nlohmann::json ours = nlohmann::json::parse(with.to_json());
  const nlohmann::json theirs = nlohmann::json::parse(given.to_json());
  std::string differences;
  for (const auto& [key, value] : ours.items()) {
    if (theirs.contains(key) && theirs[key] == value) continue;
    differences += fmt::format("{}{} {} (the file's: {})", differences.empty() ? "" : ", ", key,
                               value.dump(), theirs.contains(key) ? theirs[key].dump() : "none");
  }
  if (differences.empty()) return;
  throw Error(fmt::format(
      "{}: the weights were saved with another config than {}'s: {} (a save that did not finish "
      "both files, or another model's config: metadata \"config\" of the weights holds theirs)",
      context, config_path, differences));
}

}  // namespace

Model Model::load(const std::string& config_path, const std::string& weights_path) {
  const ModelConfig config = read_config(config_path, "Model::load");
  const std::string context = fmt::format("Model::load {}", weights_path);
  // Model files are the caller's to trust (as any engine's weights are): read as a regular file
  // of at most the machine's memory, without blocking on a FIFO, checked against its seal.
  detail::SealedFile sealed;
  try {
    sealed = detail::read_sealed_file(
        weights_path,
        detail::PrivacyRule{.call = "Model::load", .override_with = "", .allow_shared = true});
  } catch (const std::bad_alloc&) {
    throw Error(fmt::format("{}: the weights do not fit in memory", context));
  }
  const detail::SafetensorsFile& file = sealed.file;
  // Earlier saves wrote neither a seal nor their config: such a file is read as it is.
  if (file.metadata.count("checksum") != 0 || file.metadata.count("config") != 0) {
    detail::check_seal(sealed, context);
  }
  Model model(config, Unfilled{});  // every tensor comes from the file (nothing generated)
  const auto format = file.metadata.find("format");
  if (format == file.metadata.end() || format->second != kModelFormat) {
    throw Error(fmt::format(
        "{}: metadata \"format\" is {}, not \"{}\" (weights Model::save "
        "wrote)",
        context, format == file.metadata.end() ? "missing" : detail::cut_quoted(format->second),
        kModelFormat));
  }
  check_saved_config(file, config, config_path, context);
  std::set<std::string> taken;
  const auto take = [&](const std::string& name, const Shape& shape) {
    const Array& array = file.at(name, context.c_str());
    if (array.dtype() != DType::f32) {
      throw Error(fmt::format("{}: tensor \"{}\" is {}; the model's weights are f32", context, name,
                              array.describe()));
    }
    if (array.shape() != shape) {
      throw Error(fmt::format("{}: tensor \"{}\" is {}, the config needs {}", context, name,
                              array.describe(), shape_string(shape)));
    }
    taken.insert(name);
    return array;
  };
  model.weights_->for_each([&](const std::string& name, detail::Floats& tensor, const Shape& shape,
                               float) { tensor = take(name, shape).to_floats(); });
  for (size_t i = 0; i < model.weights_->layers.size(); ++i) {
    detail::LayerWeights& l = model.weights_->layers[i];
    if (l.kind == 'R') {
      l.conv =
          take(fmt::format("layers.{}.conv", i), {model.weights_->conv_dim(), config.conv_kernel})
              .astype(DType::f32);
    }
  }
  for (const auto& [name, array] : file.tensors) {
    if (taken.count(name) == 0) {
      throw Error(fmt::format("{}: tensor {} ({}) is no weight of {}'s model", context,
                              detail::cut_quoted(name), array.describe(), config_path));
    }
  }
  model.weights_->derive();
  return model;
}

std::vector<std::unique_ptr<Cache>> Model::make_caches() const { return make_caches({}); }

std::vector<std::unique_ptr<Cache>> Model::make_caches(CacheOptions options) const {
  const ModelConfig& c = weights_->config;
  std::vector<std::unique_ptr<Cache>> caches;
  for (char kind : c.pattern) {
    if (kind == 'A' && options.paged) {
      caches.push_back(std::make_unique<PagedKVCache>(
          PagedKVCache::Options{.block_tokens = options.block_tokens}));
    } else if (kind == 'A') {
      caches.push_back(std::make_unique<KVCache>());
    }
    if (kind == 'S') caches.push_back(std::make_unique<RotatingKVCache>(c.window));
    if (kind == 'R') {
      caches.push_back(std::make_unique<RecurrentCache>(
          static_cast<int>(c.conv_kernel - 1), static_cast<int>(weights_->conv_dim()),
          static_cast<int>(c.delta_value_heads), static_cast<int>(c.delta_head_dim),
          static_cast<int>(c.delta_head_dim)));
    }
  }
  return caches;
}

std::vector<Cache*> cache_pointers(const std::vector<std::unique_ptr<Cache>>& caches) {
  std::vector<Cache*> out;
  for (const auto& c : caches) out.push_back(c.get());
  return out;
}

}  // namespace kvsnap
