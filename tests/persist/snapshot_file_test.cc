#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cache/snapshot_record.h"
#include "persist/files.h"
#include "persist/safetensors.h"
#include "support/cache_support.h"
#include "support/private_support.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::id_range;
using testing::throws_error;
using testing::TokenKV;

const TokenKV kv{.heads = 2, .depth = 4, .dtype = DType::bf16};

std::filesystem::path scratch(const std::string& name) {
  return testing::private_scratch_file("persist", name);
}

// Bytes of every array of a snapshot's record, and its offsets: equal iff bit-exact.
std::string fingerprint(const Snapshot& s) {
  const auto record = detail::snapshot_record(s);
  std::string out = std::to_string(static_cast<int>(record->kind)) + " " +
                    std::to_string(record->from) + " " + std::to_string(record->to) + " ";
  for (const Array* a : {&record->first, &record->second}) {
    const Array c = a->contiguous();
    out += c.describe();
    out.append(static_cast<const char*>(c.bytes()), static_cast<size_t>(c.nbytes()));
  }
  return out;
}

struct Fixture {
  KVCache attention;
  RotatingKVCache window{6};
  testing::RecurrentLayer layer;
  RecurrentCache recurrent = layer.make_cache();
  std::vector<SnapshotPtr> snapshots;

  Fixture() {
    testing::write(attention, kv, id_range(0, 9));
    testing::write(window, kv, id_range(0, 9));
    layer.forward(recurrent, id_range(0, 9));
    snapshots.push_back(attention.snapshot(3));  // lazy KV [3, 9)
    snapshots.push_back(nullptr);                // a stateless layer
    snapshots.push_back(window.snapshot(0));     // lazy window at 9
    snapshots.push_back(recurrent.snapshot(0));  // recurrent state at 9
  }
};

TEST(SnapshotFile, RoundTripsEveryKindBitExactly) {
  Fixture f;
  const auto path = scratch("all.safetensors");
  save_snapshots(path.string(), 9, f.snapshots);
  EXPECT_TRUE(f.snapshots[0]->is_lazy());  // saving reads lazy snapshots, it does not copy them out
  const LoadedSnapshots loaded = load_snapshots(path.string());
  EXPECT_EQ(loaded.offset, 9);
  ASSERT_EQ(loaded.snapshots.size(), 4u);
  EXPECT_EQ(loaded.snapshots[1], nullptr);
  for (size_t i : {0u, 2u, 3u}) {
    ASSERT_NE(loaded.snapshots[i], nullptr);
    EXPECT_FALSE(loaded.snapshots[i]->is_lazy());
    EXPECT_EQ(fingerprint(*loaded.snapshots[i]), fingerprint(*f.snapshots[i])) << i;
  }
}

// A paged snapshot is saved from its blocks, tokens straight into the file (no gather of them
// first): the same bytes as the contiguous cache's snapshot of the same tokens, and it loads
// back bit-exactly.
TEST(SnapshotFile, APagedSnapshotIsSavedFromItsBlocksAsAContiguousOneWouldBe) {
  KVCache contiguous;
  PagedKVCache paged({.block_tokens = 4});
  (void)testing::write(contiguous, kv, id_range(0, 14));
  (void)testing::write(paged, kv, id_range(0, 14));
  const SnapshotPtr whole = contiguous.snapshot(3), blocks = paged.snapshot(3);
  const std::vector<const Snapshot*> from_blocks{blocks.get()}, from_whole{whole.get()};
  const int64_t allocations = allocation_count();
  const std::string bytes = encode_snapshots(14, from_blocks);
  EXPECT_EQ(allocation_count(), allocations);
  EXPECT_EQ(bytes, encode_snapshots(14, from_whole));
  const LoadedSnapshots loaded = decode_snapshots(bytes, "paged");
  ASSERT_EQ(loaded.snapshots.size(), 1u);
  EXPECT_EQ(fingerprint(*loaded.snapshots[0]), fingerprint(*blocks));
}

// The format has no padding: a tensor after a 2-byte one of odd size starts unaligned for its
// dtype. Encoding (strided views too) and decoding still give the exact values.
TEST(Safetensors, TensorsAfterAnOddSizedHalfPrecisionOneRoundTrip) {
  std::mt19937 rng(9);
  detail::SafetensorsFile file;
  file.tensors.emplace_back("odd", testing::random_array({1, 3, 1}, rng, DType::f16));
  const Array wide = testing::random_array({2, 5, 3}, rng);
  file.tensors.emplace_back("after", wide.slice(1, 1, 4));  // strided
  file.tensors.emplace_back("ints", Array::from_ints(std::vector<int32_t>{7, -8, 9}, {3}));
  file.tensors.emplace_back("last", testing::random_array({3}, rng, DType::bf16));
  const detail::SafetensorsFile back =
      detail::decode_safetensors(detail::encode_safetensors(file), "test");
  ASSERT_EQ(back.tensors.size(), file.tensors.size());
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const Array& a = file.tensors[i].second;
    const Array& b = back.at(file.tensors[i].first, "test");
    ASSERT_EQ(b.shape(), a.shape());
    ASSERT_EQ(b.dtype(), a.dtype());
    EXPECT_EQ(b.to_floats(), a.to_floats()) << file.tensors[i].first;
  }
}

// A decoded file is read by name through an index of its tensors (one lookup each, not a search
// of all of them: a file of many tensors read in full would otherwise cost N^2 / 2 comparisons);
// a name it does not hold is missing; a file assembled by hand, without the index, is searched.
TEST(Safetensors, ADecodedFileIsReadByNameThroughAnIndex) {
  detail::SafetensorsFile file;
  constexpr int kTensors = 1000;
  for (int i = 0; i < kTensors; ++i) {
    file.tensors.emplace_back(fmt::format("t{}", i),
                              Array::from_ints(std::vector<int32_t>{i}, {1}));
  }
  EXPECT_EQ(file.at("t7", "test").to_floats(), std::vector<float>{7});  // searched
  const detail::SafetensorsFile back =
      detail::decode_safetensors(detail::encode_safetensors(file), "test");
  ASSERT_EQ(back.index.size(), back.tensors.size());
  for (int i = 0; i < kTensors; ++i) {
    const std::string name = fmt::format("t{}", i);
    ASSERT_EQ(back.tensors[back.index.at(name)].first, name);
    ASSERT_EQ(back.at(name, "test").to_floats(), std::vector<float>{static_cast<float>(i)});
  }
  EXPECT_TRUE(testing::throws_error([&] { (void)back.at("t1000", "test"); },
                                    {"test: tensor \"t1000\" is missing"}));
}

TEST(SnapshotFile, OwnedAndWrappedSnapshotsRoundTrip) {
  std::vector<SnapshotPtr> snapshots;
  {
    RotatingKVCache window(4);
    for (int i = 0; i < 11; ++i) testing::write(window, kv, id_range(i, 1));  // a wrapped ring
    snapshots.push_back(window.snapshot(0));  // lazy in two runs of the ring
  }                                           // the cache copies it out as it goes
  ASSERT_FALSE(snapshots[0]->is_lazy());
  const std::string bytes = encode_snapshots(11, std::vector<const Snapshot*>{snapshots[0].get()});
  const LoadedSnapshots loaded = decode_snapshots(bytes, "memory");
  EXPECT_EQ(fingerprint(*loaded.snapshots[0]), fingerprint(*snapshots[0]));
}

TEST(SnapshotFile, RestoringALoadedSnapshotGivesTheSameAttention) {
  Fixture f;
  const auto path = scratch("attention.safetensors");
  save_snapshots(path.string(), 9, f.snapshots);
  const LoadedSnapshots loaded = load_snapshots(path.string());
  std::mt19937 rng(3);
  const Array q = testing::random_array({1, 4, 1, 4}, rng);
  const std::vector<int64_t> next{77};
  const Batch batch = Batch::uniform(1, 1, 9);
  // The original cache, and a fresh one holding [0, 3) and then the loaded [3, 9).
  const Array expected = sdpa(batch, q, f.attention.update(batch, kv.keys(next), kv.values(next)),
                              AttentionMask::causal(), 0.5f);
  KVCache fresh;
  testing::write(fresh, kv, id_range(0, 3));
  ASSERT_TRUE(fresh.restore(loaded.snapshots[0].get(), loaded.offset));
  const Array got = sdpa(batch, q, fresh.update(batch, kv.keys(next), kv.values(next)),
                         AttentionMask::causal(), 0.5f);
  EXPECT_TRUE(testing::all_close(got, expected, 0.0f));
  RecurrentCache recurrent = f.layer.make_cache();
  ASSERT_TRUE(recurrent.restore(loaded.snapshots[3].get(), 9));
  EXPECT_TRUE(testing::all_close(recurrent.state()[1], f.recurrent.state()[1], 0.0f));
}

// The file's header JSON, edited by `edit`, with the data as it was.
std::string with_header(const std::string& bytes,
                        const std::function<void(nlohmann::json&)>& edit) {
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i)
    length |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, length));
  edit(header);
  const std::string text = header.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  return out + text + bytes.substr(8 + length);
}

class BadFiles : public ::testing::Test {
 protected:
  Fixture f;
  std::string good =
      encode_snapshots(9, std::vector<const Snapshot*>{f.snapshots[0].get(), nullptr,
                                                       f.snapshots[2].get(), f.snapshots[3].get()});
  ::testing::AssertionResult rejected(const std::string& bytes, const char* what) {
    const int64_t before = live_bytes();
    auto result = throws_error([&] { (void)decode_snapshots(bytes, "bad.safetensors"); },
                               {"bad.safetensors", what});
    if (live_bytes() != before)
      return ::testing::AssertionFailure() << "a rejected file left arrays alive";
    return result;
  }
};

TEST_F(BadFiles, TheGoodFileLoads) {
  EXPECT_EQ(decode_snapshots(good, "good").snapshots.size(), 4u);
}

TEST_F(BadFiles, TruncatedAtEveryByteIsRejected) {
  for (size_t size = 0; size < good.size(); ++size) {
    EXPECT_THROW((void)decode_snapshots(good.substr(0, size), "cut"), Error) << size;
  }
}

TEST_F(BadFiles, AHeaderLengthThatLies) {
  std::string longer = good;
  longer[0] = static_cast<char>(0xff);
  longer[1] = static_cast<char>(0xff);
  longer[5] = 1;
  EXPECT_TRUE(rejected(longer, "header length"));
  std::string shorter = good;
  shorter[0] = static_cast<char>(static_cast<unsigned char>(shorter[0]) - 8);
  EXPECT_TRUE(rejected(shorter, ""));
}

TEST_F(BadFiles, MalformedJson) {
  std::string broken = good;
  const size_t header_end =
      8 + static_cast<unsigned char>(good[0]) + 256 * static_cast<unsigned char>(good[1]);
  broken[good.rfind('}', header_end)] = ',';  // the header object never closes
  EXPECT_TRUE(rejected(broken, "JSON"));
}

TEST_F(BadFiles, OffsetsOverlappingOrOutOfRange) {
  EXPECT_TRUE(rejected(with_header(good,
                                   [](auto& h) {
                                     h["layer.0.values"]["data_offsets"] =
                                         h["layer.0.keys"]["data_offsets"];
                                   }),
                       "overlap"));
  EXPECT_TRUE(
      rejected(with_header(good, [](auto& h) { h["layer.3.delta"]["data_offsets"][1] = 1 << 30; }),
               "data_offsets"));
  EXPECT_TRUE(rejected(with_header(good, [](auto& h) { h["layer.0.keys"]["shape"][2] = 7; }),
                       "data_offsets"));
}

TEST_F(BadFiles, UnknownDtype) {
  EXPECT_TRUE(rejected(with_header(good, [](auto& h) { h["layer.0.keys"]["dtype"] = "F64"; }),
                       "unknown dtype"));
}

TEST_F(BadFiles, WrongChecksum) {
  std::string flipped = good;
  flipped[flipped.size() - 3] ^= 0x10;  // one bit of tensor data
  EXPECT_TRUE(rejected(flipped, "checksum"));
  EXPECT_TRUE(
      rejected(with_header(good, [](auto& h) { h["__metadata__"]["offset"] = "8"; }), "checksum"));
}

TEST_F(BadFiles, AnyFlippedByteIsRejected) {
  // The checksum covers every byte but its own 16 digits: data, header JSON, its padding and
  // the length prefix.
  const size_t header_end = 8 + static_cast<unsigned char>(good[0]) +
                            256 * static_cast<size_t>(static_cast<unsigned char>(good[1]));
  ASSERT_EQ(good[header_end - 1], ' ') << "the fixture's header should end in padding";
  for (size_t at = 0; at < good.size(); ++at) {
    std::string flipped = good;
    flipped[at] ^= 0x20;
    EXPECT_THROW((void)decode_snapshots(flipped, "flipped"), Error) << "byte " << at;
  }
}

TEST(SnapshotFile, SavingRemovesTemporariesOfDeadWritersOnly) {
  const auto path = scratch("stale.safetensors").string();
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);  // reaped: no process has this pid now
  // Temporaries are named <path>.tmp-<pid>-<n>-<place>; <path>.tmp-<pid>-<n> and
  // <path>.tmp-<pid> are how they were named before.
  const std::string here = "-" + detail::writer_place();
  const std::string elsewhere = "-0123456789abcdef";
  const auto named = [&](pid_t pid, const std::string& rest) {
    return path + ".tmp-" + std::to_string(pid) + rest;
  };
  const std::string stale = named(dead, "-7" + here);
  const std::string live = named(::getppid(), "-3" + here);
  const std::string mine = named(::getpid(), "-999999" + here);  // no write of ours uses it
  // Another container's or host's (or an older kvsnap's): its writer cannot be probed from
  // here, so only an old one goes.
  const std::string foreign = named(dead, "-7" + elsewhere);
  const std::string foreign_old = named(dead, "-8" + elsewhere);
  const std::string legacy = named(dead, "-7");
  const std::string legacy_old = named(dead, "");
  const std::string other = scratch("other.safetensors").string() + ".tmp-" + std::to_string(dead) +
                            "-1" + here;           // not a temporary of this file
  const std::string not_ours = named(dead, "-x");  // not a name kvsnap gives
  const std::string bad_place = named(dead, "-7-0123456789ABCDEF");
  const std::string past_int64 = named(dead, "-9999999999999999999" + here);  // left, not fatal
  for (const std::string& name : {stale, live, mine, foreign, foreign_old, legacy, legacy_old,
                                  other, not_ours, bad_place, past_int64}) {
    std::ofstream(name) << "partial";
  }
  const auto age = [](const std::string& name, int64_t seconds) {
    const timespec times[2] = {{::time(nullptr) - seconds, 0}, {::time(nullptr) - seconds, 0}};
    ASSERT_EQ(::utimensat(AT_FDCWD, name.c_str(), times, 0), 0) << name;
  };
  age(foreign_old, detail::kStaleForeignTemporary + 60);
  age(legacy_old, detail::kStaleForeignTemporary + 60);
  age(foreign, detail::kStaleForeignTemporary - 60);
  age(live, detail::kStaleForeignTemporary + 60);  // a live writer's stays however old
  Fixture f;
  save_snapshots(path, 9, f.snapshots);
  for (const std::string& name : {stale, mine, foreign_old, legacy_old}) {
    EXPECT_FALSE(std::filesystem::exists(name)) << name;
  }
  for (const std::string& name : {live, foreign, legacy, other, not_ours, bad_place, past_int64}) {
    EXPECT_TRUE(std::filesystem::exists(name)) << name;
  }
  std::ofstream(stale) << "partial";
  (void)load_snapshots(path);
  EXPECT_FALSE(std::filesystem::exists(stale));
  for (const std::string& name : {live, foreign, legacy, other, not_ours, bad_place, past_int64}) {
    std::filesystem::remove(name);
  }
}

// A load through a link reads the file from the folder that really holds it, which it checks;
// the link's own folder was not checked, so its temporaries are left alone.
TEST(SnapshotFile, ALoadThroughALinkLeavesTheLinksFolderAlone) {
  const auto real = scratch("linked.safetensors").string();
  const auto link = testing::private_scratch("persist_links") / "linked.safetensors";
  std::filesystem::remove(link);
  std::filesystem::create_symlink(real, link);
  Fixture f;
  save_snapshots(real, 9, f.snapshots);
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string stale =
      link.string() + ".tmp-" + std::to_string(dead) + "-7-" + detail::writer_place();
  std::ofstream(stale) << "partial";
  EXPECT_EQ(load_snapshots(link.string()).offset, 9);
  EXPECT_TRUE(std::filesystem::exists(stale));
  std::filesystem::remove(stale);
  std::filesystem::remove(link);
}

// A save refuses what a load would: an offset past 2^40, before anything is written.
TEST(SnapshotFile, AnOffsetNoLoadAcceptsIsNotSaved) {
  const auto path = scratch("far.safetensors").string();
  std::filesystem::remove(path);
  EXPECT_TRUE(throws_error(
      [&] { save_snapshots(path, (int64_t{1} << 40) + 1, std::vector<SnapshotPtr>{}); },
      {"save_snapshots: offset 1099511627777 must be in [0, 2^40]"}));
  EXPECT_FALSE(std::filesystem::exists(path));
  save_snapshots(path, int64_t{1} << 40, std::vector<SnapshotPtr>{});
  EXPECT_EQ(load_snapshots(path).offset, int64_t{1} << 40);
}

// A header longer than safetensors readers accept is refused by the encoder, naming the size and
// the tensors (a trie of ~12k nodes over 32 layers would have come to one).
TEST(Safetensors, AHeaderOverTheReadersLimitIsNotEncoded) {
  detail::SafetensorsFile file;
  for (int i = 0; i < 40; ++i) {
    file.tensors.emplace_back("tensor." + std::to_string(i), Array::zeros(DType::f32, {2}));
  }
  const std::string whole = detail::encode_safetensors(file);
  uint64_t header = 0;  // the format's first 8 bytes: the header's length, little-endian
  for (int i = 7; i >= 0; --i) header = header << 8 | static_cast<unsigned char>(whole[i]);
  ASSERT_GT(header, 1000U);
  const std::string refused = "the file's header would take " + std::to_string(header) +
                              " bytes for its 40 tensors, more than the " +
                              std::to_string(header - 1) +
                              " a safetensors reader accepts: nothing was written";
  EXPECT_TRUE(throws_error([&] { (void)detail::encode_safetensors(file, nullptr, header - 1); },
                           {refused.c_str()}));
  EXPECT_EQ(detail::encode_safetensors(file, nullptr, header), whole);  // exactly the limit
  EXPECT_EQ(detail::kMaxWrittenSafetensorsHeader, 100'000'000U);
}

// Saves of one path from several threads each use a temporary of their own: every one
// succeeds, and the file is always one whole save (the last renamed), with nothing left behind.
TEST(SnapshotFile, SavesFromSeveralThreadsToOnePathAllSucceed) {
  const std::string path = scratch("concurrent.safetensors").string();
  constexpr int kThreads = 4;
  constexpr int kSaves = 50;
  std::vector<std::unique_ptr<KVCache>> caches;
  std::vector<SnapshotPtr> snapshots;  // thread t saves 5 + t tokens
  for (int t = 0; t < kThreads; ++t) {
    caches.push_back(std::make_unique<KVCache>());
    testing::write(*caches.back(), kv, id_range(0, 5 + t));
    snapshots.push_back(caches.back()->snapshot(0));
  }
  std::atomic<int> failed{0};
  std::mutex mutex;
  std::string first_error;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kSaves; ++i) {
        try {
          save_snapshots(path, 5 + t, {snapshots[static_cast<size_t>(t)].get()});
        } catch (const Error& error) {
          const std::lock_guard<std::mutex> lock(mutex);
          if (failed++ == 0) first_error = error.what();
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failed.load(), 0) << "of " << kThreads * kSaves << " saves; the first: " << first_error;
  const LoadedSnapshots loaded = load_snapshots(path);
  ASSERT_GE(loaded.offset, 5);
  ASSERT_LT(loaded.offset, 5 + kThreads);
  ASSERT_EQ(loaded.snapshots.size(), 1u);
  EXPECT_EQ(fingerprint(*loaded.snapshots[0]),
            fingerprint(*snapshots[static_cast<size_t>(loaded.offset - 5)]));
  const std::string temporaries = std::filesystem::path(path).filename().string() + ".tmp-";
  for (const auto& entry : std::filesystem::directory_iterator(scratch(""))) {
    EXPECT_NE(entry.path().filename().string().rfind(temporaries, 0), 0u)
        << "left behind: " << entry.path();
  }
  std::filesystem::remove(path);
}

TEST_F(BadFiles, UnknownVersion) {
  // Edited without a new seal: maybe a damaged version, which the message says too.
  EXPECT_TRUE(rejected(with_header(good, [](auto& h) { h["__metadata__"]["version"] = "99"; }),
                       "version \"99\" is unknown (this build reads version 2), or the file is "
                       "damaged: its checksum does not match either"));
}

TEST_F(BadFiles, ADamagedFormatSaysTheFileMayBeDamaged) {
  // As a damaged version: edited without a new seal, the format's value or its key.
  EXPECT_TRUE(rejected(
      with_header(good, [](auto& h) { h["__metadata__"]["format"] = "kvsnap-snapshotr"; }),
      "format \"kvsnap-snapshotr\" is not kvsnap-snapshots, or the file is damaged: its checksum "
      "does not match either"));
  EXPECT_TRUE(rejected(with_header(good,
                                   [](auto& h) {
                                     h["__metadata__"]["formbt"] = h["__metadata__"]["format"];
                                     h["__metadata__"].erase("format");
                                   }),
                       "metadata \"format\" is missing, or the file is damaged"));
}

TEST_F(BadFiles, NotAKvsnapFile) {
  EXPECT_TRUE(
      rejected(with_header(good, [](auto& h) { h["__metadata__"].erase("format"); }), "format"));
}

TEST(SnapshotFile, ForeignSnapshotKindsAreRefused) {
  class Custom final : public Snapshot {
   public:
    int64_t size() const override { return 0; }
    void set_materialize_hook(std::function<void(int64_t)>) override {}
    int64_t from() const override { return 0; }
    int64_t to() const override { return 0; }
    bool is_lazy() const override { return false; }
  } custom;
  EXPECT_TRUE(
      throws_error([&] { (void)encode_snapshots(0, std::vector<const Snapshot*>{&custom}); },
                   {"save_snapshots", "layer 0", "cannot store"}));
}

TEST(SnapshotFile, ACrashMidSaveLeavesThePreviousFileLoadable) {
  Fixture f;
  const auto path = scratch("crash.safetensors").string();
  save_snapshots(path, 9, f.snapshots);
  const std::string expected = fingerprint(*load_snapshots(path).snapshots[0]);
  // A large second set, so the save takes long enough to be killed in the middle.
  KVCache big;
  const TokenKV wide{.heads = 8, .depth = 64};
  testing::write(big, wide, id_range(0, 4096));
  std::vector<SnapshotPtr> large;
  large.push_back(big.snapshot(0));
  std::mt19937 rng(5);
  for (int attempt = 0; attempt < 8; ++attempt) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      for (;;) save_snapshots(path, 4096, large);  // until killed
    }
    ::usleep(1000 + rng() % 20000);
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    const LoadedSnapshots loaded = load_snapshots(path);  // either the old or a complete new file
    ASSERT_EQ(loaded.snapshots.size(), loaded.offset == 9 ? 4u : 1u);
    if (loaded.offset == 9) {
      EXPECT_EQ(fingerprint(*loaded.snapshots[0]), expected);
    }
    save_snapshots(path, 9, f.snapshots);  // back to the small file for the next attempt
  }
}

// Writes a file for tests/persist/read_safetensors.py (KVSNAP_INTEROP_FILE names it).
TEST(Interop, WritesAFileForOtherSafetensorsReaders) {
  Fixture f;
  const char* target = std::getenv("KVSNAP_INTEROP_FILE");
  const std::string path = target != nullptr ? target : scratch("interop.safetensors").string();
  save_snapshots(path, 9, f.snapshots);
  EXPECT_EQ(load_snapshots(path).offset, 9);
}

TEST(SnapshotFile, SavingToAnUnwritablePlaceFailsClearly) {
  Fixture f;
  EXPECT_TRUE(
      throws_error([&] { save_snapshots("/nonexistent-dir/x.safetensors", 9, f.snapshots); },
                   {"writing /nonexistent-dir/x.safetensors", "open"}));
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots("/nonexistent-dir/x.safetensors"); },
                           {"cannot open"}));
}

// A path that names no file (empty, or a folder's) is refused before anything is done in its
// folder: the cleanup of stale temporaries took every ".tmp-<pid>" there for the file's.
TEST(SnapshotFile, APathNamingNoFileIsRefusedAndItsFolderLeftAsItIs) {
  Fixture f;
  const std::filesystem::path folder = scratch("unnamed.safetensors").parent_path();
  const std::filesystem::path planted = folder / ".tmp-123";  // an hour-old temporary's name
  { std::ofstream(planted) << "someone's"; }
  std::filesystem::last_write_time(
      planted, std::filesystem::file_time_type::clock::now() - std::chrono::hours(2));
  for (const std::string& path : {folder.string() + "/", std::string(), folder.string() + "/."}) {
    EXPECT_TRUE(throws_error([&] { save_snapshots(path, 9, f.snapshots); },
                             {"save_snapshots: the path \"", "\" names no file"}))
        << path;
  }
  EXPECT_TRUE(std::filesystem::exists(planted));
  std::filesystem::remove(planted);
}

// A write that fails (here past the file size limit: EFBIG) is reported with its own reason,
// read before the descriptor is closed, and leaves neither the file nor a temporary behind.
TEST(SnapshotFile, AFailedWriteReportsItsReasonAndLeavesNoTemporary) {
  Fixture f;
  const std::filesystem::path path = scratch("limited.safetensors");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the limit is the process's: set in a child
    ::signal(SIGXFSZ, SIG_IGN);
    const struct rlimit limit { 64, 64 };
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      save_snapshots(path.string(), 9, f.snapshots);
    } catch (const Error& error) {
      const std::string message = error.what();
      ::_exit(message.find("write failed (File too large)") != std::string::npos ? 0 : 2);
    }
    ::_exit(1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  EXPECT_FALSE(std::filesystem::exists(path));
  for (const auto& entry : std::filesystem::directory_iterator(path.parent_path())) {
    EXPECT_NE(entry.path().filename().string().rfind("limited.safetensors", 0), 0u) << entry.path();
  }
}

}  // namespace
}  // namespace kvsnap
