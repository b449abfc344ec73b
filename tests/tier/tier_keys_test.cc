// Tier object names: the root every name chains from binds the layer configuration and the chunk
// size, so tiers of other layers or chunk sizes never meet each other's objects.
#include <gtest/gtest.h>

#include <span>
#include <string>

#include "support/tier_support.h"
#include "tier/keys.h"

namespace kvsnap::tier_keys_test {
namespace {

using testing::HybridStack;
using testing::Tokens;
using testing::tokens;

// The names a tier of `layers` and `chunk_tokens` gives `prompt`'s first chunk and its restore
// points at 3 (inside the first chunk: named from the root and the 3 tokens alone) and at 20
// (the other parts of the root fixed).
struct Names {
  std::string chunk, point_3, point_20;
};
std::string point_name(const detail::TierKeys& keys, const Tokens& prompt, int64_t offset) {
  const int64_t chunks = offset / keys.chunk_tokens();
  const auto tail = std::span(prompt).subspan(static_cast<size_t>(chunks * keys.chunk_tokens()),
                                              static_cast<size_t>(offset % keys.chunk_tokens()));
  return detail::TierKeys::point_key(keys.chain(prompt, chunks).back(), offset, tail);
}
Names names_of(const std::string& layers, int64_t chunk_tokens, const Tokens& prompt) {
  const detail::TierKeys keys("model", layers, "tenant", chunk_tokens, "");
  return {detail::TierKeys::chunk_key(keys.chain(prompt, 1).back()), point_name(keys, prompt, 3),
          point_name(keys, prompt, 20)};
}

// Keys chain from a root of model fingerprint, layer configuration, format version and tenant
// salt (DESIGN.md, Tiers): tiers whose layers differ (another window) name the same prompt's
// chunks and restore points apart — the names, not only the configuration strings, differ — and
// so do tiers of other chunk sizes; the same configuration names them alike.
TEST(TierKeys, LayerConfigurationsAndChunkSizesNameObjectsApart) {
  const Tokens prompt = tokens(1, 20);
  HybridStack stack;
  HybridStack wider(true, 16);
  const std::string layers = detail::tier_layer_configuration(stack.layers());
  const std::string other_layers = detail::tier_layer_configuration(wider.layers());
  ASSERT_NE(other_layers, layers);
  const Names base = names_of(layers, 8, prompt);
  const Names again = names_of(layers, 8, prompt);
  EXPECT_EQ(again.chunk, base.chunk);
  EXPECT_EQ(again.point_3, base.point_3);
  EXPECT_EQ(again.point_20, base.point_20);
  const Names other = names_of(other_layers, 8, prompt);
  EXPECT_NE(other.chunk, base.chunk);
  EXPECT_NE(other.point_3, base.point_3);
  EXPECT_NE(other.point_20, base.point_20);
  // Chunk sizes: the point at 3 chains no chunk, so only the root can tell them apart.
  const Names four = names_of(layers, 4, prompt);
  EXPECT_NE(four.point_3, base.point_3);
  EXPECT_NE(four.point_20, base.point_20);
}

// Index members: "OFFSET:BYTES", or a bare offset (as written before sizes were); anything else
// is not a member of ours.
TEST(TierKeys, IndexMembersAreAnOffsetAndTheObjectsSize) {
  using detail::TierKeys;
  EXPECT_EQ(TierKeys::index_member(31, 4096), "31:4096");
  using Parsed = std::pair<int64_t, int64_t>;  // offset, bytes; -9, -9 when refused
  const auto parsed = [](std::string_view member) {
    const std::optional<TierKeys::Member> m = TierKeys::parse_index_member(member);
    return m ? Parsed(m->offset, m->bytes) : Parsed(-9, -9);
  };
  EXPECT_EQ(parsed("31:4096"), Parsed(31, 4096));
  EXPECT_EQ(parsed("31"), Parsed(31, -1));
  EXPECT_EQ(parsed("0:0"), Parsed(0, 0));
  EXPECT_EQ(parsed(TierKeys::index_member(INT64_MAX, INT64_MAX)), Parsed(INT64_MAX, INT64_MAX));
  for (const std::string_view bad : {"", ":", "31:", ":5", "-1", "31:-5", "x", "31:4x", "3 1", "+3",
                                     "31:4:5", "99999999999999999999", "31:1e3"}) {
    EXPECT_EQ(parsed(bad), Parsed(-9, -9)) << bad;
  }
}

}  // namespace
}  // namespace kvsnap::tier_keys_test
