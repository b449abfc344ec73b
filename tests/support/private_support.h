// Helpers for the tests of private files: a scoped umask, modes and owners of paths, another
// user (nobody) to hand files to, and the phrases check_private's errors are made of.
#pragma once

#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "persist/files.h"

namespace kvsnap::testing {

// `name` in this process's private scratch folder for `tag` (TMPDIR/kvsnap_<tag>_<pid>, created
// when missing, 0700 whatever the umask: kvsnap loads nothing from a folder others can write).
inline std::filesystem::path private_scratch_file(const std::string& tag, const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("kvsnap_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all);
  return dir / name;
}

// Sets the process umask for its lifetime and restores the previous one.
class ScopedUmask {
 public:
  explicit ScopedUmask(mode_t mask) : previous_(::umask(mask)) {}
  ~ScopedUmask() { ::umask(previous_); }
  ScopedUmask(const ScopedUmask&) = delete;
  ScopedUmask& operator=(const ScopedUmask&) = delete;

 private:
  mode_t previous_;
};

// The permission bits of `path` (sticky bit included), not following a final link.
inline mode_t mode_of(const std::filesystem::path& path) {
  struct stat status {};
  if (::lstat(path.c_str(), &status) != 0) return 0xffff;
  return status.st_mode & 07777;
}

inline void set_mode(const std::filesystem::path& path, mode_t mode) {
  ASSERT_EQ(::chmod(path.c_str(), mode), 0) << path;
}

// "0644": a mode as kvsnap's errors write it.
inline std::string octal(int mode) {
  char text[16];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode));
  return text;
}

// "name (uid N)" as kvsnap's errors name a user.
inline std::string user_phrase(uid_t uid) {
  const passwd* entry = ::getpwuid(uid);
  return (entry != nullptr ? std::string(entry->pw_name) : std::string("?")) + " (uid " +
         std::to_string(uid) + ")";
}
inline std::string me_phrase() { return "this user, " + user_phrase(::geteuid()) + ","; }

// The uid of "nobody", when this process may hand files to it (it runs as root); else nullopt
// with `why` set, for GTEST_SKIP.
inline std::optional<uid_t> nobody_uid(std::string& why) {
  if (::geteuid() != 0) {
    why = "handing a file to another user (chown) needs root; this test runs as uid " +
          std::to_string(::geteuid());
    return std::nullopt;
  }
  const passwd* nobody = ::getpwnam("nobody");
  if (nobody == nullptr) {
    why = "no user \"nobody\" on this machine";
    return std::nullopt;
  }
  return nobody->pw_uid;
}

inline void give_to(const std::filesystem::path& path, uid_t uid) {
  ASSERT_EQ(::lchown(path.c_str(), uid, static_cast<gid_t>(-1)), 0) << path;
}

// A fresh folder of mode 0700 under the temporary folder (removed first when it exists).
inline std::filesystem::path private_scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvsnap_private_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all);
  return dir;
}

// A temporary of `path` as a writer killed mid-save leaves it (named for a pid no process has:
// a child's, reaped), which loads and saves remove once they trust the folder.
inline std::string dead_writers_temporary(const std::string& path) {
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string name =
      path + ".tmp-" + std::to_string(dead) + "-1-" + detail::writer_place();  // files.h
  std::FILE* file = std::fopen(name.c_str(), "w");
  EXPECT_NE(file, nullptr) << name;
  if (file != nullptr) std::fclose(file);
  return name;
}

}  // namespace kvsnap::testing
