// load_tier_key: the MAC key file, checked like OpenSSH checks a private key — a regular file
// of the user who runs kvsnap (or root), with no access for group or others — before it is
// trusted. (A general check of kvsnap's private files is being added to persist/files.h on the
// security branch, read_private_file with PrivacyRule::secret; until it is on main, the tier
// keeps this local one. Once it lands, load_tier_key should call it.)
#include <fcntl.h>
#include <fmt/format.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>

#include "kvsnap/tier.h"

namespace kvsnap {
namespace {

// "name (uid N)", or "uid N" for a user without a name.
std::string user_name(uid_t uid) {
  passwd entry{};
  passwd* found = nullptr;
  char buffer[1024];
  if (::getpwuid_r(uid, &entry, buffer, sizeof(buffer), &found) == 0 && found != nullptr) {
    return fmt::format("{} (uid {})", found->pw_name, uid);
  }
  return fmt::format("uid {}", uid);
}

constexpr size_t kMinimumKeyBytes = 16;

}  // namespace

std::string load_tier_key(const std::string& path) {
  const auto fail = [&](const std::string& why) {
    return Error(fmt::format("load_tier_key: key file {}: {}", path, why));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) throw fail(fmt::format("cannot open it ({})", std::strerror(errno)));
  struct stat status {};
  std::string contents;
  const auto close_and = [&](Error error) {
    ::close(fd);
    return error;
  };
  // Checked on the open file, not the path: what is read is what was checked.
  if (::fstat(fd, &status) != 0) throw close_and(fail(std::strerror(errno)));
  if (!S_ISREG(status.st_mode)) throw close_and(fail("not a regular file"));
  const unsigned mode = status.st_mode & 07777;
  // Root's files are trusted too (root can change any file anyway), as OpenSSH's StrictModes.
  if (status.st_uid != ::geteuid() && status.st_uid != 0) {
    throw close_and(fail(fmt::format(
        "owned by {} with mode {:04o}, not by {} who runs kvsnap (or root): another user could "
        "have written it (chown it, or use a key file of your own)",
        user_name(status.st_uid), mode, user_name(::geteuid()))));
  }
  if ((mode & 077) != 0) {
    throw close_and(fail(fmt::format(
        "owned by {} with mode {:04o}: group or others have access to it (chmod 600 {})",
        user_name(status.st_uid), mode, path)));
  }
  char buffer[4096];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof(buffer))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw close_and(fail(fmt::format("cannot read it ({})", std::strerror(errno))));
    contents.append(buffer, static_cast<size_t>(n));
    if (contents.size() > (size_t(1) << 20)) throw close_and(fail("larger than 1 MiB"));
  }
  ::close(fd);
  while (!contents.empty() && std::isspace(static_cast<unsigned char>(contents.back()))) {
    contents.pop_back();
  }
  if (contents.size() < kMinimumKeyBytes) {
    throw fail(
        fmt::format("holds {} bytes; a key needs at least {} (e.g. head -c 32 /dev/urandom > {})",
                    contents.size(), kMinimumKeyBytes, path));
  }
  return contents;
}

}  // namespace kvsnap
