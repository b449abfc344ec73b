#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "model/model.h"
#include "model/strict_json.h"

namespace kvsnap {
namespace {

// The parameter count in 128 bits: validate holds every size to 2^20 first, so no product of
// four of them overflows.
__extension__ typedef __int128 Wide;  // __extension__: a GCC and Clang type, not ISO C++
Wide parameters(const ModelConfig& c) {
  const Wide h = c.hidden, q = Wide(c.query_heads) * c.head_dim, kv = Wide(c.kv_heads) * c.head_dim;
  const Wide conv =
      2 * Wide(c.delta_key_heads) * c.delta_head_dim + Wide(c.delta_value_heads) * c.delta_head_dim;
  const Wide recurrent = h * conv + conv * c.conv_kernel + 2 * h * c.delta_value_heads +
                         c.delta_value_heads + Wide(c.delta_value_heads) * c.delta_head_dim * h;
  const Wide attention = 2 * h * q + 2 * h * kv;
  Wide total = Wide(c.vocab_size) * h + h;
  for (char kind : c.pattern) {
    total += 2 * h + 3 * h * c.mlp_hidden + (kind == 'R' ? recurrent : attention);
  }
  return total;
}

}  // namespace

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
  // RoPE turns positions into f32 angles: exact up to 2^24.
  require(context_length >= 1 && context_length <= (int64_t(1) << 24), "context_length",
          context_length, "need 1 <= context_length <= 2^24 (positions exact in f32)");
  // Each size at most 2^20, and the parameters at most 2^40 (4 TiB of f32): products of sizes
  // (q = query_heads * head_dim, the weights' element counts) then stay far from overflow.
  constexpr int64_t kMostSize = int64_t(1) << 20;
  for (const auto& [field, value] : {std::pair{"hidden", hidden},
                                     {"mlp_hidden", mlp_hidden},
                                     {"query_heads", query_heads},
                                     {"kv_heads", kv_heads},
                                     {"head_dim", head_dim},
                                     {"window", window},
                                     {"conv_kernel", conv_kernel},
                                     {"delta_key_heads", delta_key_heads},
                                     {"delta_value_heads", delta_value_heads},
                                     {"delta_head_dim", delta_head_dim}}) {
    require(value <= kMostSize, field, value, "need <= 2^20");
  }
  require(static_cast<int64_t>(pattern.size()) <= kMostSize, "pattern's layers",
          static_cast<int64_t>(pattern.size()), "need <= 2^20");
  if (pattern.empty() || pattern.find_first_not_of("ASR") != std::string::npos) {
    throw Error(
        fmt::format("ModelConfig: pattern \"{}\": need one or more of 'A' (attention), "
                    "'S' (sliding window), 'R' (recurrent)",
                    pattern));
  }
  {
    if (parameters(*this) > (Wide(1) << 40)) {
      throw Error(fmt::format(
          "ModelConfig: {} layers of hidden {} (query_heads {}, head_dim {}, mlp_hidden {}): "
          "more than 2^40 parameters",
          pattern.size(), hidden, query_heads, head_dim, mlp_hidden));
    }
  }
  // What a recurrent layer holds per sequence: the conv tail's channels (RecurrentCache takes an
  // int) and the delta state, at most 2^28 floats (1 GiB) per sequence and layer.
  const Wide conv = (2 * Wide(delta_key_heads) + delta_value_heads) * delta_head_dim;
  const Wide state = Wide(delta_value_heads) * delta_head_dim * delta_head_dim;
  const bool recurrent = pattern.find('R') != std::string::npos;
  if (recurrent && (conv > std::numeric_limits<int32_t>::max() || state > (Wide(1) << 28))) {
    throw Error(fmt::format(
        "ModelConfig: delta_key_heads {}, delta_value_heads {}, delta_head_dim {}: a recurrent "
        "layer's state of {} floats per sequence (at most 2^28) and {} conv channels (at most "
        "2^31 - 1)",
        delta_key_heads, delta_value_heads, delta_head_dim, static_cast<int64_t>(state),
        static_cast<int64_t>(conv)));
  }
  // rope_theta >= 1 keeps every inverse frequency, and so every angle, finite (1e-45 made them
  // infinite: every logit NaN). Both finite: an infinite rms_eps scales every activation to 0,
  // and to_json writes an infinity as null, which from_json refuses.
  if (!(rope_theta >= 1.0f) || !(rms_eps > 0.0f) || !std::isfinite(rope_theta) ||
      !std::isfinite(rms_eps)) {
    throw Error(
        fmt::format("ModelConfig: rope_theta {} must be finite and >= 1, and rms_eps {} finite and "
                    "positive",
                    rope_theta, rms_eps));
  }
}

ModelConfig ModelConfig::from_json(const std::string& text) {
  nlohmann::json json;
  try {
    json = detail::parse_without_duplicate_keys(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("ModelConfig: not valid JSON ({})", e.what()));
  } catch (const detail::DuplicateKey& duplicate) {
    throw Error(fmt::format("ModelConfig: field \"{}\" is given twice", duplicate.key));
  }
  if (!json.is_object()) throw Error("ModelConfig: the config must be a JSON object");
  ModelConfig config;
  for (const auto& [key, value] : json.items()) {
    // Whole numbers for sizes (4096.9 is not silently 4096, nor 1e300 undefined), finite
    // numbers for the floats (1e39 as a float is infinity), a non-negative seed.
    const auto integer = [&, &key = key, &value = value](int64_t& field) {
      if (!value.is_number_integer() ||
          (value.is_number_unsigned() && value.get<uint64_t>() > uint64_t(INT64_MAX))) {
        throw Error(
            fmt::format("ModelConfig: field \"{}\" must be an integer ({})", key, value.dump()));
      }
      field = value.get<int64_t>();
    };
    const auto finite = [&, &key = key, &value = value](float& field) {
      if (!value.is_number() || !std::isfinite(value.get<double>()) ||
          !std::isfinite(value.get<float>())) {
        throw Error(fmt::format("ModelConfig: field \"{}\" must be a finite number ({})", key,
                                value.dump()));
      }
      field = value.get<float>();
    };
    try {
      if (key == "vocab_size")
        integer(config.vocab_size);
      else if (key == "hidden")
        integer(config.hidden);
      else if (key == "mlp_hidden")
        integer(config.mlp_hidden);
      else if (key == "query_heads")
        integer(config.query_heads);
      else if (key == "kv_heads")
        integer(config.kv_heads);
      else if (key == "head_dim")
        integer(config.head_dim);
      else if (key == "window")
        integer(config.window);
      else if (key == "pattern")
        config.pattern = value.get<std::string>();
      else if (key == "conv_kernel")
        integer(config.conv_kernel);
      else if (key == "delta_key_heads")
        integer(config.delta_key_heads);
      else if (key == "delta_value_heads")
        integer(config.delta_value_heads);
      else if (key == "delta_head_dim")
        integer(config.delta_head_dim);
      else if (key == "rope_theta")
        finite(config.rope_theta);
      else if (key == "rms_eps")
        finite(config.rms_eps);
      else if (key == "seed") {
        if (!value.is_number_unsigned()) {
          throw Error(fmt::format("ModelConfig: field \"seed\" must be an integer >= 0 ({})",
                                  value.dump()));
        }
        config.seed = value.get<uint64_t>();
      } else if (key == "context_length")
        integer(config.context_length);
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

int64_t ModelConfig::parameter_count() const { return static_cast<int64_t>(parameters(*this)); }

double ModelConfig::forward_flops(int64_t offset, int64_t tokens) const {
  if (tokens <= 0) return 0.0;
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const double h = d(hidden), q = d(query_heads) * d(head_dim), kv = d(kv_heads) * d(head_dim);
  const double channels = (2 * d(delta_key_heads) + d(delta_value_heads)) * d(delta_head_dim);
  const double values = d(delta_value_heads) * d(delta_head_dim);
  // Columns the tokens see in all, when each sees at most `limit` (positions are 0-based: the
  // token at p sees p + 1): seen(n) is the sum over x in [1, n] of min(x, limit).
  const auto columns = [&](double limit) {
    const auto seen = [&](double n) {
      return n <= limit ? n * (n + 1) / 2 : limit * (limit + 1) / 2 + (n - limit) * limit;
    };
    return seen(d(offset) + d(tokens)) - seen(d(offset));
  };
  double per_token = 0, attention = 0;  // multiply-adds
  for (const char kind : pattern) {
    per_token += 3 * h * d(mlp_hidden);
    if (kind == 'R') {
      per_token += h * channels + 2 * h * d(delta_value_heads) + values * h +
                   d(conv_kernel) * channels + 3 * values * d(delta_head_dim);
      continue;
    }
    per_token += 2 * h * q + 2 * h * kv;
    // Scores (head_dim per query head) and weighted values (as many) per column seen.
    attention += 2 * q * columns(kind == 'A' ? std::numeric_limits<double>::infinity() : d(window));
  }
  return 2 * (d(tokens) * per_token + attention + h * d(vocab_size));
}

}  // namespace kvsnap
