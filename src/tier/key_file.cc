// load_tier_key: the MAC key file, checked like OpenSSH checks a private key before it is
// trusted — through persist/files.h's read_private_file with PrivacyRule::secret: the folder that
// really holds the file is owned by the user who runs kvsnap (or root) and not writable by group
// or others (or is sticky, like /tmp), and the file is a regular file of that user (or root)
// that group and others can neither read nor write, at most 1 MiB. There is no opt-out: a key
// readable by others is no key.
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>

#include "kvsnap/error.h"
#include "kvsnap/tier.h"
#include "persist/files.h"

namespace kvsnap {
namespace {

constexpr size_t kMinimumKeyBytes = 16;
constexpr int64_t kMaximumKeyBytes = int64_t(1) << 20;

}  // namespace

std::string load_tier_key(const std::string& path) {
  detail::PrivacyRule rule;
  rule.call = "load_tier_key";
  rule.secret = true;
  const auto named = [](const Error& error) {
    // The checks' errors name the call already; open's and read's do not.
    const std::string what = error.what();
    return Error(what.starts_with("load_tier_key: ") ? what : "load_tier_key: " + what);
  };
  detail::FileDescriptor file;
  try {
    file = detail::open_private_file(path, rule);
  } catch (const Error& error) {
    throw named(error);
  }
  // The size before any byte is read: a huge (or sparse) file is refused, not loaded.
  struct stat status {};
  if (::fstat(file.get(), &status) != 0 || status.st_size > kMaximumKeyBytes) {
    throw Error(fmt::format("load_tier_key: key file {} holds {} bytes; a key file is at most {}",
                            path, static_cast<int64_t>(status.st_size), kMaximumKeyBytes));
  }
  std::string contents(static_cast<size_t>(kMaximumKeyBytes) + 1, '\0');
  size_t size = 0;
  while (size < contents.size()) {
    const ssize_t n = ::read(file.get(), contents.data() + size, contents.size() - size);
    if (n == 0) break;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw Error(fmt::format("load_tier_key: error reading {} ({})", path, std::strerror(errno)));
    }
    size += static_cast<size_t>(n);
  }
  if (size > static_cast<size_t>(kMaximumKeyBytes)) {
    throw Error(fmt::format("load_tier_key: key file {} grew past {} bytes while read", path,
                            kMaximumKeyBytes));
  }
  contents.resize(size);
  while (!contents.empty() && std::isspace(static_cast<unsigned char>(contents.back()))) {
    contents.pop_back();
  }
  if (contents.size() < kMinimumKeyBytes) {
    throw Error(fmt::format(
        "load_tier_key: key file {} holds {} bytes; a key needs at least {} (e.g. head -c 32 "
        "/dev/urandom > {}; chmod 600 {})",
        path, contents.size(), kMinimumKeyBytes, path, path));
  }
  return contents;
}

}  // namespace kvsnap
