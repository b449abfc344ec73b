#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "model/model.h"

namespace kvsnap {

void ModelConfig::validate() const {
  const auto require = [](bool ok, const char* field, int64_t value, const char* rule) {
    if (!ok) throw Error(fmt::format("ModelConfig: {} = {}: {}", field, value, rule));
  };
  require(vocab_size >= 2 && vocab_size <= (int64_t(1) << 24), "vocab_size", vocab_size,
          "need 2 <= vocab_size <= 2^24");
  require(hidden >= 1, "hidden", hidden, "need >= 1");
  require(mlp_hidden >= 1, "mlp_hidden", mlp_hidden, "need >= 1");
  require(kv_heads >= 1, "kv_heads", kv_heads, "need >= 1");
  require(query_heads >= 1 && query_heads % kv_heads == 0, "query_heads", query_heads,
          "need a positive multiple of kv_heads (GQA)");
  require(head_dim >= 2 && head_dim % 2 == 0, "head_dim", head_dim,
          "need an even value >= 2 (RoPE)");
  require(window >= 1, "window", window, "need >= 1");
  require(conv_kernel >= 1, "conv_kernel", conv_kernel, "need >= 1");
  require(delta_key_heads >= 1, "delta_key_heads", delta_key_heads, "need >= 1");
  require(delta_value_heads >= 1 && delta_value_heads % delta_key_heads == 0, "delta_value_heads",
          delta_value_heads, "need a positive multiple of delta_key_heads");
  require(delta_head_dim >= 1, "delta_head_dim", delta_head_dim, "need >= 1");
  require(context_length >= 1, "context_length", context_length, "need >= 1");
  if (pattern.empty() || pattern.find_first_not_of("ASR") != std::string::npos) {
    throw Error(
        fmt::format("ModelConfig: pattern \"{}\": need one or more of 'A' (attention), "
                    "'S' (sliding window), 'R' (recurrent)",
                    pattern));
  }
  if (!(rope_theta > 0.0f) || !(rms_eps > 0.0f)) {
    throw Error(fmt::format("ModelConfig: rope_theta {} and rms_eps {} must be positive",
                            rope_theta, rms_eps));
  }
}

ModelConfig ModelConfig::from_json(const std::string& text) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("ModelConfig: not valid JSON ({})", e.what()));
  }
  if (!json.is_object()) throw Error("ModelConfig: the config must be a JSON object");
  ModelConfig config;
  for (const auto& [key, value] : json.items()) {
    try {
      if (key == "vocab_size")
        config.vocab_size = value.get<int64_t>();
      else if (key == "hidden")
        config.hidden = value.get<int64_t>();
      else if (key == "mlp_hidden")
        config.mlp_hidden = value.get<int64_t>();
      else if (key == "query_heads")
        config.query_heads = value.get<int64_t>();
      else if (key == "kv_heads")
        config.kv_heads = value.get<int64_t>();
      else if (key == "head_dim")
        config.head_dim = value.get<int64_t>();
      else if (key == "window")
        config.window = value.get<int64_t>();
      else if (key == "pattern")
        config.pattern = value.get<std::string>();
      else if (key == "conv_kernel")
        config.conv_kernel = value.get<int64_t>();
      else if (key == "delta_key_heads")
        config.delta_key_heads = value.get<int64_t>();
      else if (key == "delta_value_heads")
        config.delta_value_heads = value.get<int64_t>();
      else if (key == "delta_head_dim")
        config.delta_head_dim = value.get<int64_t>();
      else if (key == "rope_theta")
        config.rope_theta = value.get<float>();
      else if (key == "rms_eps")
        config.rms_eps = value.get<float>();
      else if (key == "seed")
        config.seed = value.get<uint64_t>();
      else if (key == "context_length")
        config.context_length = value.get<int64_t>();
      else
        throw Error(fmt::format("ModelConfig: unknown field \"{}\"", key));
    } catch (const nlohmann::json::exception&) {
      throw Error(
          fmt::format("ModelConfig: field \"{}\" has the wrong type ({})", key, value.dump()));
    }
  }
  config.validate();
  return config;
}

std::string ModelConfig::to_json() const {
  const nlohmann::json json = {{"vocab_size", vocab_size},
                               {"hidden", hidden},
                               {"mlp_hidden", mlp_hidden},
                               {"query_heads", query_heads},
                               {"kv_heads", kv_heads},
                               {"head_dim", head_dim},
                               {"window", window},
                               {"pattern", pattern},
                               {"conv_kernel", conv_kernel},
                               {"delta_key_heads", delta_key_heads},
                               {"delta_value_heads", delta_value_heads},
                               {"delta_head_dim", delta_head_dim},
                               {"rope_theta", rope_theta},
                               {"rms_eps", rms_eps},
                               {"seed", seed},
                               {"context_length", context_length}};
  return json.dump(2);
}

int64_t ModelConfig::parameter_count() const {
  const int64_t attention = hidden * query_heads * head_dim * 2 + hidden * kv_heads * head_dim * 2;
  const int64_t conv_dim =
      2 * delta_key_heads * delta_head_dim + delta_value_heads * delta_head_dim;
  const int64_t recurrent = hidden * conv_dim + conv_dim * conv_kernel +
                            2 * hidden * delta_value_heads + delta_value_heads +
                            delta_value_heads * delta_head_dim * hidden;
  const int64_t mlp = 3 * hidden * mlp_hidden;
  int64_t total = vocab_size * hidden + hidden;
  for (char kind : pattern) total += 2 * hidden + mlp + (kind == 'R' ? recurrent : attention);
  return total;
}

}  // namespace kvsnap
