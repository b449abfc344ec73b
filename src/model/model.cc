#include "model/model.h"

#include <cblas.h>
#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <random>

#include "kvsnap/attention.h"
#include "kvsnap/kv_cache.h"
#include "kvsnap/ops.h"
#include "kvsnap/recurrent_cache.h"
#include "kvsnap/rotating_kv_cache.h"
#include "persist/safetensors.h"

namespace kvsnap {
namespace detail {

using Floats = std::vector<float>;

// Matrices are row-major [in, out] so a block computes y = x W.
struct LayerWeights {
  char kind = 'A';
  Floats input_norm, post_norm;
  Floats wq, wk, wv;            // attention
  Floats wqkv, wa, a_bias, wb;  // recurrent
  Array conv;                   // recurrent: [conv_dim, kernel]
  Floats wo;                    // both: output projection
  Floats w_gate, w_up, w_down;  // MLP
};

struct ModelWeights {
  ModelConfig config;
  Floats embed;  // [vocab, hidden]; also the output head
  Floats final_norm;
  std::vector<LayerWeights> layers;

  int64_t conv_dim() const {
    return 2 * config.delta_key_heads * config.delta_head_dim +
           config.delta_value_heads * config.delta_head_dim;
  }

  // Visits every tensor by name with its shape, in a fixed order (init, save and load agree).
  template <class Visit>
  void for_each(Visit&& visit) {
    const ModelConfig& c = config;
    visit("embed", embed, Shape{c.vocab_size, c.hidden}, 1.0f);
    visit("final_norm", final_norm, Shape{c.hidden}, 0.0f);
    const int64_t q = c.query_heads * c.head_dim, kv = c.kv_heads * c.head_dim;
    for (size_t i = 0; i < layers.size(); ++i) {
      LayerWeights& l = layers[i];
      const auto name = [&](const char* field) { return fmt::format("layers.{}.{}", i, field); };
      const float in = 1.0f / std::sqrt(static_cast<float>(c.hidden));
      visit(name("input_norm"), l.input_norm, Shape{c.hidden}, 0.0f);
      visit(name("post_norm"), l.post_norm, Shape{c.hidden}, 0.0f);
      if (l.kind == 'R') {
        const int64_t value = c.delta_value_heads * c.delta_head_dim;
        visit(name("wqkv"), l.wqkv, Shape{c.hidden, conv_dim()}, in);
        visit(name("wa"), l.wa, Shape{c.hidden, c.delta_value_heads}, in);
        visit(name("a_bias"), l.a_bias, Shape{c.delta_value_heads}, -4.0f);
        visit(name("wb"), l.wb, Shape{c.hidden, c.delta_value_heads}, in);
        visit(name("wo"), l.wo, Shape{value, c.hidden},
              1.0f / std::sqrt(static_cast<float>(value)));
      } else {
        visit(name("wq"), l.wq, Shape{c.hidden, q}, in);
        visit(name("wk"), l.wk, Shape{c.hidden, kv}, in);
        visit(name("wv"), l.wv, Shape{c.hidden, kv}, in);
        visit(name("wo"), l.wo, Shape{q, c.hidden}, 1.0f / std::sqrt(static_cast<float>(q)));
      }
      visit(name("w_gate"), l.w_gate, Shape{c.hidden, c.mlp_hidden}, in);
      visit(name("w_up"), l.w_up, Shape{c.hidden, c.mlp_hidden}, in);
      visit(name("w_down"), l.w_down, Shape{c.mlp_hidden, c.hidden},
            1.0f / std::sqrt(static_cast<float>(c.mlp_hidden)));
    }
  }
};

namespace {

int64_t element_count(const Shape& shape) {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  return n;
}

// y[rows, out] (+)= x[rows, in] W[in, out]
void matmul(const float* x, int64_t rows, int64_t in, const Floats& w, int64_t out, float* y,
            bool accumulate = false) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
              static_cast<int>(out), static_cast<int>(in), 1.0f, x, static_cast<int>(in), w.data(),
              static_cast<int>(out), accumulate ? 1.0f : 0.0f, y, static_cast<int>(out));
}

Floats rms_norm(const Floats& x, int64_t rows, int64_t width, const Floats& weight, float eps) {
  Floats y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x.data() + r * width;
    float sum = 0.0f;
    for (int64_t i = 0; i < width; ++i) sum += in[i] * in[i];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
    for (int64_t i = 0; i < width; ++i) y[r * width + i] = in[i] * scale * weight[i];
  }
  return y;
}

float silu(float v) { return v / (1.0f + std::exp(-v)); }
float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// Rotates pairs (d, d + D/2) of every head by position * theta^(-2d/D) (rotate-half RoPE).
void rope(Floats& x, int64_t rows, int64_t heads, int64_t depth, int64_t first_position,
          float theta) {
  const int64_t half = depth / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const auto position = static_cast<float>(first_position + r);
    for (int64_t d = 0; d < half; ++d) {
      const float angle =
          position * std::pow(theta, -2.0f * static_cast<float>(d) / static_cast<float>(depth));
      const float c = std::cos(angle), s = std::sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x.data() + (r * heads + h) * depth;
        const float a = v[d], b = v[d + half];
        v[d] = a * c - b * s;
        v[d + half] = b * c + a * s;
      }
    }
  }
}

// [L, H*D] rows to an Array [1, H, L, D] and back.
Array to_heads(const Floats& x, int64_t rows, int64_t heads, int64_t depth) {
  Array out = Array::uninitialized(DType::f32, {1, heads, rows, depth});
  float* o = out.mutable_data<float>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(x.data() + (r * heads + h) * depth, depth, o + (h * rows + r) * depth);
  return out;
}
Floats from_heads(const Array& a) {
  const int64_t heads = a.dim(1), rows = a.dim(2), depth = a.dim(3);
  const float* in = a.data<float>();
  Floats out(static_cast<size_t>(heads * rows * depth));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(in + (h * rows + r) * depth, depth, out.data() + (r * heads + h) * depth);
  return out;
}

}  // namespace

void attention_block(const ModelWeights& w, const LayerWeights& l, Attention& cache,
                     const Batch& batch, const Floats& h, Floats& x) {
  const ModelConfig& c = w.config;
  const int64_t rows = batch.length(), start = batch.seq_offsets[0];
  const int64_t q_width = c.query_heads * c.head_dim, kv_width = c.kv_heads * c.head_dim;
  Floats q(static_cast<size_t>(rows * q_width)), k(static_cast<size_t>(rows * kv_width)),
      v(static_cast<size_t>(rows * kv_width));
  matmul(h.data(), rows, c.hidden, l.wq, q_width, q.data());
  matmul(h.data(), rows, c.hidden, l.wk, kv_width, k.data());
  matmul(h.data(), rows, c.hidden, l.wv, kv_width, v.data());
  rope(q, rows, c.query_heads, c.head_dim, start, c.rope_theta);
  rope(k, rows, c.kv_heads, c.head_dim, start, c.rope_theta);
  const KVHistory history = cache.update(batch, to_heads(k, rows, c.kv_heads, c.head_dim),
                                         to_heads(v, rows, c.kv_heads, c.head_dim));
  const AttentionMask mask =
      l.kind == 'A' ? AttentionMask::causal() : AttentionMask::sliding_window(c.window);
  const Array out = sdpa(batch, to_heads(q, rows, c.query_heads, c.head_dim), history, mask,
                         1.0f / std::sqrt(static_cast<float>(c.head_dim)));
  matmul(from_heads(out).data(), rows, q_width, l.wo, c.hidden, x.data(), /*accumulate=*/true);
}

void recurrent_block(const ModelWeights& w, const LayerWeights& l, RecurrentCache& cache,
                     const Batch& batch, const Floats& h, Floats& x) {
  const ModelConfig& c = w.config;
  const int64_t rows = batch.length(), channels = w.conv_dim();
  const int64_t key_heads = c.delta_key_heads, value_heads = c.delta_value_heads,
                depth = c.delta_head_dim;
  const int64_t key_width = key_heads * depth, value_width = value_heads * depth;
  Floats mixed(static_cast<size_t>(rows * channels));
  matmul(h.data(), rows, c.hidden, l.wqkv, channels, mixed.data());
  Floats gate(static_cast<size_t>(rows * value_heads)), rate(gate.size());
  matmul(h.data(), rows, c.hidden, l.wa, value_heads, gate.data());
  matmul(h.data(), rows, c.hidden, l.wb, value_heads, rate.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t hv = 0; hv < value_heads; ++hv) {
      float& g = gate[static_cast<size_t>(r * value_heads + hv)];
      g = sigmoid(-(g + l.a_bias[static_cast<size_t>(hv)])) * 0.1f + 0.9f;  // decay in (0.9, 1)
      float& b = rate[static_cast<size_t>(r * value_heads + hv)];
      b = sigmoid(b);
    }
  }

  const std::vector<int64_t> splits = cache.snapshot_splits(rows);
  const RecurrentHistory state = cache.get(batch, DType::f32);
  const Conv1dResult conv = causal_conv1d(Array::from_floats(mixed, {1, rows, channels}), l.conv,
                                          state.conv_state(), splits);
  // SiLU, then q and k normalized per head (q also scaled by 1/sqrt(Dk)), v as is.
  const float* convolved = conv.output.data<float>();
  Floats q(static_cast<size_t>(rows * key_width)), k(q.size()),
      v(static_cast<size_t>(rows * value_width));
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = convolved + r * channels;
    for (int64_t i = 0; i < key_width; ++i) {
      q[r * key_width + i] = silu(in[i]);
      k[r * key_width + i] = silu(in[key_width + i]);
    }
    for (int64_t i = 0; i < value_width; ++i) v[r * value_width + i] = silu(in[2 * key_width + i]);
    for (int64_t hk = 0; hk < key_heads; ++hk) {
      float* qh = q.data() + r * key_width + hk * depth;
      float* kh = k.data() + r * key_width + hk * depth;
      float qn = 1e-6f, kn = 1e-6f;
      for (int64_t d = 0; d < depth; ++d) {
        qn += qh[d] * qh[d];
        kn += kh[d] * kh[d];
      }
      const float qs = 1.0f / (std::sqrt(qn) * std::sqrt(static_cast<float>(depth)));
      const float ks = 1.0f / std::sqrt(kn);
      for (int64_t d = 0; d < depth; ++d) {
        qh[d] *= qs;
        kh[d] *= ks;
      }
    }
  }
  const GatedDeltaResult delta =
      gated_delta(Array::from_floats(q, {1, rows, key_heads, depth}),
                  Array::from_floats(k, {1, rows, key_heads, depth}),
                  Array::from_floats(v, {1, rows, value_heads, depth}),
                  Array::from_floats(gate, {1, rows, value_heads}),
                  Array::from_floats(rate, {1, rows, value_heads}), state.delta_state(), splits);
  cache.put(batch, conv.tails, delta.states);
  matmul(delta.output.data<float>(), rows, value_width, l.wo, c.hidden, x.data(),
         /*accumulate=*/true);
}

void mlp_block(const ModelWeights& w, const LayerWeights& l, int64_t rows, const Floats& h,
               Floats& x) {
  const ModelConfig& c = w.config;
  Floats gate(static_cast<size_t>(rows * c.mlp_hidden)), up(gate.size());
  matmul(h.data(), rows, c.hidden, l.w_gate, c.mlp_hidden, gate.data());
  matmul(h.data(), rows, c.hidden, l.w_up, c.mlp_hidden, up.data());
  for (size_t i = 0; i < gate.size(); ++i) gate[i] = silu(gate[i]) * up[i];
  matmul(gate.data(), rows, c.mlp_hidden, l.w_down, c.hidden, x.data(), /*accumulate=*/true);
}

}  // namespace detail

Model::Model(ModelConfig config) : weights_(std::make_unique<detail::ModelWeights>()) {
  config.validate();
  weights_->config = config;
  for (char kind : config.pattern) {
    detail::LayerWeights layer;
    layer.kind = kind;
    weights_->layers.push_back(std::move(layer));
  }
  std::mt19937_64 rng(config.seed);
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
    std::vector<float> conv(static_cast<size_t>(weights_->conv_dim() * config.conv_kernel));
    std::normal_distribution<float> normal(
        0.0f, 1.0f / std::sqrt(static_cast<float>(config.conv_kernel)));
    for (float& value : conv) value = normal(rng);
    l.conv = Array::from_floats(conv, {weights_->conv_dim(), config.conv_kernel});
  }
}

Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

const ModelConfig& Model::config() const { return weights_->config; }

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
  file.metadata["format"] = "kvsnap-model";
  const auto write = [](const std::string& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw Error(fmt::format("Model::save: cannot write {}", path));
  };
  write(config_path, weights_->config.to_json());
  write(weights_path, detail::encode_safetensors(file));
}

Model Model::load(const std::string& config_path, const std::string& weights_path) {
  const ModelConfig config = ModelConfig::from_json(detail::read_file(config_path));
  const detail::SafetensorsFile file = detail::read_safetensors(weights_path);
  Model model(config);
  const std::string context = fmt::format("Model::load {}", weights_path);
  const auto take = [&](const std::string& name, const Shape& shape) {
    const Array& array = file.at(name, context.c_str());
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
  return model;
}

std::vector<std::unique_ptr<Cache>> Model::make_caches() const {
  const ModelConfig& c = weights_->config;
  std::vector<std::unique_ptr<Cache>> caches;
  for (char kind : c.pattern) {
    if (kind == 'A') caches.push_back(std::make_unique<KVCache>());
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

Array Model::forward(std::span<const int32_t> tokens, std::span<Cache* const> caches,
                     bool all_positions) const {
  const detail::ModelWeights& w = *weights_;
  const ModelConfig& c = w.config;
  if (caches.size() != w.layers.size()) {
    throw Error(
        fmt::format("Model::forward: {} caches for {} layers", caches.size(), w.layers.size()));
  }
  if (tokens.empty()) throw Error("Model::forward: no tokens to evaluate");
  for (int32_t t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      throw Error(
          fmt::format("Model::forward: token {} outside the vocabulary [0, {})", t, c.vocab_size));
    }
  }
  const int64_t offset = caches.front() != nullptr ? caches.front()->offset() : 0;
  for (size_t i = 0; i < caches.size(); ++i) {
    if (caches[i] == nullptr || caches[i]->offset() != offset) {
      throw Error(fmt::format(
          "Model::forward: layer {} cache is {} (layer 0 is at offset {}); every "
          "layer needs its cache at one offset",
          i, caches[i] == nullptr ? "missing" : fmt::format("at offset {}", caches[i]->offset()),
          offset));
    }
  }
  const auto rows = static_cast<int64_t>(tokens.size());
  const Batch batch = Batch::single(tokens, offset);
  detail::Floats x(static_cast<size_t>(rows * c.hidden));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(w.embed.data() + tokens[static_cast<size_t>(r)] * c.hidden, c.hidden,
                x.data() + r * c.hidden);
  }
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const detail::LayerWeights& l = w.layers[i];
    const detail::Floats h = detail::rms_norm(x, rows, c.hidden, l.input_norm, c.rms_eps);
    if (l.kind == 'R') {
      auto* cache = dynamic_cast<RecurrentCache*>(caches[i]);
      if (cache == nullptr)
        throw Error(fmt::format("Model::forward: layer {} needs a RecurrentCache", i));
      detail::recurrent_block(w, l, *cache, batch, h, x);
    } else {
      auto* cache = dynamic_cast<Attention*>(caches[i]);
      if (cache == nullptr)
        throw Error(fmt::format("Model::forward: layer {} needs an attention cache", i));
      detail::attention_block(w, l, *cache, batch, h, x);
    }
    detail::mlp_block(w, l, rows, detail::rms_norm(x, rows, c.hidden, l.post_norm, c.rms_eps), x);
  }
  const int64_t first = all_positions ? 0 : rows - 1;
  const int64_t out_rows = rows - first;
  const detail::Floats tail(x.begin() + first * c.hidden, x.end());
  const detail::Floats h = detail::rms_norm(tail, out_rows, c.hidden, w.final_norm, c.rms_eps);
  Array logits = Array::uninitialized(DType::f32, {out_rows, c.vocab_size});
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(out_rows),
              static_cast<int>(c.vocab_size), static_cast<int>(c.hidden), 1.0f, h.data(),
              static_cast<int>(c.hidden), w.embed.data(), static_cast<int>(c.hidden), 0.0f,
              logits.mutable_data<float>(), static_cast<int>(c.vocab_size));
  return logits;
}

std::vector<Cache*> cache_pointers(const std::vector<std::unique_ptr<Cache>>& caches) {
  std::vector<Cache*> out;
  for (const auto& c : caches) out.push_back(c.get());
  return out;
}

}  // namespace kvsnap
