#include "tier/keys.h"

#include <unistd.h>

#include <charconv>

#include "cache/snapshot_record.h"

namespace kvsnap::detail {

std::string tier_layer_configuration(const std::vector<Cache*>& layers) {
  std::string out = "[";
  for (size_t i = 0; i < layers.size(); ++i) {
    if (i > 0) out += ',';
    out += describe_layer(layers[i]);
  }
  return out + "]";
}

std::string tier_key_id(const std::string& mac_key) {
  return mac_key.empty() ? "" : hex(object_mac(mac_key, "kvsnap tier key id", ""));
}

std::string tier_scope(const std::string& address, const std::string& mac_key) {
  if (!mac_key.empty()) return "key " + tier_key_id(mac_key);
  if (address.rfind("dir:", 0) == 0) return "user " + std::to_string(::geteuid());
  return "";
}

TierKeys::TierKeys(const std::string& model_fingerprint, const std::string& layer_configuration,
                   const std::string& tenant, int64_t chunk_tokens, const std::string& scope)
    : root_(Hasher()
                .field("kvsnap tier root")
                .number(kTierFormatVersion)
                .number(chunk_tokens)
                .field(model_fingerprint)
                .field(layer_configuration)
                .field(tenant)
                .field(scope)
                .finish()),
      root_hex_(hex(root_)),
      chunk_tokens_(chunk_tokens) {}

std::vector<Digest> TierKeys::chain(std::span<const int32_t> tokens, int64_t chunks) const {
  std::vector<Digest> out{root_};
  for (int64_t j = 0; j < chunks; ++j) {
    const auto chunk =
        tokens.subspan(static_cast<size_t>(j * chunk_tokens_), static_cast<size_t>(chunk_tokens_));
    out.push_back(Hasher().field("chunk").digest(out.back()).tokens(chunk).finish());
  }
  return out;
}

std::string TierKeys::chunk_key(const Digest& end) { return "kvsnap:c:" + hex(end); }

std::string TierKeys::index_key(const Digest& base) { return "kvsnap:i:" + hex(base); }

std::string TierKeys::point_key(const Digest& base, int64_t offset, std::span<const int32_t> tail) {
  return "kvsnap:p:" +
         hex(Hasher().field("point").digest(base).number(offset).tokens(tail).finish());
}

std::string TierKeys::index_member(int64_t offset, int64_t bytes) {
  return std::to_string(offset) + ':' + std::to_string(bytes);
}

std::optional<TierKeys::Member> TierKeys::parse_index_member(std::string_view member) {
  const auto number = [](std::string_view text, int64_t& out) {
    const char* end = text.data() + text.size();
    const auto [stop, error] = std::from_chars(text.data(), end, out);
    return error == std::errc() && stop == end && out >= 0;
  };
  Member parsed;
  const size_t colon = member.find(':');
  if (!number(member.substr(0, colon), parsed.offset)) return std::nullopt;
  if (colon != std::string_view::npos && !number(member.substr(colon + 1), parsed.bytes)) {
    return std::nullopt;
  }
  return parsed;
}

}  // namespace kvsnap::detail
