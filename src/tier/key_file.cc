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

// The contents of the secret file `path` (checked as the header says), trailing whitespace
// removed; errors name `call`.
std::string read_secret(const std::string& path, const std::string& call, const char* what_file) {
  detail::PrivacyRule rule;
  rule.call = call;
  rule.secret = true;
  const std::string prefix = call + ": ";
  const auto named = [&](const Error& error) {
    // The checks' errors name the call already; open's and read's do not.
    const std::string what = error.what();
    return Error(what.starts_with(prefix) ? what : prefix + what);
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
    throw Error(fmt::format("{}: {} {} holds {} bytes; one is at most {}", call, what_file, path,
                            static_cast<int64_t>(status.st_size), kMaximumKeyBytes));
  }
  std::string contents(static_cast<size_t>(kMaximumKeyBytes) + 1, '\0');
  size_t size = 0;
  while (size < contents.size()) {
    const ssize_t n = ::read(file.get(), contents.data() + size, contents.size() - size);
    if (n == 0) break;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw Error(fmt::format("{}: error reading {} ({})", call, path, std::strerror(errno)));
    }
    size += static_cast<size_t>(n);
  }
  if (size > static_cast<size_t>(kMaximumKeyBytes)) {
    throw Error(fmt::format("{}: {} {} grew past {} bytes while read", call, what_file, path,
                            kMaximumKeyBytes));
  }
  contents.resize(size);
  while (!contents.empty() && std::isspace(static_cast<unsigned char>(contents.back()))) {
    contents.pop_back();
  }
  return contents;
}

}  // namespace

std::string load_tier_key(const std::string& path) {
  const std::string contents = read_secret(path, "load_tier_key", "key file");
  if (contents.size() < kMinimumKeyBytes) {
    throw Error(fmt::format(
        "load_tier_key: key file {} holds {} bytes; a key needs at least {} (e.g. head -c 32 "
        "/dev/urandom > {}; chmod 600 {})",
        path, contents.size(), kMinimumKeyBytes, path, path));
  }
  return contents;
}

std::string load_tier_address(const std::string& path) {
  std::string address = read_secret(path, "load_tier_address", "address file");
  const size_t first = address.find_first_not_of(" \t\r\n");
  address.erase(0, first == std::string::npos ? address.size() : first);
  try {
    Tier::check_address(address);
  } catch (const Error& error) {
    throw Error(fmt::format("load_tier_address: {}: {}", path, error.what()));
  }
  return address;
}

}  // namespace kvsnap
