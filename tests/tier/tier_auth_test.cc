// Authenticated tier objects (a key) against a real redis-server: a correctly keyed object
// restores; one forged without the key, one replayed from another tenant and one signed with
// another key are rejected and counted, never restored. The key file is checked like a private
// key. Without a key the tier says once that it trusts the store.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "persist/files.h"
#include "persist/safetensors.h"
#include "support/tier_support.h"

namespace kvsnap {
namespace {

using testing::Conversation;
using testing::ObjectNames;
using testing::RedisStore;
using testing::throws_error;
using testing::tier_options;
using testing::TierProcess;
using testing::tokens;

const std::string kKey = "0123456789abcdef0123456789abcdef";
const std::string kOtherKey = "fedcba9876543210fedcba9876543210";

class TierAuth : public ::testing::Test {
 protected:
  // The first turn, written by a process with `options`.
  void write(const TierOptions& options) {
    TierProcess writer(store.address(), options);
    (void)writer.turn(talk.first, talk.reply, talk.ends);
  }
  // What someone who can write the store but lacks the key can do: copy objects of talk.second
  // (its point at 31 and its three chunks) from the names of `from` over those of `to` (whose
  // index then names them).
  void copy(const TierOptions& from, const TierOptions& to) {
    const ObjectNames a(from), b(to);
    store.set(b.point(talk.second, 31), store.get(a.point(talk.second, 31)));
    for (int64_t j = 0; j < 3; ++j) {
      store.set(b.chunk(talk.second, j), store.get(a.chunk(talk.second, j)));
    }
  }
  RedisStore store;
  Conversation talk;
};

TEST_F(TierAuth, ACorrectlyKeyedObjectRestores) {
  write(tier_options("", kKey));
  TierProcess reader(store.address(), tier_options("", kKey));
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 31);
  EXPECT_TRUE(reader.tier->authenticated());
  EXPECT_EQ(reader.tier->stats().rejected, 0);
  EXPECT_EQ(reader.log.count("trusted-store"), 0) << reader.log.all();
}

TEST_F(TierAuth, ObjectsForgedWithoutTheKeyAreRejected) {
  write(tier_options());  // a writer without the key: its objects copied over the keyed ones
  write(tier_options("", kKey));
  copy(tier_options(), tier_options("", kKey));
  TierProcess reader(store.address(), tier_options("", kKey));
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 0);
  const TierStats stats = reader.tier->stats();
  EXPECT_GE(stats.unauthenticated, 1);
  EXPECT_EQ(stats.unauthenticated, stats.rejected);
  EXPECT_GE(reader.log.count("MAC does not verify"), 1) << reader.log.all();
}

TEST_F(TierAuth, AForgeryThatPassesTheChecksumIsRejected) {
  write(tier_options("", kKey));
  // Someone who can write the store but lacks the key: takes a real object, changes its data and
  // seals it again (a valid checksum), keeping the old tag.
  const ObjectNames names(tier_options("", kKey));
  const std::string point = names.point(talk.second, 31);
  std::string bytes = store.get(point);
  const std::string tag = bytes.substr(bytes.size() - 32);
  bytes.resize(bytes.size() - 32);
  detail::SafetensorsFile file = detail::decode_safetensors(bytes, point);
  file.tensors.back().second =
      Array::zeros(file.tensors.back().second.dtype(), file.tensors.back().second.shape());
  store.set(point, detail::encode_sealed(file) + tag);
  TierProcess reader(store.address(), tier_options("", kKey));
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 26);
  EXPECT_EQ(reader.tier->stats().unauthenticated, 1);
}

// An object of another format version (a later build's, sealed as this one seals) is refused
// by its header, not restored: the version is in the names too, but a store may hold anything.
TEST_F(TierAuth, AnObjectOfAnotherFormatVersionIsRejected) {
  write(tier_options());
  const ObjectNames names(tier_options());
  const std::string point = names.point(talk.second, 31);
  detail::SafetensorsFile file = detail::decode_safetensors(store.get(point), point);
  ASSERT_EQ(file.metadata.at("version"), "1");
  file.metadata["version"] = "2";
  store.set(point, detail::encode_sealed(file));
  TierProcess reader(store.address(), tier_options());
  EXPECT_LT(reader.turn(talk.second, tokens(500, 3)).cached, 31);
  EXPECT_GE(reader.tier->stats().rejected, 1);
  EXPECT_EQ(reader.log.count("version \"2\" is not the version this build reads (1)"), 1)
      << reader.log.all();
}

TEST_F(TierAuth, AnObjectReplayedFromAnotherTenantIsRejected) {
  write(tier_options("tenant a", kKey));
  write(tier_options("tenant b", kKey));
  copy(tier_options("tenant a", kKey), tier_options("tenant b", kKey));  // the MAC covers names
  TierProcess reader(store.address(), tier_options("tenant b", kKey));
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 0);
  EXPECT_GE(reader.tier->stats().unauthenticated, 1);
}

TEST_F(TierAuth, AnObjectSignedWithAnotherKeyIsRejected) {
  write(tier_options("", kOtherKey));
  write(tier_options("", kKey));
  copy(tier_options("", kOtherKey), tier_options("", kKey));
  TierProcess reader(store.address(), tier_options("", kKey));
  EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 0);
  EXPECT_GE(reader.tier->stats().unauthenticated, 1);
}

// Processes with another key, or none (a key being rolled out or rotated), name their objects
// apart: each misses the others' objects instead of rejecting them as forged and deleting them.
TEST_F(TierAuth, ProcessesWithDifferentKeysKeepToTheirOwnObjects) {
  write(tier_options("", kKey));
  for (const TierOptions& other : {tier_options(), tier_options("", kOtherKey)}) {
    TierProcess process(store.address(), other);
    EXPECT_EQ(process.turn(talk.second, tokens(500, 3)).cached, 0);
    EXPECT_EQ(process.tier->stats().rejected, 0);
  }
  TierProcess keyed(store.address(), tier_options("", kKey));
  EXPECT_EQ(keyed.turn(talk.second, tokens(600, 3)).cached, 31);
  EXPECT_EQ(keyed.tier->stats().rejected, 0);
}

TEST(TierTrust, WithoutAKeyTheTierSaysOnceThatItTrustsTheStore) {
  testing::FolderStore folder("trust");
  TierProcess process(folder.address());
  (void)process.turn(Conversation{}.first, Conversation{}.reply);
  (void)process.turn(Conversation{}.second, tokens(500, 2));
  EXPECT_EQ(process.log.count("trusted-store mode"), 1) << process.log.all();
  EXPECT_FALSE(process.tier->authenticated());
}

class KeyFile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::remove_all(folder);
    std::filesystem::create_directories(folder);
    // Private whatever the umask: the folder holding a key is checked too.
    std::filesystem::permissions(folder, std::filesystem::perms::owner_all);
  }
  void TearDown() override { std::filesystem::remove_all(folder); }
  std::string file(const std::string& name, const std::string& contents, mode_t mode) {
    const std::string path = (folder / name).string();
    std::ofstream(path) << contents;
    ::chmod(path.c_str(), mode);
    return path;
  }
  const std::filesystem::path folder =
      std::filesystem::temp_directory_path() / ("kvsnap_key_" + std::to_string(::getpid()));
};

TEST_F(KeyFile, APrivateFileOfTheUserIsRead) {
  EXPECT_EQ(load_tier_key(file("good", kKey + "\n", 0600)), kKey);
  EXPECT_EQ(load_tier_key(file("read_only", kKey, 0400)), kKey);
}

TEST_F(KeyFile, GroupOrOtherAccessIsRefusedNamingPathOwnerAndMode) {
  for (const mode_t mode : {0644, 0660, 0602, 0640}) {
    const std::string path = file("open", kKey, mode);
    const std::string shown = fmt::format("mode {:04o}", mode);
    const char* wrong = (mode & 022) != 0 ? "can write it" : "can read it";
    EXPECT_TRUE(throws_error([&] { (void)load_tier_key(path); },
                             {"load_tier_key", path.c_str(), shown.c_str(), wrong}));
  }
}

TEST_F(KeyFile, AFileOfAnotherUserIsRefused) {
  const passwd* nobody = ::getpwnam("nobody");
  if (nobody == nullptr || ::geteuid() == nobody->pw_uid) GTEST_SKIP() << "no user nobody";
  const std::string path = file("theirs", kKey, 0600);
  if (::chown(path.c_str(), nobody->pw_uid, static_cast<gid_t>(-1)) != 0) {
    GTEST_SKIP() << "cannot chown to nobody (not root)";
  }
  EXPECT_TRUE(throws_error(
      [&] { (void)load_tier_key(path); },
      {"load_tier_key", path.c_str(), "owner nobody", "mode 0600", "another user owns it"}));
}

TEST_F(KeyFile, AShortMissingOrNonRegularFileIsRefused) {
  EXPECT_TRUE(throws_error([&] { (void)load_tier_key(file("short", "too short \n", 0600)); },
                           {"holds 9 bytes", "at least 16"}));
  const std::string huge = file("huge", "", 0600);
  std::filesystem::resize_file(huge, std::uintmax_t{1} << 40);  // sparse: nothing is read
  EXPECT_TRUE(throws_error([&] { (void)load_tier_key(huge); },
                           {"load_tier_key", "1099511627776 bytes", "at most 1048576"}));
  EXPECT_TRUE(throws_error([&] { (void)load_tier_key((folder / "missing").string()); },
                           {"missing", "No such file"}));
  EXPECT_TRUE(throws_error([&] { (void)load_tier_key(folder.string()); }, {"Is a directory"}));
}

TEST_F(KeyFile, AKeyInAFolderOthersCanWriteIsRefused) {
  const std::string path = file("good", kKey, 0600);
  ::chmod(folder.c_str(), 0777);
  EXPECT_TRUE(throws_error([&] { (void)load_tier_key(path); },
                           {"load_tier_key", "refusing the folder", "can write it"}));
}

// An address with a password kept in a file (not on a command line): read under the key file's
// rules, checked, its password never shown in errors.
TEST_F(KeyFile, AnAddressFileIsReadUnderTheKeyFilesRules) {
  EXPECT_EQ(load_tier_address(file("address", "  redis://:hunter2@10.0.0.5:6380/2\n", 0600)),
            "redis://:hunter2@10.0.0.5:6380/2");
  const std::string open = file("open", "redis://:hunter2@h:1", 0644);
  EXPECT_TRUE(throws_error([&] { (void)load_tier_address(open); },
                           {"load_tier_address", open.c_str(), "mode 0644", "can read it"}));
  const std::string bad = file("bad", "redis://:hunter2@h:port", 0600);
  try {
    (void)load_tier_address(bad);
    ADD_FAILURE() << "a malformed address was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("load_tier_address: " + bad), std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find("hunter2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvsnap
