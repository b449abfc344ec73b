// A saved prefix cache is private (0700 folders, a 0600 file, whatever the umask), and load /
// saved_in refuse one another user owns or others can write unless LoadOptions::allow_shared.
#include <gtest/gtest.h>
#include <kvsnap/prefix_cache.h>

#include <filesystem>

#include "support/conversation.h"
#include "support/private_support.h"

namespace kvsnap::prefix_cache_private_test {
namespace {

namespace fs = std::filesystem;
using testing::give_to;
using testing::HybridStack;
using testing::mode_of;
using testing::nobody_uid;
using testing::private_scratch;
using testing::run_turn;
using testing::ScopedUmask;
using testing::set_mode;
using testing::throws_error;
using testing::tokens;
using testing::user_phrase;
using testing::operator+;

const LoadOptions kShared{.allow_shared = true};

// Saves a cache that has seen two requests to `dir`; returns its node count.
int64_t save_warm(const std::string& dir, const SaveOptions& options = {}) {
  HybridStack stack;
  PrefixCache cache(stack.layers());
  run_turn(cache, stack, tokens(100, 12) + tokens(200, 6), tokens(300, 4));
  run_turn(cache, stack, tokens(100, 12) + tokens(400, 5), tokens(500, 3));
  cache.save(dir, "model", options);
  return cache.node_count();
}

TEST(PrefixCachePrivate, SaveMakesPrivateFoldersAndAPrivateFileWhateverTheUmask) {
  // 0277 masks even the owner's write bit: only the explicit fchmod after creating gives 0600 /
  // 0700.
  for (const mode_t mask : {mode_t{000}, mode_t{077}, mode_t{0277}}) {
    SCOPED_TRACE(mask);
    const ScopedUmask umask(mask);
    const fs::path base = private_scratch("prefix_umask");
    save_warm((base / "a" / "b").string());
    EXPECT_EQ(mode_of(base / "a"), 0700u);
    EXPECT_EQ(mode_of(base / "a" / "b"), 0700u);
    EXPECT_EQ(mode_of(base / "a" / "b" / "prefix_cache.safetensors"), 0600u);
    // A folder that exists keeps its mode, tighter or looser.
    set_mode(base / "a" / "b", 0755);
    save_warm((base / "a" / "b").string());
    EXPECT_EQ(mode_of(base / "a" / "b"), 0755u);
    // One that load would refuse, save refuses too, writing nothing, unless shared.
    set_mode(base / "a" / "b", 0777);
    const fs::path file = base / "a" / "b" / "prefix_cache.safetensors";
    const auto written = fs::last_write_time(file);
    EXPECT_TRUE(throws_error(
        [&] { save_warm((base / "a" / "b").string()); },
        {"PrefixCache::save: refusing the folder", "mode 0777", "set SaveOptions::shared"}));
    EXPECT_EQ(fs::last_write_time(file), written);
    EXPECT_EQ(mode_of(file), 0600u);
    save_warm((base / "a" / "b").string(), {.shared = true});
    EXPECT_EQ(mode_of(base / "a" / "b"), 0777u);
    EXPECT_EQ(mode_of(file), 0644u);
    fs::remove_all(base);
  }
}

// Loading into a cache that holds a trie already: a refusal changes nothing.
void expect_refused_then_shared(const std::string& dir, int64_t saved_nodes,
                                std::initializer_list<const char*> fragments) {
  HybridStack stack;
  PrefixCache cache(stack.layers());
  run_turn(cache, stack, tokens(700, 9), tokens(800, 2));
  const int64_t before = cache.node_count();
  const std::string trie = cache.debug_string();
  EXPECT_TRUE(throws_error([&] { cache.load(dir, "model"); }, fragments));
  EXPECT_EQ(cache.node_count(), before);
  EXPECT_EQ(cache.debug_string(), trie);
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_TRUE(
      throws_error([&] { (void)PrefixCache::saved_in(dir); }, {"PrefixCache::saved_in: refusing"}));
  EXPECT_TRUE(PrefixCache::saved_in(dir, kShared));
  cache.load(dir, "model", kShared);
  EXPECT_EQ(cache.node_count(), saved_nodes);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(PrefixCachePrivate, AFolderOrFileOthersCanWriteIsRefusedUnlessShared) {
  const fs::path dir = private_scratch("prefix_writable");
  const int64_t nodes = save_warm(dir.string());
  const std::string file = (dir / "prefix_cache.safetensors").string();
  set_mode(dir, 0777);
  const std::string folder = "PrefixCache::load: refusing the folder " + dir.string() +
                             " holding " + file + " (owner " + user_phrase(::geteuid()) +
                             ", mode 0777): group and others can write it";
  expect_refused_then_shared(dir.string(), nodes,
                             {folder.c_str(), "set LoadOptions::allow_shared to trust it anyway"});
  set_mode(dir, 0700);
  set_mode(file, 0620);
  const std::string named = "PrefixCache::load: refusing the file " + file + " (owner " +
                            user_phrase(::geteuid()) + ", mode 0620): its group can write it";
  expect_refused_then_shared(dir.string(), nodes, {named.c_str(), "LoadOptions::allow_shared"});
  set_mode(file, 0600);
  EXPECT_TRUE(PrefixCache::saved_in(dir.string()));
  // Nothing saved: nothing to refuse, whatever the folder.
  set_mode(dir, 0777);
  fs::remove(file);
  EXPECT_FALSE(PrefixCache::saved_in(dir.string()));
  fs::remove_all(dir);
}

// A load refuses a folder before it touches anything in it: a dead writer's temporary there is
// removed only once the folder is trusted.
TEST(PrefixCachePrivate, ARefusedFolderIsLeftAsItIs) {
  const fs::path dir = private_scratch("prefix_refused");
  const int64_t nodes = save_warm(dir.string());
  const std::string stale =
      testing::dead_writers_temporary((dir / "prefix_cache.safetensors").string());
  set_mode(dir, 0777);
  HybridStack stack;
  PrefixCache cache(stack.layers());
  EXPECT_TRUE(throws_error([&] { cache.load(dir.string(), "model"); }, {"refusing the folder"}));
  EXPECT_TRUE(fs::exists(stale));
  cache.load(dir.string(), "model", kShared);
  EXPECT_EQ(cache.node_count(), nodes);
  EXPECT_FALSE(fs::exists(stale));
  fs::remove_all(dir);
}

TEST(PrefixCachePrivate, AnotherUsersFolderOrFileIsRefusedUnlessShared) {
  std::string why;
  const std::optional<uid_t> nobody = nobody_uid(why);
  if (!nobody) GTEST_SKIP() << why;
  const fs::path dir = private_scratch("prefix_foreign");
  const int64_t nodes = save_warm(dir.string());
  const std::string file = (dir / "prefix_cache.safetensors").string();
  const std::string owner = "(owner " + user_phrase(*nobody) + ", mode 0600): another user owns it";
  give_to(file, *nobody);
  expect_refused_then_shared(dir.string(), nodes,
                             {"refusing the file", file.c_str(), owner.c_str()});
  give_to(file, ::geteuid());
  give_to(dir, *nobody);
  const std::string folder = "refusing the folder " + dir.string() + " holding " + file +
                             " (owner " + user_phrase(*nobody) +
                             ", mode 0700): another user owns it";
  expect_refused_then_shared(dir.string(), nodes, {folder.c_str()});
  fs::remove_all(dir);
}

// A cache folder shared between users (LoadOptions::allow_shared): a save for it
// (SaveOptions::shared) is mode 0644 whatever the umask, so another user — here nobody, in a
// child — loads it; the private save's 0600 file that user cannot read.
TEST(PrefixCachePrivate, ASharedSaveIsOneTheFoldersOtherUsersCanLoad) {
  std::string why;
  const std::optional<uid_t> nobody = nobody_uid(why);
  if (!nobody) GTEST_SKIP() << why;
  const ScopedUmask umask(077);
  const fs::path dir = private_scratch("prefix_shared_save");
  set_mode(dir, 0755);
  HybridStack stack;
  PrefixCache cache(stack.layers());
  run_turn(cache, stack, tokens(100, 12) + tokens(200, 6), tokens(300, 4));
  const fs::path file = dir / "prefix_cache.safetensors";
  // 0: nobody loaded the cache; 1: the load failed; 10: could not become nobody.
  const auto load_as_nobody = [&] {
    const pid_t child = ::fork();
    if (child == 0) {
      if (::setuid(*nobody) != 0) ::_exit(10);
      try {
        HybridStack theirs;
        PrefixCache loaded(theirs.layers());
        loaded.load(dir.string(), "model", kShared);
        ::_exit(loaded.node_count() == cache.node_count() ? 0 : 2);
      } catch (...) {
        ::_exit(1);
      }
    }
    int status = 0;
    EXPECT_EQ(::waitpid(child, &status, 0), child);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  cache.save(dir.string(), "model");
  EXPECT_EQ(mode_of(file), 0600u);
  EXPECT_EQ(load_as_nobody(), 1);
  cache.save(dir.string(), "model", {.shared = true});
  EXPECT_EQ(mode_of(file), 0644u);
  EXPECT_EQ(load_as_nobody(), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvsnap::prefix_cache_private_test
