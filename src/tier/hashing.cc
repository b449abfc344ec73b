#include "tier/hashing.h"

#include <fmt/format.h>

#include <bit>

#include "kvsnap/error.h"

namespace kvsnap::detail {
namespace {

void initialize_sodium() {
  // Idempotent and thread-safe; -1 means the library cannot work at all (no randomness source).
  static const int status = sodium_init();
  if (status < 0) throw Error("kvsnap tier: libsodium failed to initialize (sodium_init)");
}

}  // namespace

Hasher::Hasher(std::string_view key) {
  initialize_sodium();
  if (!key.empty() && (key.size() < crypto_generichash_KEYBYTES_MIN ||
                       key.size() > crypto_generichash_KEYBYTES_MAX)) {
    throw Error(fmt::format("Hasher: a key of {} bytes is outside [{}, {}]", key.size(),
                            crypto_generichash_KEYBYTES_MIN, crypto_generichash_KEYBYTES_MAX));
  }
  crypto_generichash_init(&state_, reinterpret_cast<const unsigned char*>(key.data()), key.size(),
                          std::tuple_size_v<Digest>);
}

Hasher& Hasher::bytes(const void* data, size_t size) {
  crypto_generichash_update(&state_, static_cast<const unsigned char*>(data), size);
  return *this;
}

Hasher& Hasher::field(std::string_view text) {
  number(static_cast<int64_t>(text.size()));
  return bytes(text.data(), text.size());
}

Hasher& Hasher::number(int64_t value) {
  static_assert(std::endian::native == std::endian::little, "tier keys hash little-endian bytes");
  return bytes(&value, sizeof(value));
}

Hasher& Hasher::tokens(std::span<const int32_t> tokens) {
  return bytes(tokens.data(), tokens.size_bytes());
}

Digest Hasher::finish() {
  Digest out;
  crypto_generichash_final(&state_, out.data(), out.size());
  return out;
}

std::string hex(const Digest& digest) {
  std::string out(digest.size() * 2 + 1, '\0');
  sodium_bin2hex(out.data(), out.size(), digest.data(), digest.size());
  out.pop_back();
  return out;
}

std::string derive_mac_key(std::string_view material) {
  const Digest key = Hasher().field("kvsnap tier MAC key").field(material).finish();
  return std::string(reinterpret_cast<const char*>(key.data()), key.size());
}

Digest object_mac(std::string_view mac_key, std::string_view key_name, std::string_view bytes) {
  return Hasher(mac_key).field(key_name).bytes(bytes.data(), bytes.size()).finish();
}

bool same_tag(const Digest& expected, std::string_view stored) {
  return stored.size() == expected.size() &&
         sodium_memcmp(expected.data(), stored.data(), expected.size()) == 0;
}

}  // namespace kvsnap::detail
