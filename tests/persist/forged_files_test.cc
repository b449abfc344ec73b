// Damaged or forged snapshot files (some with a recomputed checksum: it detects damage, not
// tampering) are rejected whole with a kvsnap::Error that names the file — never a crash, never
// another exception, never an allocation a forged length asks for.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "persist/files.h"
#include "persist/safetensors.h"
#include "support/cache_support.h"
#include "support/private_support.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap::forged_files_test {
namespace {

using testing::id_range;
using testing::throws_error;
using testing::TokenKV;

const TokenKV kv{.heads = 2, .depth = 4};

std::filesystem::path scratch(const std::string& name) {
  return testing::private_scratch_file("forged", name);
}

// A safetensors file whose JSON header is `header` (padded), with no data.
std::string with_header(std::string header) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header;
}

std::string nested(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// nlohmann parses deep nesting without recursion, but rendering a value (dump) recurses once
// per level: a header 100000 levels deep must be refused, not rendered into a message.
TEST(ForgedFiles, DeeplyNestedJsonIsRejectedCleanly) {
  const std::string deep = nested(100000);
  const std::string headers[] = {
      R"({"t":{"dtype":)" + deep + R"(,"shape":[],"data_offsets":[0,0]}})",
      R"({"t":{"dtype":"F32","shape":[)" + deep + R"(],"data_offsets":[0,0]}})",
      R"({"t":{"dtype":"F32","shape":[],"data_offsets":)" + deep + "}}",
      R"({"__metadata__":{"format":)" + deep + "}}",
  };
  for (const std::string& header : headers) {
    const std::string bytes = with_header(header);
    EXPECT_TRUE(throws_error([&] { (void)decode_snapshots(bytes, "deep.safetensors"); },
                             {"safetensors deep.safetensors", "deeper than"}));
  }
  const auto path = scratch("deep.safetensors");
  { std::ofstream(path, std::ios::binary) << with_header(headers[0]); }
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path.string()); },
                           {path.string().c_str(), "deeper than"}));
  std::filesystem::remove_all(path.parent_path());
}

// What an error message shows of a value read from a file is short, however long the value:
// a long string is shown cut; an entry of more values than a tensor's takes is refused as the
// header is read, naming the tensor.
TEST(ForgedFiles, AnOverlongValueIsDescribedBriefly) {
  std::string long_array = "[0";
  for (int i = 0; i < 200000; ++i) long_array += ",0";
  long_array += "]";
  const std::string long_string = '"' + std::string(500000, 'x') + '"';
  for (const auto& [value, expected] :
       {std::pair{long_array, "the header has tensor \"t\" of more than 64 JSON values"},
        std::pair{long_string, "unknown dtype"}}) {
    const std::string bytes =
        with_header(R"({"t":{"dtype":)" + value + R"(,"shape":[],"data_offsets":[0,0]}})");
    try {
      (void)decode_snapshots(bytes, "long.safetensors");
      ADD_FAILURE() << "accepted";
    } catch (const Error& error) {
      EXPECT_LT(std::string(error.what()).size(), 400u) << std::string(error.what()).substr(0, 400);
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
    }
  }
}

// A header is read in one pass that never holds it whole as JSON values (which cost several
// times its length: a forged 100 MiB header took 2-4 GB and 12-20 s): each tensor entry is
// built alone, at most 64 values (a tensor's takes 10: its object, dtype, shape of up to 4
// extents, data_offsets of 2), and read as it closes, so the first bad one ends the read;
// __metadata__ holds at most 2^20 + 64 strings (a snapshot file's layers and a few more). Small
// forgeries (a shape of 5 extents) get the checks that say exactly what is wrong.
TEST(ForgedFiles, AHeaderIsReadEntryByEntryWithinBounds) {
  std::string many_objects = R"({"t":[{})";
  for (int i = 0; i < 100000; ++i) many_objects += ",{}";
  many_objects += "]}";
  std::string many_entries = "{";  // each of ten values, as a tensor's, but none a tensor
  for (int i = 0; i < 100000; ++i)
    many_entries += fmt::format(R"("k{}":[{{}},{{}},{{}},{{}},{{}},{{}},{{}},{{}},{{}}],)", i);
  many_entries.back() = '}';
  std::string many_members = R"({"__metadata__":{)";
  for (int i = 0; i < (1 << 20) + 65; ++i) many_members += fmt::format(R"("{}":"",)", i);
  many_members += R"("last":""}})";
  for (const auto& [header, expected] :
       {std::pair{many_objects, "the header has tensor \"t\" of more than 64 JSON values"},
        std::pair{many_entries, "tensor \"k0\" lacks dtype, shape or data_offsets"},
        std::pair{many_members, "the header has __metadata__ of more than 1048640 members"},
        std::pair{std::string(R"({"t":{"dtype":"F32","shape":[1,1,1,1,1],)"
                              R"("data_offsets":[0,0]}})"),
                  "has shape [1,1,1,1,1] (need at most 4 extents)"},
        std::pair{std::string(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                              R"("t":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})"),
                  "tensor \"t\" appears twice"},
        std::pair{std::string(R"({"__metadata__":{"a":"b","c":["d"]}})"),
                  "metadata \"c\" is not a string"},
        std::pair{std::string(R"({"__metadata__":"x"})"), "__metadata__ is not an object"},
        std::pair{std::string(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"),
                  "the header is not valid JSON"}}) {
    EXPECT_TRUE(
        throws_error([&] { (void)detail::decode_safetensors(with_header(header), "costly"); },
                     {"safetensors costly: ", expected}))
        << expected;
  }
  // Within the bounds: metadata strings and entries of 10 values each are read.
  std::string metadata = R"({"__metadata__":{)";
  for (int i = 0; i < 1023; ++i) metadata += fmt::format(R"("{}":"",)", i);
  metadata += R"("last":""},)";
  std::string entries = metadata;
  for (int i = 0; i < 100; ++i) {
    entries += fmt::format(R"("t{}":{{"dtype":"F32","shape":[1,1,1,0],)"
                           R"("data_offsets":[0,0]}},)",
                           i);
  }
  entries.back() = '}';
  const detail::SafetensorsFile file = detail::decode_safetensors(with_header(entries), "within");
  EXPECT_EQ(file.metadata.size(), 1024u);
  EXPECT_EQ(file.tensors.size(), 100u);
}

// Entries whose data overlaps are refused at the first one past the data section's size, before
// its data is copied: 1000 entries over the whole of 1 MiB asked for 1000 copies of it (1 GB)
// before the coverage check saw the overlap. Names in messages are shown cut, however long.
TEST(ForgedFiles, OverlappingEntriesAreRefusedBeforeTheirDataIsCopied) {
  constexpr int64_t kFloats = 1 << 18;  // 1 MiB
  std::string header = "{";
  for (int i = 0; i < 1000; ++i) {
    header += fmt::format(R"("a{}":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{}]}},)", i,
                          kFloats, 4 * kFloats);
  }
  header.back() = '}';
  const std::string bytes = with_header(header) + std::string(4 * kFloats, '\0');
  EXPECT_TRUE(throws_error([&] { (void)detail::decode_safetensors(bytes, "overlap"); },
                           {"safetensors overlap: with tensor \"a1\" (data_offsets [0, "
                            "1048576)) the tensors take more than the 1048576-byte data "
                            "section: some overlap"}));
  const std::string long_name(100000, 'n');
  try {
    (void)detail::decode_safetensors(
        with_header(R"({")" + long_name + R"(":{"dtype":"X","shape":[],"data_offsets":[0,0]}})"),
        "long");
    ADD_FAILURE() << "accepted";
  } catch (const Error& error) {
    EXPECT_LT(std::string(error.what()).size(), 200u) << std::string(error.what()).substr(0, 300);
    EXPECT_NE(std::string(error.what()).find(R"(tensor "nnnnnnnn)"), std::string::npos);
  }
}

// The product of the extents is checked before it can wrap (and with zero extents ignored: the
// strides of [0, 2^40, 2^40, 2^40] overflow too); the error names the file and the tensor.
TEST(ForgedFiles, ShapesWhoseProductOverflowsAreRejectedNamingTheFileAndTensor) {
  for (const char* shape : {"[1099511627776,16777216]", "[16777216,16777216,16777216]",
                            "[0,1099511627776,1099511627776,1099511627776]"}) {
    const std::string bytes = with_header(std::string(R"({"big":{"dtype":"F32","shape":)") + shape +
                                          R"(,"data_offsets":[0,0]}})");
    EXPECT_TRUE(throws_error([&] { (void)detail::decode_safetensors(bytes, "forged.safetensors"); },
                             {"safetensors forged.safetensors", "tensor \"big\"", "too large"}))
        << shape;
  }
}

// A file far larger than the machine's memory (sparse: it takes no disk) is refused before a
// byte of it is read or reserved.
TEST(ForgedFiles, AFileTooLargeToLoadIsRefusedBeforeItIsRead) {
  const auto path = scratch("huge.safetensors");
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, off_t(1) << 40), 0);
    ::close(fd);
  }
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path.string()); },
                           {"load_snapshots", path.string().c_str(), "1099511627776 bytes"}));
  std::filesystem::remove_all(path.parent_path());
}

// A caller's own limit, and a file that is not a regular one (whose size says nothing): reading
// stops at the limit.
TEST(ForgedFiles, ReadingStopsAtTheLimit) {
  const auto path = scratch("sixteen");
  { std::ofstream(path, std::ios::binary) << "0123456789abcdef"; }
  const detail::PrivacyRule rule{.call = "test", .override_with = ""};
  EXPECT_EQ(detail::read_private_file(path.string(), rule, 16), "0123456789abcdef");
  EXPECT_TRUE(throws_error([&] { (void)detail::read_private_file(path.string(), rule, 15); },
                           {"test: cannot load", path.string().c_str(), "16 bytes", "15 bytes"}));
  std::filesystem::remove_all(path.parent_path());
  const detail::PrivacyRule shared{.call = "test", .override_with = "", .allow_shared = true};
  EXPECT_TRUE(throws_error([&] { (void)detail::read_private_file("/dev/zero", shared, 1 << 20); },
                           {"/dev/zero"}));
}

// A file's offset is one every layer's snapshot can restore (what restore(s, loaded.offset)
// needs): save refuses another, and a file forged to hold one is rejected.
TEST(ForgedFiles, AnOffsetALayerCannotRestoreIsRefused) {
  KVCache attention;
  RotatingKVCache window(6), wide(16);
  testing::RecurrentLayer layer;
  RecurrentCache recurrent = layer.make_cache();
  testing::write(attention, kv, id_range(0, 3));
  testing::write(window, kv, id_range(0, 9));
  testing::write(wide, kv, id_range(0, 9));
  layer.forward(recurrent, id_range(0, 9));
  const SnapshotPtr range = attention.snapshot(0), evicted = window.snapshot(0),
                    whole = wide.snapshot(0), state = recurrent.snapshot(0);
  const auto save = [](int64_t offset, const Snapshot* s) {
    return encode_snapshots(offset, std::vector<const Snapshot*>{s});
  };
  EXPECT_TRUE(throws_error([&] { (void)save(5, range.get()); },
                           {"save_snapshots", "layer 0", "[0, 3)", "offset 5"}));
  EXPECT_TRUE(throws_error([&] { (void)save(8, evicted.get()); },
                           {"save_snapshots", "layer 0", "window of 6 ending at 9", "offset 8"}));
  EXPECT_TRUE(throws_error([&] { (void)save(10, whole.get()); }, {"offset 10"}));
  EXPECT_TRUE(throws_error([&] { (void)save(8, state.get()); },
                           {"save_snapshots", "layer 0", "recurrent state at 9", "offset 8"}));
  // What restore can reach saves and loads: any offset of a range, an earlier one of a window
  // that evicted nothing.
  for (const auto& [offset, s] :
       {std::pair{int64_t{0}, range.get()}, std::pair{int64_t{3}, range.get()},
        std::pair{int64_t{9}, evicted.get()}, std::pair{int64_t{4}, whole.get()},
        std::pair{int64_t{9}, state.get()}}) {
    EXPECT_EQ(decode_snapshots(save(offset, s), "good").offset, offset);
  }
  detail::SafetensorsFile file = detail::decode_safetensors(save(3, range.get()), "good");
  file.metadata["offset"] = "5";
  EXPECT_TRUE(throws_error([&] { (void)decode_snapshots(detail::encode_sealed(file), "forged"); },
                           {"forged", "layer.0", "[0, 3)", "offset 5"}));
  // Integers are decimal digits after an optional '-', nothing else; a long value shows cut.
  for (const char* offset : {" 3", "+3", "3 ", "0x3", "", "3.0"}) {
    file.metadata["offset"] = offset;
    EXPECT_TRUE(throws_error([&] { (void)decode_snapshots(detail::encode_sealed(file), "forged"); },
                             {"forged", "metadata \"offset\" = \"", "is not an integer in [0, "}))
        << '"' << offset << '"';
  }
  file.metadata["offset"] = std::string(100000, '7');
  try {
    (void)decode_snapshots(detail::encode_sealed(file), "forged");
    ADD_FAILURE() << "accepted";
  } catch (const Error& error) {
    EXPECT_LT(std::string(error.what()).size(), 200u);
  }
  // A layer's entry is a kind and three integers at most: one of more values is refused before it
  // is parsed (extra members are otherwise ignored: this one would load).
  std::string padded = R"({"kind":"kv","from":0,"to":3,"padding":[0)";
  for (int i = 0; i < 100000; ++i) padded += ",0";
  file.metadata["offset"] = "3";
  file.metadata["layer.0"] = padded + "]}";
  EXPECT_TRUE(throws_error([&] { (void)decode_snapshots(detail::encode_sealed(file), "forged"); },
                           {"forged",
                            "metadata \"layer.0\" holds 100006 JSON values, more than "
                            "the 64 it may"}));
}

// A sealed file read in parts (read_sealed: what PrefixCache::load reads a tensor at a time)
// decodes as the whole bytes do, its seal checked over every byte; a source that ends before the
// size it was opened with, or goes on past it, is refused.
TEST(SealedFile, ReadInPartsAsWholeAndRefusedWhenItChangesSize) {
  detail::SafetensorsFile file;
  file.tensors.emplace_back("a", Array::from_floats(std::vector<float>{1, 2, 3}, {3}));
  file.tensors.emplace_back("b", Array::from_ints(std::vector<int32_t>{4, 5}, {2}));
  file.metadata["format"] = "test";
  std::string bytes = detail::encode_sealed(file);
  const detail::SealedFile sealed = detail::read_sealed(bytes, "t");
  EXPECT_NO_THROW(detail::check_seal(sealed, "t"));
  EXPECT_EQ(sealed.file.metadata.at("format"), "test");
  EXPECT_EQ(sealed.file.at("a", "t").to_floats(), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(sealed.file.at("b", "t").to_ints(), (std::vector<int32_t>{4, 5}));
  // One bit of the data flipped: decoded, and refused by its seal.
  std::string damaged = bytes;
  damaged[damaged.size() - 1] ^= 0x01;
  EXPECT_TRUE(throws_error([&] { detail::check_seal(detail::read_sealed(damaged, "t"), "t"); },
                           {"t: checksum", "does not match the contents", "the file is damaged"}));
  // Sources of another length than the size they were opened with.
  const auto reader = [](const std::string& source) {
    return [&source, at = size_t{0}](char* into, size_t n) mutable {
      n = std::min(n, source.size() - at);
      std::memcpy(into, source.data() + at, n);
      at += n;
      return n;
    };
  };
  const std::string shorter = bytes.substr(0, bytes.size() - 4);
  const std::string ends = fmt::format("safetensors t: it ends at byte {}, before the {} bytes",
                                       shorter.size(), bytes.size());
  EXPECT_TRUE(throws_error([&] { (void)detail::read_sealed(reader(shorter), bytes.size(), "t"); },
                           {ends.c_str()}));
  const std::string cut = bytes.substr(0, 5);  // inside the header's length
  EXPECT_TRUE(throws_error([&] { (void)detail::read_sealed(reader(cut), bytes.size(), "t"); },
                           {"safetensors t: it ends at byte 5, before the"}));
  const std::string longer = bytes + "more";
  EXPECT_TRUE(throws_error([&] { (void)detail::read_sealed(reader(longer), bytes.size(), "t"); },
                           {"safetensors t: it holds more than the"}));
}

// A read that does not keep a tensor hashes it as it passes and leaves it an outline (its shape
// and dtype, zero strides, nothing allocated): the seal still covers its bytes. The filter is
// asked in data order, with the data of the tensors kept before it.
TEST(SealedFile, ATensorNotKeptIsHashedNotHeld) {
  detail::SafetensorsFile file;
  file.tensors.emplace_back("a", Array::from_ints(std::vector<int32_t>{7, 8}, {2}));
  std::vector<float> big(3 << 18);  // 3 MiB: passed over in parts
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i % 1000);
  file.tensors.emplace_back("b", Array::from_floats(big, {3, 1 << 18}));
  file.tensors.emplace_back("c", Array::from_floats(std::vector<float>{1, 2}, {2}));
  const std::string bytes = detail::encode_sealed(file);
  std::vector<size_t> asked;
  const detail::TensorFilter keep = [&](size_t index, const detail::SafetensorsFile& seen) {
    asked.push_back(index);
    if (index > 0) {
      EXPECT_EQ(seen.at("a", "t").to_ints(), (std::vector<int32_t>{7, 8}));
    }
    return index != 1;
  };
  const detail::SealedFile sealed = detail::read_sealed(bytes, "t", keep);
  EXPECT_EQ(asked, (std::vector<size_t>{0, 1, 2}));
  EXPECT_NO_THROW(detail::check_seal(sealed, "t"));
  const Array& passed = sealed.file.at("b", "t");
  EXPECT_EQ(passed.dtype(), DType::f32);
  EXPECT_EQ(passed.shape(), (Shape{3, 1 << 18}));
  EXPECT_EQ(passed.strides(), (Shape{0, 0}));
  EXPECT_EQ(sealed.file.at("c", "t").to_floats(), (std::vector<float>{1, 2}));
  // A bit flipped in the tensor passed over, in its last part: refused by the seal.
  std::string damaged = bytes;
  damaged[damaged.size() - 9 - 4 * 1000] ^= 0x01;
  EXPECT_TRUE(
      throws_error([&] { detail::check_seal(detail::read_sealed(damaged, "t", keep), "t"); },
                   {"t: checksum", "does not match the contents", "the file is damaged"}));
}

}  // namespace
}  // namespace kvsnap::forged_files_test
