// The dir: backend against what others can put in its folder: a FIFO, a link or a huge file at
// an object's name reads as missing, within the deadline and without reading it; a link in or
// at an index folder is never written through.
#include "tier/dir_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <thread>

#include "array/sanitizers.h"
#include "support/private_support.h"
#include "support/tier_support.h"

namespace kvsnap {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using detail::DirStore;
using testing::Conversation;
using testing::HybridStack;
using testing::kNoLimit;
using testing::ObjectNames;
using testing::tier_options;
using testing::TierProcess;

// A fresh folder for a test's store, removed after it.
class DirStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    folder = fs::temp_directory_path() /
             ("kvsnap_dir_store_" + std::to_string(::getpid()) + "_" +
              ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(folder);
  }
  void TearDown() override { fs::remove_all(folder); }
  // The file of `key` in the folder, as DirStore names it.
  fs::path file(std::string key) const {
    std::replace(key.begin(), key.end(), ':', '-');
    return folder / key;
  }
  // fetch of one key with a 50 ms deadline, on another thread: nullopt in `value` unless it
  // returned within 2 s (then `unblock` runs, so that the thread can end).
  bool fetch_within_bound(
      DirStore& store, const std::string& key, std::optional<std::string>& value,
      const std::function<void()>& unblock = [] {}) {
    const std::vector<std::string> keys{key};
    auto done = std::async(std::launch::async,
                           [&] { return store.fetch(keys, Clock::now() + 50ms, kNoLimit).at(0); });
    const bool finished = done.wait_for(2s) == std::future_status::ready;
    if (!finished) unblock();
    value = done.get();
    return finished;
  }
  // Whether probe says `key` exists.
  static bool exists(DirStore& store, const std::string& key) {
    const std::vector<std::string> keys{key};
    std::vector<std::vector<std::string>> members;
    std::vector<int64_t> found;
    store.probe({}, keys, Clock::now() + 2s, members, found);
    return found.at(0) >= 0;
  }
  fs::path folder;
};

// A FIFO's writer end, opened and closed without blocking: a reader blocked in open() goes on.
void release_fifo(const fs::path& fifo) {
  const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  std::this_thread::sleep_for(100ms);
  if (fd >= 0) ::close(fd);
}

// A fetch holds at most the bytes it is given: the value that would pass them is never read
// (FetchTooLarge names it); a missing one takes none of them.
// The folder a store creates is private (0700) whatever the umask, however it is named (a
// trailing "/." included); one that exists is taken as it is.
TEST_F(DirStoreTest, TheFolderItCreatesIsPrivate) {
  const testing::ScopedUmask umask(0);
  for (const std::string& name :
       {folder.string(), (folder / "b" / ".").string(), (folder / "c").string() + "/"}) {
    DirStore store(name);
    EXPECT_EQ(testing::mode_of(fs::path(name).lexically_normal()), 0700u) << name;
  }
  DirStore again(folder.string());  // there already: fine
  { std::ofstream(folder / "file") << "x"; }
  EXPECT_TRUE(testing::throws_error([&] { DirStore((folder / "file" / "x").string()); },
                                    {"tier folder", "cannot create it (Not a directory)"}));
}

TEST_F(DirStoreTest, AFetchHoldsAtMostItsBytes) {
  DirStore store(folder.string());
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:c:a", std::string(100, 'a')}, {"kvsnap:c:b", std::string(200, 'b')}};
  ASSERT_EQ(store.write(batch, Clock::now() + 2s).objects, 0);
  const std::vector<std::string> keys{"kvsnap:c:a", "kvsnap:c:none", "kvsnap:c:b"};
  // A probe says how large each is (what a lookup plans its bytes with).
  std::vector<std::vector<std::string>> members;
  std::vector<int64_t> sizes;
  store.probe({}, keys, Clock::now() + 2s, members, sizes);
  EXPECT_EQ(sizes, (std::vector<int64_t>{100, -1, 200}));
  const auto values = store.fetch(keys, Clock::now() + 2s, 300);
  ASSERT_EQ(values.size(), 3u);
  EXPECT_EQ(values[0], std::string(100, 'a'));
  EXPECT_EQ(values[1], std::nullopt);
  EXPECT_EQ(values[2], std::string(200, 'b'));
  for (const auto& [bytes, index] : {std::pair<int64_t, size_t>{299, 2}, {99, 0}, {0, 0}}) {
    try {
      (void)store.fetch(keys, Clock::now() + 2s, bytes);
      ADD_FAILURE() << bytes << " bytes held both";
    } catch (const detail::FetchTooLarge& too_large) {
      EXPECT_EQ(too_large.index, index) << bytes;
      EXPECT_EQ(too_large.max_bytes, bytes);
    }
  }
}

TEST_F(DirStoreTest, AFifoAtAnObjectsNameIsMissingNotWaitedOn) {
  DirStore store(folder.string());
  const std::string key = "kvsnap:p:fifo";
  ASSERT_EQ(::mkfifo(file(key).c_str(), 0600), 0);
  std::optional<std::string> value;
  EXPECT_TRUE(fetch_within_bound(store, key, value, [&] { release_fifo(file(key)); }))
      << "a fetch with a 50 ms deadline was still blocked on the FIFO after 2 s";
  EXPECT_FALSE(value.has_value());
  EXPECT_FALSE(exists(store, key));
}

TEST_F(DirStoreTest, ALinkAtAnObjectsNameIsNotFollowed) {
  DirStore store(folder.string());
  const std::string key = "kvsnap:c:link";
  const fs::path elsewhere = folder.string() + "_elsewhere";
  { std::ofstream(elsewhere) << "not an object of this folder"; }
  fs::create_symlink(elsewhere, file(key));
  std::optional<std::string> value;
  EXPECT_TRUE(fetch_within_bound(store, key, value));
  EXPECT_FALSE(value.has_value()) << "read through the link: " << *value;
  EXPECT_FALSE(exists(store, key));
  fs::remove(elsewhere);
}

TEST_F(DirStoreTest, ALinkToDevZeroIsNotRead) {
#if defined(KVSNAP_ADDRESS_SANITIZER) || defined(KVSNAP_THREAD_SANITIZER)
  GTEST_SKIP() << "the child's address space is capped, which the sanitizers' shadow memory breaks";
#else
  DirStore store(folder.string());
  const std::string key = "kvsnap:p:zero";
  fs::create_symlink("/dev/zero", file(key));
  // In a child whose address space is capped at 1 GiB and that is killed after 10 s: reading
  // /dev/zero without bound ends there, not in this machine's memory.
  const auto child = [&] {
    const rlim_t cap = rlim_t(1) << 30;
    const rlimit limit{cap, cap};
    ::setrlimit(RLIMIT_AS, &limit);
    ::alarm(10);
    const std::vector<std::string> keys{key};
    const bool read = store.fetch(keys, Clock::now() + 50ms, kNoLimit).at(0).has_value();
    fs::remove_all(folder);  // the child's own (TearDown does not run there)
    std::_Exit(read ? 1 : 0);
  };
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child re-runs this test alone
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "");
#endif
}

TEST_F(DirStoreTest, AFileOverTheMaximumObjectSizeIsNotRead) {
  DirStore store(folder.string());
  const std::string key = "kvsnap:c:huge";
  { std::ofstream(file(key)) << "x"; }
  fs::resize_file(file(key), DirStore::kMaximumObjectBytes + 1);  // sparse: no disk used
  std::optional<std::string> value;
  EXPECT_TRUE(fetch_within_bound(store, key, value));
  EXPECT_FALSE(value.has_value()) << "read " << value->size() << " bytes";
  EXPECT_FALSE(exists(store, key)) << "probe agrees with fetch, so a writer rewrites it";
  // At the maximum it is an object (rejected later if damaged, as any other).
  fs::resize_file(file(key), 16);
  EXPECT_TRUE(exists(store, key));
  EXPECT_TRUE(fetch_within_bound(store, key, value));
  ASSERT_TRUE(value.has_value());
  EXPECT_EQ(value->size(), 16u);
}

// An object over the maximum is refused when written, as Redis refuses one over its limit: a
// file the store would never read back is not left there.
TEST_F(DirStoreTest, AnObjectOverTheMaximumSizeIsRefusedWhenWritten) {
  DirStore store(folder.string());
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:c:small", "fits"},
                   {"kvsnap:c:huge", std::string(DirStore::kMaximumObjectBytes + 1, 'x')}};
  const detail::Store::Refused refused = store.write(batch, Clock::now() + 60s);
  EXPECT_EQ(refused.objects, 1);
  EXPECT_EQ(refused.bytes, DirStore::kMaximumObjectBytes + 1);
  EXPECT_TRUE(exists(store, "kvsnap:c:small"));
  EXPECT_FALSE(fs::exists(file("kvsnap:c:huge")));
}

// The members probe lists for index `set`.
std::vector<std::string> members_of(DirStore& store, const std::string& set) {
  const std::vector<std::string> sets{set};
  std::vector<std::vector<std::string>> members;
  std::vector<int64_t> found;
  store.probe(sets, {}, Clock::now() + 2s, members, found);
  return members.at(0);
}

TEST_F(DirStoreTest, AnIndexEntryIsNeverCreatedThroughALink) {
  DirStore store(folder.string());
  const fs::path target = folder.string() + "_target";  // where a planted link points
  fs::remove(target);
  const std::string set = "kvsnap:i:planted";
  fs::create_directories(file(set));
  fs::create_symlink(target, file(set) / "20");  // dangling
  detail::WriteBatch batch;
  batch.index = {{set, "20"}, {set, "26"}};
  EXPECT_NO_THROW((void)store.write(batch, Clock::now() + 2s));
  EXPECT_FALSE(fs::exists(target)) << "the store created " << target << " through the link";
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(file(set) / "26")));
  EXPECT_NO_THROW((void)store.write(batch, Clock::now() + 2s));  // what is there stays
  std::vector<std::string> members = members_of(store, set);
  std::sort(members.begin(), members.end());
  EXPECT_EQ(members, (std::vector<std::string>{"20", "26"}));
  fs::remove(target);
}

TEST_F(DirStoreTest, AnIndexFolderThatIsALinkIsNeitherWrittenNorRead) {
  DirStore store(folder.string());
  const fs::path elsewhere = folder.string() + "_elsewhere";  // a folder a planted link names
  fs::remove_all(elsewhere);
  fs::create_directories(elsewhere);
  { std::ofstream(elsewhere / "31") << ""; }
  const std::string set = "kvsnap:i:linked";
  fs::create_directory_symlink(elsewhere, file(set));
  detail::WriteBatch batch;
  batch.index = {{set, "20"}};
  EXPECT_NO_THROW((void)store.write(batch, Clock::now() + 2s));
  EXPECT_FALSE(fs::exists(elsewhere / "20")) << "the store wrote through the linked folder";
  EXPECT_TRUE(members_of(store, set).empty());  // not elsewhere's "31"
  EXPECT_TRUE(fs::is_symlink(file(set)));       // left alone
  fs::remove_all(elsewhere);
}

// Temporaries of writes in the folder belong to writers this process may not see (another host
// or container): a fresh one stays whatever its process id; one older than kStaleTemporary is a
// dead writer's, removed when a store opens the folder.
TEST_F(DirStoreTest, TemporariesAreRemovedByAgeNotByProcessId) {
  const fs::path fresh = file("kvsnap:p:fresh").string() + ".tmp-999999-0";
  const fs::path old = file("kvsnap:p:old").string() + ".tmp-1-0";
  fs::create_directories(folder);
  { std::ofstream(fresh) << "writing"; }
  { std::ofstream(old) << "abandoned"; }
  fs::last_write_time(old, fs::file_time_type::clock::now() - DirStore::kStaleTemporary - 1min);
  DirStore store(folder.string());
  EXPECT_TRUE(fs::exists(old));  // opening lists nothing: a lookup's connection never does
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:p:fresh", "object"}};
  (void)store.write(batch, Clock::now() + 2s);  // the first write sweeps
  EXPECT_TRUE(fs::exists(fresh)) << "a live writer's temporary was removed";
  EXPECT_FALSE(fs::exists(old));
  for (const auto& entry : fs::directory_iterator(folder)) {  // the sweep's clock file is gone
    EXPECT_EQ(entry.path().filename().string().find("kvsnap-clock"), std::string::npos);
  }
  { std::ofstream(old) << "abandoned"; }
  fs::last_write_time(old, fs::file_time_type::clock::now() - DirStore::kStaleTemporary - 1min);
  (void)store.write(batch, Clock::now() + 2s);
  EXPECT_TRUE(fs::exists(old));  // not every write lists the folder: one an interval
  EXPECT_EQ(store.sweep_interval(), DirStore::kStaleTemporary);  // without a TTL
}

// Objects and index sets live as long as Redis's keys: unused for the TTL, a sweep removes them.
// Fetching an object, probing an index set, and writing either start their lifetimes afresh;
// names kvsnap does not write are left alone, and a link at an object's name is removed without
// touching what it points to.
TEST_F(DirStoreTest, ObjectsAndIndexSetsUnusedForTheTtlAreSwept) {
  DirStore store(folder.string(), /*own_files_only=*/false, std::chrono::hours(24));
  EXPECT_EQ(store.sweep_interval(), DirStore::kStaleTemporary);  // an eighth of the TTL, at most
  EXPECT_EQ(DirStore(folder.string(), false, 16s).sweep_interval(), 2s);
  EXPECT_EQ(DirStore(folder.string(), false, 2s).sweep_interval(), 1s);
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:c:unused", "a"}, {"kvsnap:c:fetched", "b"}, {"kvsnap:c:written", "c"}};
  batch.index = {{"kvsnap:i:unused", "5"}, {"kvsnap:i:probed", "7"}, {"kvsnap:i:added", "9"}};
  (void)store.write(batch, Clock::now() + 2s);
  const fs::path outside = folder.string() + "_target";
  { std::ofstream(outside) << "not the store's"; }
  fs::create_symlink(outside, file("kvsnap:c:link"));
  { std::ofstream(folder / "notes.txt") << "someone's"; }
  { std::ofstream(folder / "notes.txt.tmp-1-0") << "someone's editor's"; }
  fs::create_directories(folder / "kvsnap-backup");  // not a name the store writes
  { std::ofstream(folder / "kvsnap-backup" / "keep") << "someone's"; }
  const auto day_ago = fs::file_time_type::clock::now() - std::chrono::hours(25);
  for (const fs::path& aged :
       {file("kvsnap:c:unused"), file("kvsnap:c:fetched"), file("kvsnap:c:written"),
        file("kvsnap:i:unused"), file("kvsnap:i:probed"), file("kvsnap:i:added"),
        folder / "notes.txt", folder / "notes.txt.tmp-1-0", folder / "kvsnap-backup"}) {
    fs::last_write_time(aged, day_ago);
  }
  ::timespec link_age[2] = {{0, UTIME_OMIT}, {::time(nullptr) - 25 * 3600, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, file("kvsnap:c:link").c_str(), link_age, AT_SYMLINK_NOFOLLOW), 0);
  const std::vector<std::string> fetched{"kvsnap:c:fetched"}, probed{"kvsnap:i:probed"};
  EXPECT_EQ(store.fetch(fetched, Clock::now() + 2s, kNoLimit).at(0), "b");
  std::vector<std::vector<std::string>> members;
  std::vector<int64_t> found;
  store.probe(probed, {}, Clock::now() + 2s, members, found);
  const std::vector<std::string> asked{"kvsnap:c:asked"};
  detail::WriteBatch asked_batch;
  asked_batch.objects = {{"kvsnap:c:asked", "d"}};
  (void)store.write(asked_batch, Clock::now() + 2s);
  fs::last_write_time(file("kvsnap:c:asked"), day_ago);
  store.probe({}, asked, Clock::now() + 2s, members, found);  // asked after: in use
  EXPECT_GE(found.at(0), 0);
  detail::WriteBatch again;
  again.objects = {{"kvsnap:c:written", "c"}};
  again.index = {{"kvsnap:i:added", "9"}};  // there already: only its lifetime starts afresh
  (void)store.write(again, Clock::now() + 2s);
  store.sweep(Clock::now() + 2s);
  EXPECT_FALSE(fs::exists(file("kvsnap:c:unused")));
  EXPECT_FALSE(fs::exists(file("kvsnap:i:unused")));
  EXPECT_FALSE(fs::exists(fs::symlink_status(file("kvsnap:c:link"))));
  EXPECT_TRUE(fs::exists(outside));
  for (const fs::path& kept :
       {file("kvsnap:c:fetched"), file("kvsnap:c:written"), file("kvsnap:i:probed") / "7",
        file("kvsnap:i:added") / "9", file("kvsnap:c:asked"), folder / "notes.txt",
        folder / "notes.txt.tmp-1-0", folder / "kvsnap-backup" / "keep"}) {
    EXPECT_TRUE(fs::exists(kept)) << kept;
  }
  fs::remove(outside);
}

// A sweep stops at its deadline (here at once: nothing removed), and one that stops midway
// leaves the next its place in the folder: sweeps of 5 entries each go through 50 (45 in use, 5
// expired, in the folder's order) in 10 — starting over each time, they would stay on the first
// 5 entries in use.
TEST_F(DirStoreTest, ASweepThatStopsMidwayLeavesTheNextItsPlace) {
  DirStore store(folder.string(), /*own_files_only=*/false, std::chrono::hours(1));
  detail::WriteBatch batch;
  for (int i = 0; i < 50; ++i) batch.objects.emplace_back("kvsnap:c:" + std::to_string(i), "x");
  (void)store.write(batch, Clock::now() + 2s);
  for (int i = 0; i < 50; i += 10) {
    fs::last_write_time(file("kvsnap:c:" + std::to_string(i)),
                        fs::file_time_type::clock::now() - std::chrono::hours(2));
  }
  const auto left = [&] {
    return std::distance(fs::directory_iterator(folder), fs::directory_iterator());
  };
  store.sweep(Clock::now());  // no time at all: nothing removed
  EXPECT_EQ(left(), 50);
  for (int sweep = 0; sweep < 10; ++sweep) store.sweep(Clock::now() + 2s, 5);
  EXPECT_EQ(left(), 45);
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(fs::exists(file("kvsnap:c:" + std::to_string(i))), i % 10 != 0) << i;
  }
}

// Without a key, a sweep leaves other users' files alone (theirs to sweep, as they are theirs to
// read): in a sticky folder it could not remove them anyway, and must not try to judge them.
TEST_F(DirStoreTest, WithoutAKeyASweepLeavesOtherUsersFilesAlone) {
  DirStore store(folder.string(), /*own_files_only=*/true, std::chrono::hours(1));
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:c:mine", "a"}, {"kvsnap:c:theirs", "b"}};
  (void)store.write(batch, Clock::now() + 2s);
  std::string why;
  const std::optional<uid_t> nobody = testing::nobody_uid(why);
  if (!nobody) GTEST_SKIP() << why;
  testing::give_to(file("kvsnap:c:theirs"), *nobody);
  for (const char* key : {"kvsnap:c:mine", "kvsnap:c:theirs"}) {
    fs::last_write_time(file(key), fs::file_time_type::clock::now() - std::chrono::hours(2));
  }
  store.sweep(Clock::now() + 2s);
  EXPECT_FALSE(fs::exists(file("kvsnap:c:mine")));
  EXPECT_TRUE(fs::exists(file("kvsnap:c:theirs")));
}

// Without a key only ownership says who wrote an object: a folder others can write is refused,
// naming it, unless the tier has a key; in a sticky folder (others may add files), a file of
// another user reads as missing.
TEST_F(DirStoreTest, WithoutAKeyOnlyThisUsersFilesInAPrivateFolderAreTrusted) {
  fs::create_directories(folder);
  fs::permissions(folder, fs::perms::all);  // 0777
  HybridStack stack;
  EXPECT_TRUE(testing::throws_error(
      [&] { (void)Tier::open("dir:" + folder.string(), stack.layers(), tier_options()); },
      {"Tier::open", folder.c_str(), "mode 0777", "give the tier a key"}));
  EXPECT_NO_THROW((void)Tier::open("dir:" + folder.string(), stack.layers(),
                                   tier_options("", "0123456789abcdef0123456789abcdef")));
  fs::permissions(folder, fs::perms::all | fs::perms::sticky_bit);  // 1777, like /tmp
  DirStore store(folder.string(), /*own_files_only=*/true);
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:p:theirs", "planted"}};
  (void)store.write(batch, Clock::now() + 2s);
  const std::vector<std::string> keys{"kvsnap:p:theirs"};
  EXPECT_EQ(store.fetch(keys, Clock::now() + 2s, kNoLimit).at(0), "planted");  // this user's
  const passwd* nobody = ::getpwnam("nobody");
  if (nobody == nullptr || ::geteuid() == nobody->pw_uid ||
      ::chown(file(keys[0]).c_str(), nobody->pw_uid, static_cast<gid_t>(-1)) != 0) {
    GTEST_SKIP() << "cannot hand a file to user nobody (not root)";
  }
  EXPECT_EQ(store.fetch(keys, Clock::now() + 2s, kNoLimit).at(0), std::nullopt);
  EXPECT_FALSE(exists(store, keys[0]));  // probe reads it as fetch does: the writer rewrites it
  EXPECT_EQ(DirStore(folder.string()).fetch(keys, Clock::now() + 2s, kNoLimit).at(0),
            "planted");  // keyed
  // Writing over it would fail in a sticky folder (not for root, who runs this): that object
  // is refused alone, and the rest of the batch is written.
  batch.objects = {{"kvsnap:p:theirs", "mine"}, {"kvsnap:p:mine", "mine"}};
  const detail::Store::Refused refused = store.write(batch, Clock::now() + 2s);
  EXPECT_EQ(refused.objects, 1);
  EXPECT_EQ(DirStore(folder.string()).fetch(keys, Clock::now() + 2s, kNoLimit).at(0), "planted");
  EXPECT_TRUE(exists(store, "kvsnap:p:mine"));
  // An index folder another user made lists nothing: its members are theirs to choose.
  batch = {};
  batch.index = {{"kvsnap:i:theirs", "5"}};
  (void)store.write(batch, Clock::now() + 2s);
  EXPECT_EQ(members_of(store, "kvsnap:i:theirs"), std::vector<std::string>{"5"});
  ASSERT_EQ(::chown(file("kvsnap:i:theirs").c_str(), nobody->pw_uid, static_cast<gid_t>(-1)), 0);
  EXPECT_TRUE(members_of(store, "kvsnap:i:theirs").empty());
  DirStore keyed(folder.string());
  EXPECT_EQ(members_of(keyed, "kvsnap:i:theirs"), std::vector<std::string>{"5"});
}

// A file this user may not read (another user's object, mode 0600, in a folder both share) is
// missing, in fetch and probe alike: it failed the whole lookup, the objects that would have hit
// included. Run as user nobody in a child (root reads every file).
TEST_F(DirStoreTest, AnObjectThisUserMayNotReadIsMissing) {
  const passwd* nobody = ::getpwnam("nobody");
  if (nobody == nullptr || ::geteuid() != 0) GTEST_SKIP() << "needs root, to become nobody";
  fs::create_directories(folder);
  fs::permissions(folder, fs::perms::all | fs::perms::sticky_bit);  // 1777, like /tmp
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:p:roots", "root's"}};
  (void)DirStore(folder.string()).write(batch, Clock::now() + 2s);  // mode 0600, root's
  const uid_t uid = nobody->pw_uid;
  const gid_t gid = nobody->pw_gid;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(gid) != 0 || ::setuid(uid) != 0) ::_exit(10);
    try {
      DirStore store(folder.string());  // keyed: other users' objects are read when they can be
      detail::WriteBatch mine;
      mine.objects = {{"kvsnap:p:nobodys", "nobody's"}};
      (void)store.write(mine, Clock::now() + 2s);
      const std::vector<std::string> keys{"kvsnap:p:roots", "kvsnap:p:nobodys"};
      const auto values = store.fetch(keys, Clock::now() + 2s, kNoLimit);
      if (values.at(0) != std::nullopt) ::_exit(11);
      if (values.at(1) != "nobody's") ::_exit(12);
      std::vector<std::vector<std::string>> members;
      std::vector<int64_t> found;
      store.probe({}, keys, Clock::now() + 2s, members, found);
      ::_exit(found.at(0) >= 0 ? 13 : found.at(1) >= 0 ? 0 : 14);
    } catch (...) {
      ::_exit(15);  // the lookup failed
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10 could not become nobody, 11 read root's file, 12 lost "
                                       "its own, 13 probe found root's, 14 not its own, 15 threw";
}

// A folder that refuses writes (here its name taken by a file: the store's folder gone) is said
// in the log once, as a Redis store's refusal is, and so is its recovery.
TEST_F(DirStoreTest, RefusedWritesAndTheirRecoveryAreSaidOnce) {
  std::vector<std::string> log;
  auto health = std::make_shared<detail::StoreHealth>(
      "dir:" + folder.string(), [&](const std::string& line) { log.push_back(line); }, [] {});
  DirStore store(folder.string(), false, 0s, health);
  detail::WriteBatch batch;
  batch.objects = {{"kvsnap:c:one", "a"}};
  (void)store.write(batch, Clock::now() + 2s);
  fs::remove_all(folder);
  { std::ofstream(folder) << "not a folder"; }
  for (int i = 0; i < 3; ++i) {
    EXPECT_THROW((void)store.write(batch, Clock::now() + 2s), detail::StoreFailure);
  }
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("refuses writes"), std::string::npos) << log[0];
  fs::remove(folder);
  fs::create_directories(folder);
  (void)store.write(batch, Clock::now() + 2s);
  ASSERT_EQ(log.size(), 2u);
  EXPECT_NE(log[1].find("takes writes again"), std::string::npos) << log[1];
}

// An index folder planted with more entries than any chunk has offsets: probe lists at most
// kMaximumIndexMembers of them, and stops at the deadline.
TEST_F(DirStoreTest, AnIndexPlantedWithManyEntriesCostsABoundedListing) {
  DirStore store(folder.string());
  const std::string set = "kvsnap:i:planted";
  fs::create_directories(file(set));
  const size_t planted = static_cast<size_t>(DirStore::kMaximumIndexMembers) + 3000;
  for (size_t i = 0; i < planted; ++i) {
    const int fd =
        ::open((file(set) / std::to_string(i)).c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  EXPECT_EQ(static_cast<int64_t>(members_of(store, set).size()), DirStore::kMaximumIndexMembers);
  // A deadline that passes while it lists: a StoreFailure, not the whole folder.
  const std::vector<std::string> sets{set};
  std::vector<std::vector<std::string>> members;
  std::vector<int64_t> sizes;
  bool timed_out = false;
  for (int attempt = 0; attempt < 20 && !timed_out; ++attempt) {
    try {
      store.probe(sets, {}, Clock::now() + std::chrono::microseconds(200 * (attempt + 1)), members,
                  sizes);
    } catch (const detail::StoreFailure& failure) {
      timed_out = failure.reason == detail::StoreFailure::Reason::timed_out && !members.empty() &&
                  !members[0].empty();
    }
  }
  EXPECT_TRUE(timed_out) << "no probe stopped at its deadline in the middle of the listing";
}

// The whole tier: a FIFO planted over the deepest restore point costs that point (the lookup
// falls back to the next), never the request's time past the lookup timeout.
TEST_F(DirStoreTest, AFifoOverARestorePointCostsOnlyThatPoint) {
  const std::string address = "dir:" + folder.string();
  const Conversation talk;
  {
    TierProcess writer(address);
    (void)writer.turn(talk.first, talk.reply, talk.ends);  // points 20, 26, 31
  }
  const fs::path point = file(ObjectNames(tier_options(), address).point(talk.second, 31));
  fs::remove(point);
  ASSERT_EQ(::mkfifo(point.c_str(), 0600), 0);
  for (const auto timeout : {50ms, 2000ms}) {
    TierOptions options = tier_options();
    options.lookup_timeout = timeout;
    TierProcess reader(address, options);
    auto done = std::async(std::launch::async, [&] {
      return reader.tier->lookup(talk.second, static_cast<int64_t>(talk.second.size()) - 1).offset;
    });
    const bool finished = done.wait_for(timeout + 2s) == std::future_status::ready;
    if (!finished) release_fifo(point);
    const int64_t offset = done.get();
    EXPECT_TRUE(finished) << "a lookup with a " << timeout.count() << " ms timeout still ran";
    if (timeout == 2000ms) {
      EXPECT_EQ(offset, 26);  // the next point (with 50 ms the lookup may time out)
    }
    EXPECT_EQ(reader.tier->stats().rejected, 0);  // missing, not damaged
  }
}

}  // namespace
}  // namespace kvsnap
