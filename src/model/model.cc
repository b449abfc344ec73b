#include "model/model.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cmath>
#include <fstream>
#include <random>

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

void Model::save(const std::string& config_path, const std::string& weights_path) const {
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
  file.metadata["format"] = kModelFormat;
  // Each file whole or not at all (written aside, synced, renamed over the old one: a full disk
  // is an Error, not a truncated file), the weights first: a failure leaves the old config.
  const auto write = [](const std::string& path, const std::string& bytes) {
    try {
      detail::write_file_atomically(path, bytes);
    } catch (const Error& e) {
      throw Error(fmt::format("Model::save: {}", e.what()));
    }
  };
  std::string weights;
  try {
    weights = detail::encode_safetensors(file);
  } catch (const detail::HeaderTooLong& e) {
    throw Error(fmt::format("Model::save: {} layers: {}", weights_->layers.size(), e.what()));
  }
  write(weights_path, weights);
  write(config_path, weights_->config.to_json());
}

Model Model::load(const std::string& config_path, const std::string& weights_path) {
  const ModelConfig config = ModelConfig::from_json(detail::read_file(config_path));
  const detail::SafetensorsFile file = detail::read_safetensors(weights_path);
  Model model(config, Unfilled{});  // every tensor comes from the file (nothing generated)
  const std::string context = fmt::format("Model::load {}", weights_path);
  const auto format = file.metadata.find("format");
  if (format == file.metadata.end() || format->second != kModelFormat) {
    throw Error(fmt::format(
        "{}: metadata \"format\" is {}, not \"{}\" (weights Model::save "
        "wrote)",
        context, format == file.metadata.end() ? "missing" : detail::cut_quoted(format->second),
        kModelFormat));
  }
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
