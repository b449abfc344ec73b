// Internal: the names of tier objects. A root digest binds the format version, chunk size, model
// fingerprint, layer configuration, tenant salt and scope (MAC key id, or user); a hash chained
// from it over the prompt's tokens, one full chunk at a time, names
//   kvsnap:c:<h>  the KV data of the chunk that ends where digest h was taken,
//   kvsnap:i:<h>  the index of restore points after that digest, before the next chunk ends
//                 (a set of members "OFFSET:BYTES", each point's offset and its object's size),
//   kvsnap:p:<d>  one restore point: d hashes the chunk digest, the offset and the tail tokens.
// Everything a name depends on is hashed (BLAKE2b-256), so another model, layer layout, tenant,
// key or version never meets these names.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvsnap/cache.h"
#include "tier/hashing.h"

namespace kvsnap::detail {

// Objects of other versions are refused (their names differ too: the version is in the root).
inline constexpr int kTierFormatVersion = 1;

// The layers as part of the root: each one's describe_layer (kinds, windows, recurrent shapes).
std::string tier_layer_configuration(const std::vector<Cache*>& layers);

// What names a MAC key's objects apart from those of other keys and of processes without one
// (which would take them for damaged and delete them): a keyed digest of a constant, which does
// not reveal the key; empty for no key.
std::string tier_key_id(const std::string& mac_key);
// The scope of a tier's names: "key <tier_key_id>" with a MAC key; without one, "user <euid>" for
// a dir: store (which then trusts only this user's files: users sharing a folder would otherwise
// block each other's names) and empty for Redis (processes share it as the operator set it up).
std::string tier_scope(const std::string& address, const std::string& mac_key);

class TierKeys {
 public:
  // `scope`: tier_scope's.
  TierKeys(const std::string& model_fingerprint, const std::string& layer_configuration,
           const std::string& tenant, int64_t chunk_tokens, const std::string& scope);

  const std::string& root_hex() const { return root_hex_; }
  int64_t chunk_tokens() const { return chunk_tokens_; }
  // Digests h[0..chunks]: h[0] is the root, h[j + 1] chains h[j] with tokens of chunk j.
  // Requires tokens.size() >= chunks * chunk_tokens().
  std::vector<Digest> chain(std::span<const int32_t> tokens, int64_t chunks) const;

  // Chunk j's KV data, named by h[j + 1].
  static std::string chunk_key(const Digest& end);
  // The restore points in [j * chunk, (j + 1) * chunk), named by h[j].
  static std::string index_key(const Digest& base);
  // The restore point at `offset`, whose last full chunk ends at the digest `base`, followed by
  // `tail` (the tokens after it).
  static std::string point_key(const Digest& base, int64_t offset, std::span<const int32_t> tail);

  // An index member: a restore point's offset and its object's size as stored, MAC tag included
  // ("31:4096"), so a lookup passes over a point that cannot fit its bytes before fetching it.
  struct Member {
    int64_t offset = 0;
    int64_t bytes = -1;  // -1: not said (a bare "31", as members were written before sizes)
  };
  static std::string index_member(int64_t offset, int64_t bytes);
  // nullopt for anything else: not a number, a negative one, other characters.
  static std::optional<Member> parse_index_member(std::string_view member);

 private:
  Digest root_;
  std::string root_hex_;
  int64_t chunk_tokens_;
};

}  // namespace kvsnap::detail
