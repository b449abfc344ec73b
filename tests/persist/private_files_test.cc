// Private files: what kvsnap writes is 0600 / 0700 whatever the umask, and what it loads must
// belong to this user and be writable by no one else (README.md, "Security").
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "persist/files.h"
#include "support/cache_support.h"
#include "support/private_support.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

namespace fs = std::filesystem;
using testing::give_to;
using testing::me_phrase;
using testing::mode_of;
using testing::nobody_uid;
using testing::octal;
using testing::private_scratch;
using testing::ScopedUmask;
using testing::set_mode;
using testing::throws_error;
using testing::user_phrase;

// A small snapshot file at `path` (offset 3).
void save_one(const fs::path& path) {
  KVCache cache;
  testing::write(cache, testing::TokenKV{.heads = 1, .depth = 2}, testing::id_range(0, 3));
  save_snapshots(path.string(), 3, {cache.snapshot(0).get()});
}

std::string contents(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

const LoadOptions kShared{.allow_shared = true};

TEST(PrivateFiles, SavedFilesAreMode0600WhateverTheUmask) {
  // 0277 masks even the owner's write bit: only the explicit fchmod after creating gives 0600 /
  // 0700.
  for (const mode_t mask : {mode_t{000}, mode_t{077}, mode_t{0277}}) {
    SCOPED_TRACE(mask);
    const ScopedUmask umask(mask);
    const fs::path dir = private_scratch("umask_file");
    save_one(dir / "new.safetensors");
    EXPECT_EQ(mode_of(dir / "new.safetensors"), 0600u);
    // A file that was there, readable by all, is replaced by a private one.
    { std::ofstream(dir / "old.safetensors") << "old"; }
    set_mode(dir / "old.safetensors", 0644);
    save_one(dir / "old.safetensors");
    EXPECT_EQ(mode_of(dir / "old.safetensors"), 0600u);
    EXPECT_EQ(load_snapshots((dir / "old.safetensors").string()).offset, 3);
    // The temporary it is written to, as save creates it.
    (void)detail::create_private_file((dir / "t.tmp-1").string(), "test");
    EXPECT_EQ(mode_of(dir / "t.tmp-1"), 0600u);
    // One of ours that is there already is emptied and made private.
    { std::ofstream(dir / "t.tmp-2") << "stale"; }
    set_mode(dir / "t.tmp-2", 0666);
    (void)detail::create_private_file((dir / "t.tmp-2").string(), "test");
    EXPECT_EQ(mode_of(dir / "t.tmp-2"), 0600u);
    EXPECT_EQ(fs::file_size(dir / "t.tmp-2"), 0u);
    fs::remove_all(dir);
  }
}

TEST(PrivateFiles, MadeFoldersAre0700AndFoldersThatExistKeepTheirModes) {
  // 0277 masks even the owner's write bit: only the explicit fchmod after creating gives 0600 /
  // 0700.
  for (const mode_t mask : {mode_t{000}, mode_t{077}, mode_t{0277}}) {
    SCOPED_TRACE(mask);
    const ScopedUmask umask(mask);
    const fs::path dir = private_scratch("umask_folder");
    EXPECT_FALSE(detail::make_private_folders((dir / "a" / "b" / "c/").string()));
    for (const fs::path& made : {dir / "a", dir / "a" / "b", dir / "a" / "b" / "c"}) {
      EXPECT_EQ(mode_of(made), 0700u) << made;
    }
    set_mode(dir / "a", 0755);        // not tightened
    set_mode(dir / "a" / "b", 0777);  // not loosened either: left as it is
    EXPECT_FALSE(detail::make_private_folders((dir / "a" / "b" / "d").string()));
    EXPECT_EQ(mode_of(dir / "a"), 0755u);
    EXPECT_EQ(mode_of(dir / "a" / "b"), 0777u);
    EXPECT_EQ(mode_of(dir / "a" / "b" / "d"), 0700u);
    { std::ofstream(dir / "file") << "x"; }
    EXPECT_EQ(detail::make_private_folders((dir / "file" / "sub").string()),
              std::error_code(ENOTDIR, std::generic_category()));
    fs::remove_all(dir);
  }
}

TEST(PrivateFiles, AFileGroupOrOthersCanWriteIsRefusedUnlessShared) {
  const fs::path dir = private_scratch("writable_file");
  const std::string path = (dir / "s.safetensors").string();
  save_one(path);
  const std::string owner = "owner " + user_phrase(::geteuid());
  for (const auto& [mode, who] :
       {std::pair{0666, "group and others can write it"}, std::pair{0620, "its group can write it"},
        std::pair{0602, "others can write it"}}) {
    set_mode(path, static_cast<mode_t>(mode));
    const std::string named = "load_snapshots: refusing the file " + path + " (" + owner +
                              ", mode " + octal(mode) + "): " + who;
    EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path); },
                             {named.c_str(), me_phrase().c_str(), "cannot write",
                              "; set LoadOptions::allow_shared to trust it anyway"}));
    EXPECT_EQ(load_snapshots(path, kShared).offset, 3);
  }
  set_mode(path, 0644);  // others may read it: private means no one else can change it
  EXPECT_EQ(load_snapshots(path).offset, 3);
  fs::remove_all(dir);
}

TEST(PrivateFiles, AFolderGroupOrOthersCanWriteIsRefusedUnlessShared) {
  const fs::path dir = private_scratch("writable_folder");
  const std::string path = (dir / "s.safetensors").string();
  save_one(path);
  for (const auto& [mode, who] : {std::pair{0777, "group and others can write it"},
                                  std::pair{0770, "its group can write it"}}) {
    set_mode(dir, static_cast<mode_t>(mode));
    const std::string named = "load_snapshots: refusing the folder " + dir.string() + " holding " +
                              path + " (owner " + user_phrase(::geteuid()) + ", mode " +
                              octal(mode) + "): " + who;
    EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path); },
                             {named.c_str(), "set LoadOptions::allow_shared to trust it anyway"}));
    EXPECT_EQ(load_snapshots(path, kShared).offset, 3);
  }
  // Sticky, like /tmp: only a file's owner can replace it, so the file's own check decides.
  set_mode(dir, 01777);
  EXPECT_EQ(load_snapshots(path).offset, 3);
  set_mode(path, 0666);
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path); }, {"refusing the file"}));
  fs::remove_all(dir);
}

// A save refuses, writing nothing, a folder where its own load would refuse the file; a shared
// save (0644, for the folder's other users) writes into any folder.
TEST(PrivateFiles, ASaveRefusesAFolderItsLoadWouldRefuseUnlessShared) {
  const fs::path dir = private_scratch("save_refused");
  const std::string path = (dir / "s.safetensors").string();
  save_one(path);
  const std::string before = contents(path);
  KVCache cache;
  testing::write(cache, testing::TokenKV{.heads = 1, .depth = 2}, testing::id_range(0, 5));
  const SnapshotPtr five = cache.snapshot(0);
  // 0333: a drop box this user may write into but not list is checked as well.
  for (const auto& [mode, who] :
       {std::pair{0777, "group and others can write it"}, std::pair{0770, "its group can write it"},
        std::pair{0333, "group and others can write it"}}) {
    set_mode(dir, static_cast<mode_t>(mode));
    const std::string named = "save_snapshots: refusing the folder " + dir.string() + " (owner " +
                              user_phrase(::geteuid()) + ", mode " + octal(mode) + "): " + who;
    EXPECT_TRUE(throws_error([&] { save_snapshots(path, 5, {five.get()}); },
                             {named.c_str(), "set SaveOptions::shared"}));
    EXPECT_TRUE(throws_error([&] { save_snapshots(path, 5, std::vector<SnapshotPtr>{}); },
                             {named.c_str()}));
    EXPECT_EQ(contents(path), before);
    EXPECT_EQ(mode_of(path), 0600u);
    EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  }
  // Sticky, like /tmp: a load trusts it (the file's own check decides), so a save does too.
  set_mode(dir, 01777);
  save_snapshots(path, 5, {five.get()});
  EXPECT_EQ(load_snapshots(path).offset, 5);
  EXPECT_EQ(mode_of(path), 0600u);
  set_mode(dir, 0777);
  save_snapshots(path, 3, {five.get()}, SaveOptions{.shared = true});
  EXPECT_EQ(mode_of(path), 0644u);
  EXPECT_EQ(load_snapshots(path, kShared).offset, 3);
  // A file in the working folder: the folder checked is ".".
  set_mode(dir, 0700);
  const fs::path was = fs::current_path();
  fs::current_path(dir);
  save_snapshots("here.safetensors", 5, {five.get()});
  set_mode(dir, 0777);
  EXPECT_TRUE(throws_error([&] { save_snapshots("here.safetensors", 3, {five.get()}); },
                           {"save_snapshots: refusing the folder . (owner"}));
  fs::current_path(was);
  EXPECT_EQ(load_snapshots((dir / "here.safetensors").string(), kShared).offset, 5);
  fs::remove_all(dir);
}

// A load refuses a folder before it touches anything in it: a dead writer's temporary there is
// removed only once the folder is trusted.
TEST(PrivateFiles, ARefusedFolderIsLeftAsItIs) {
  const fs::path dir = private_scratch("refused_folder");
  const std::string path = (dir / "s.safetensors").string();
  save_one(path);
  const std::string stale = testing::dead_writers_temporary(path);
  set_mode(dir, 0777);
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path); }, {"refusing the folder"}));
  EXPECT_TRUE(fs::exists(stale));
  EXPECT_EQ(load_snapshots(path, kShared).offset, 3);
  EXPECT_FALSE(fs::exists(stale));
  fs::remove_all(dir);
}

TEST(PrivateFiles, AnotherUsersFileOrFolderIsRefusedUnlessShared) {
  std::string why;
  const std::optional<uid_t> nobody = nobody_uid(why);
  if (!nobody) GTEST_SKIP() << why;
  const fs::path dir = private_scratch("foreign");
  const std::string path = (dir / "s.safetensors").string();
  save_one(path);
  const std::string owner = "(owner " + user_phrase(*nobody) + ", mode 0600): another user owns it";
  give_to(path, *nobody);
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path); },
                           {"refusing the file", path.c_str(), owner.c_str()}));
  EXPECT_EQ(load_snapshots(path, kShared).offset, 3);
  give_to(path, ::geteuid());
  give_to(dir, *nobody);
  const std::string folder = "refusing the folder " + dir.string() + " holding " + path +
                             " (owner " + user_phrase(*nobody) +
                             ", mode 0700): another user owns it";
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path); }, {folder.c_str()}));
  EXPECT_EQ(load_snapshots(path, kShared).offset, 3);
  // A sticky folder of another user (not root): its owner can replace any file in it.
  set_mode(dir, 01777);
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path); },
                           {"mode 1777): another user owns it, group and others can write it"}));
  fs::remove_all(dir);
}

// What load_snapshots(path) says in a child process that became user `uid`: "offset N", or the
// Error's message.
std::string load_as(uid_t uid, const std::string& path) {
  const passwd* entry = ::getpwuid(uid);
  const gid_t group = entry != nullptr ? entry->pw_gid : static_cast<gid_t>(uid);
  int messages[2];
  if (::pipe(messages) != 0) return "pipe failed";
  const pid_t child = ::fork();
  if (child < 0) return "fork failed";
  if (child == 0) {
    ::close(messages[0]);
    if (::setgroups(0, nullptr) != 0 || ::setgid(group) != 0 || ::setuid(uid) != 0) ::_exit(2);
    std::string message;
    try {
      message = "offset " + std::to_string(load_snapshots(path).offset);
    } catch (const Error& error) {
      message = error.what();
    }
    (void)!::write(messages[1], message.data(), message.size());
    ::_exit(0);
  }
  ::close(messages[1]);
  std::string message;
  char buffer[4096];
  for (ssize_t n; (n = ::read(messages[0], buffer, sizeof buffer)) > 0;) message.append(buffer, n);
  ::close(messages[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "child failed";
  return message;
}

// Root's files are trusted by every user, as OpenSSH's StrictModes trusts them (root can change
// any file anyway); a third user's are not. Seen from a child that became nobody, loading from a
// folder of its own.
TEST(PrivateFiles, RootsFilesAreTrustedByOtherUsersAndAThirdUsersAreNot) {
  std::string why;
  const std::optional<uid_t> nobody = nobody_uid(why);
  if (!nobody) GTEST_SKIP() << why;
  const fs::path dir = private_scratch("roots");
  const std::string path = (dir / "s.safetensors").string();
  save_one(path);
  set_mode(path, 0644);  // so nobody can read it
  give_to(dir, *nobody);
  EXPECT_EQ(load_as(*nobody, path), "offset 3");
  const uid_t third = 54321;  // no user has it
  give_to(path, third);
  const std::string message = load_as(*nobody, path);
  EXPECT_NE(message.find("refusing the file " + path + " (owner uid 54321 (no user name), mode " +
                         "0644): another user owns it"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("that this user, " + user_phrase(*nobody) + ", or root owns"),
            std::string::npos)
      << message;
  fs::remove_all(dir);
}

TEST(PrivateFiles, ALinkIsFollowedAndTheFolderOfItsTargetChecked) {
  const fs::path dir = private_scratch("link");
  const fs::path shared = private_scratch("link_target");
  save_one(shared / "real.safetensors");
  fs::create_symlink(shared / "real.safetensors", dir / "s.safetensors");
  const std::string path = (dir / "s.safetensors").string();
  EXPECT_EQ(load_snapshots(path).offset, 3);
  set_mode(shared, 0777);
  const std::string named = "refusing the folder " + shared.string() + " holding " + path +
                            " (resolved to " + (shared / "real.safetensors").string() + ")";
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots(path); }, {named.c_str(), "mode 0777"}));
  fs::remove_all(dir);
  fs::remove_all(shared);
}

TEST(PrivateFiles, AFifoIsRefusedWithoutWaitingForAWriter) {
  const fs::path dir = private_scratch("fifo");
  ASSERT_EQ(::mkfifo((dir / "s.safetensors").c_str(), 0600), 0);
  ::alarm(10);  // a load that waits for a writer would wait forever: end the test instead
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots((dir / "s.safetensors").string()); },
                           {"refusing the file", "mode 0600): it is not a regular file"}));
  ::alarm(0);
  fs::remove_all(dir);
}

// A FIFO planted where a save writes its temporary (a predictable name in a shared folder) is
// refused without waiting for a reader, as a load refuses one.
TEST(PrivateFiles, AFifoAtAFileBeingWrittenIsRefusedWithoutWaitingForAReader) {
  const fs::path dir = private_scratch("fifo_write");
  const fs::path fifo = dir / "s.safetensors.tmp-1-0";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ::alarm(10);  // an open that waits for a reader would wait forever: end the test instead
  EXPECT_TRUE(throws_error([&] { (void)detail::create_private_file(fifo.string(), "save"); },
                           {"save: cannot open", "for writing"}));
  ::alarm(0);
  fs::remove_all(dir);
}

// Trusting a shared folder trusts its writers' files, not whatever they plant: a FIFO (a read
// would wait for a writer forever) or a link to a device (/dev/zero: a read that never ends)
// is refused without blocking, by the loaders and by PrefixCache::saved_in.
TEST(PrivateFiles, ASharedFileThatIsNotARegularFileIsRefusedWithoutBlocking) {
  const fs::path dir = private_scratch("shared_fifo");
  ASSERT_EQ(::mkfifo((dir / "s.safetensors").c_str(), 0600), 0);
  ASSERT_EQ(::mkfifo((dir / "prefix_cache.safetensors").c_str(), 0600), 0);
  ::alarm(10);  // a load that waits for a writer would wait forever: end the test instead
  const std::string fifo = "load_snapshots: cannot open " + (dir / "s.safetensors").string() +
                           " for reading (it is not a regular file)";
  EXPECT_TRUE(throws_error([&] { (void)load_snapshots((dir / "s.safetensors").string(), kShared); },
                           {fifo.c_str()}));
  EXPECT_TRUE(throws_error([&] { (void)PrefixCache::saved_in(dir.string(), kShared); },
                           {"prefix_cache.safetensors for reading (it is not a regular file)"}));
  ::alarm(0);
  if (fs::exists("/dev/zero")) {
    fs::remove(dir / "s.safetensors");
    fs::create_symlink("/dev/zero", dir / "s.safetensors");
    EXPECT_TRUE(throws_error(
        [&] { (void)load_snapshots((dir / "s.safetensors").string(), kShared); }, {fifo.c_str()}));
  }
  save_one(dir / "real.safetensors");  // a link to a regular file is still followed
  fs::remove(dir / "s.safetensors");
  fs::create_symlink(dir / "real.safetensors", dir / "s.safetensors");
  EXPECT_EQ(load_snapshots((dir / "s.safetensors").string(), kShared).offset, 3);
  fs::remove_all(dir);
}

// The rule a shared tier's MAC key file is read with: no one else may read it either.
TEST(PrivateFiles, ASecretMustNotBeReadableByOthers) {
  const fs::path dir = private_scratch("secret");
  const std::string path = (dir / "key").string();
  { std::ofstream(path) << "0123456789abcdef"; }
  const detail::PrivacyRule rule{.call = "tier key", .override_with = "", .secret = true};
  for (const auto& [mode, who] :
       {std::pair{0640, "its group can read it"}, std::pair{0604, "others can read it"},
        std::pair{0644, "group and others can read it"}}) {
    set_mode(path, static_cast<mode_t>(mode));
    EXPECT_TRUE(throws_error([&] { (void)detail::read_private_file(path, rule); },
                             {"tier key: refusing the file", who, "cannot write or read"}));
    EXPECT_EQ(detail::read_private_file(path, {.call = "cache", .override_with = ""}),
              "0123456789abcdef");
    try {  // no opt-out offered: the message does not suggest one
      (void)detail::read_private_file(path, rule);
    } catch (const Error& error) {
      EXPECT_EQ(std::string(error.what()).find("anyway"), std::string::npos) << error.what();
    }
  }
  set_mode(path, 0600);
  EXPECT_EQ(detail::read_private_file(path, rule), "0123456789abcdef");
  fs::remove_all(dir);
}

// Whatever sits at a save's temporary name — a link, a second name of another file, a file of
// this user or another's (a temporary of a process of this pid in another PID namespace, whose
// folder this is too) — is never written through: the save takes the next name, and what was
// planted stays as it was.
TEST(PrivateFiles, APlantedTemporaryIsNeverWrittenThrough) {
  const fs::path dir = private_scratch("planted");
  const std::string path = (dir / "s.safetensors").string();
  save_one(path);
  const std::string saved = contents(path);
  { std::ofstream(dir / "victim") << "victim"; }
  // The write itself, not the sweep of stale temporaries before it (which would remove what is
  // planted here: names of this pid and place that no write of this process uses).
  const std::string bytes = contents(path);
  const auto write = [&] { detail::write_file_atomically(path, bytes, /*clean_stale=*/false); };
  const auto save_past = [&](const std::string& temporary) {
    EXPECT_NO_THROW(write()) << temporary;
    EXPECT_TRUE(fs::exists(fs::symlink_status(temporary))) << temporary;
    EXPECT_EQ(contents(dir / "victim"), "victim");
    EXPECT_EQ(contents(path), saved);
    fs::remove(temporary);
  };
  std::string temporary = detail::next_temporary_path(path);
  fs::create_symlink(dir / "victim", temporary);
  save_past(temporary);
  temporary = detail::next_temporary_path(path);
  fs::create_hard_link(dir / "victim", temporary);
  save_past(temporary);
  temporary = detail::next_temporary_path(path);
  { std::ofstream(temporary) << "planted"; }
  save_past(temporary);
  std::string why;
  if (const std::optional<uid_t> nobody = nobody_uid(why)) {
    temporary = detail::next_temporary_path(path);
    { std::ofstream(temporary) << "planted"; }
    set_mode(temporary, 0666);
    give_to(temporary, *nobody);
    EXPECT_NO_THROW(write());
    EXPECT_EQ(contents(temporary), "planted");
    EXPECT_EQ(mode_of(temporary), 0666u);
    fs::remove(temporary);
  }
  fs::remove_all(dir);
}

// A temporary of this pid named from this place (this host's boot and PID namespace) that no
// write of this process uses now is an earlier process's — a container's engine is pid 1 on
// every start, killed mid-save —, however recent (a clock that steps back changes nothing): the
// next save removes it. (Those in use are covered by SavesFromSeveralThreadsToOnePathAllSucceed.)
TEST(PrivateFiles, AnEarlierProcessOfTheSamePidLeavesNoTemporaryBehind) {
  const fs::path dir = private_scratch("same_pid");
  const std::string path = (dir / "s.safetensors").string();
  const std::string earlier = detail::next_temporary_path(path);
  { std::ofstream(earlier) << "an earlier run's half-written save"; }
  fs::last_write_time(earlier, fs::file_time_type::clock::now() - std::chrono::hours(1));
  save_one(path);
  EXPECT_FALSE(fs::exists(earlier));
  const std::string recent = detail::next_temporary_path(path);
  { std::ofstream(recent) << "a save of an earlier run, this second"; }
  fs::last_write_time(recent, fs::file_time_type::clock::now() + std::chrono::hours(1));
  save_one(path);
  EXPECT_FALSE(fs::exists(recent));
  fs::remove_all(dir);
}

// When every name a save may take is already there, it fails saying so; the file stays.
TEST(PrivateFiles, ASaveWhoseTemporaryNamesAreAllTakenFailsAndChangesNothing) {
  const fs::path dir = private_scratch("taken");
  const std::string path = (dir / "s.safetensors").string();
  save_one(path);
  const std::string saved = contents(path);
  // <path>.tmp-<pid>-<n>-<place>: the next 64 numbers' names are planted (another user's in a
  // shared folder, which this one cannot remove; here the write leaves stale ones alone).
  const std::string next = detail::next_temporary_path(path);
  const size_t place = next.rfind('-'), number = next.rfind('-', place - 1);
  const std::string stem = next.substr(0, number + 1), suffix = next.substr(place);
  const uint64_t first = std::stoull(next.substr(number + 1, place - number - 1));
  for (uint64_t n = first; n < first + 64; ++n) {
    std::ofstream(stem + std::to_string(n) + suffix) << "taken";
  }
  const std::string bytes = contents(path);
  const auto write = [&] { detail::write_file_atomically(path, bytes, /*clean_stale=*/false); };
  EXPECT_TRUE(throws_error(write, {"writing", "temporary names", "all taken"}));
  EXPECT_EQ(contents(path), saved);
  EXPECT_NO_THROW(write());  // the next name is free
  fs::remove_all(dir);
}

// A file whose name leaves no room for ".tmp-PID-NUMBER-PLACE" within a folder entry's 255 bytes
// is saved all the same (its temporaries are named after its first 180 bytes and a hash of the
// rest; before, the save failed with "File name too long"), and a dead writer's temporary of it
// is still found and removed. The part kept never cuts a UTF-8 character.
TEST(PrivateFiles, AFileNamedUpTo255BytesIsSavedAndItsStaleTemporariesFound) {
  const fs::path dir = private_scratch("long_name");
  std::string accented = "a";  // then 2-byte characters: byte 180 is the second byte of one
  while (accented.size() < 241) accented += "\xc3\xa9";
  const std::string kept = detail::next_temporary_path((dir / accented).string());
  EXPECT_EQ(fs::path(kept).filename().string().find('~'), 179U) << kept;
  for (const size_t length : {200U, 202U, 203U, 230U, 255U}) {
    const std::string path = (dir / std::string(length, 'n')).string();
    const std::string temporary = detail::next_temporary_path(path);
    EXPECT_LE(fs::path(temporary).filename().string().size(), 255U) << length;
    const pid_t dead = ::fork();
    if (dead == 0) ::_exit(0);
    ::waitpid(dead, nullptr, 0);
    const std::string pid = ".tmp-" + std::to_string(::getpid()) + "-";
    std::string stale = temporary;
    stale.replace(stale.find(pid), pid.size(), ".tmp-" + std::to_string(dead) + "-");
    { std::ofstream(stale) << "a dead writer's half-written save"; }
    ASSERT_TRUE(fs::exists(stale)) << length;
    EXPECT_NO_THROW(detail::write_file_atomically(path, "saved")) << length;
    EXPECT_EQ(contents(path), "saved");
    EXPECT_FALSE(fs::exists(stale)) << length;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvsnap
