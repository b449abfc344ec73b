// Internal: the tier's cryptographic hashing, all from libsodium — BLAKE2b digests that chain
// key names over tokens (collision-resistant: a prompt cannot be crafted to land on another
// prompt's key) and the keyed BLAKE2b MAC that authenticates objects.
#pragma once

#include <sodium.h>

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace kvsnap::detail {

using Digest = std::array<unsigned char, 32>;

// Streaming BLAKE2b-256, keyed when `key` is not empty (16 to 64 bytes).
class Hasher {
 public:
  explicit Hasher(std::string_view key = {});
  Hasher& bytes(const void* data, size_t size);
  // A length-prefixed field: fields never run into each other.
  Hasher& field(std::string_view text);
  Hasher& number(int64_t value);
  Hasher& tokens(std::span<const int32_t> tokens);
  Hasher& digest(const Digest& value) { return bytes(value.data(), value.size()); }
  Digest finish();

 private:
  crypto_generichash_state state_;
};

// Lowercase hex of a digest (64 characters).
std::string hex(const Digest& digest);

// The MAC key derived from a key file's contents (any length >= 16).
std::string derive_mac_key(std::string_view material);
// The MAC of an object: keyed BLAKE2b-256 over the key name (length-prefixed) and its bytes.
Digest object_mac(std::string_view mac_key, std::string_view key_name, std::string_view bytes);
// Constant-time comparison of a stored tag with the expected one.
bool same_tag(const Digest& expected, std::string_view stored);

}  // namespace kvsnap::detail
