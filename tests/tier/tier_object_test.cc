// A tier object's header is bounded by what its key and layers need (max_object_header) and
// refused past it before it is parsed.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "support/cache_support.h"
#include "support/test_support.h"
#include "tier/object.h"

namespace kvsnap::tier_object_test {
namespace {

uint64_t header_length(const std::string& value) {
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) {
    length |= static_cast<uint64_t>(static_cast<unsigned char>(value[static_cast<size_t>(i)]))
              << (8 * i);
  }
  return length;
}

// `value` with its header padded with spaces (which the format allows after the JSON) to
// `length` bytes: the same object, as a forger might hand it out.
std::string with_header_length(const std::string& value, uint64_t length) {
  const uint64_t old = header_length(value);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(length >> (8 * i));
  out += value.substr(8, old);
  out.append(length - old, ' ');
  out += value.substr(8 + old);
  return out;
}

// A store anyone can write to (no MAC key) could hand every process that looks a key up a
// header of 100 MiB, which costs GBs and seconds to parse. An object's header needs a few short
// metadata strings and two tensors a layer, well under the bound; one over it is refused with
// its length, before any parsing.
TEST(TierObject, AHeaderOverWhatItsKeyAndLayersNeedIsRefusedBeforeItIsParsed) {
  const testing::TokenKV kv;
  KVCache first, second;
  (void)testing::write(first, kv, testing::id_range(0, 12));
  (void)testing::write(second, kv, testing::id_range(50, 12));
  const SnapshotPtr a = first.snapshot(0), b = second.snapshot(0);
  const detail::ObjectSpec spec{detail::ObjectSpec::Kind::chunk, 0, 12};
  const std::string key = "kvsnap:tenant:model:chunk:0123456789abcdef";
  const std::string value =
      detail::encode_object(key, "root", spec, {detail::object_part(*a), detail::object_part(*b)});
  const std::vector<Cache*> layers{&first, &second};
  const uint64_t bound = detail::max_object_header(key, layers.size());
  EXPECT_LT(4 * header_length(value), bound);  // room for longer names and more metadata
  ASSERT_EQ(detail::decode_object(value, key, "root", spec, layers, "").size(), 2u);

  const uint64_t over = (bound / 8 + 1) * 8;  // kvsnap's writer pads to a multiple of 8
  try {
    (void)detail::decode_object(with_header_length(value, over), key, "root", spec, layers, "");
    ADD_FAILURE() << "a header of " << over << " bytes was read";
  } catch (const detail::ObjectRejected& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format(
                  "header length {} is over the {} bytes a header may have here", over, bound)),
              std::string::npos)
        << e.what();
  }
  // Padding within the bound passes the length and reaches the later checks: the checksum, which
  // covers the header's text, refuses it there.
  const uint64_t within = bound / 8 * 8;
  EXPECT_TRUE(testing::throws_error(
      [&] {
        (void)detail::decode_object(with_header_length(value, within), key, "root", spec, layers,
                                    "");
      },
      {"checksum"}));
}

}  // namespace
}  // namespace kvsnap::tier_object_test
