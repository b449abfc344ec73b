// load_tier_key: the MAC key file, checked like OpenSSH checks a private key before it is
// trusted — through persist/files.h's read_private_file with PrivacyRule::secret: the folder that
// really holds the file is owned by the user who runs kvsnap (or root) and not writable by group
// or others, and the file is a regular file of that user (or root) that group and others can
// neither read nor write. There is no opt-out: a key readable by others is no key.
#include <fmt/format.h>

#include <cctype>

#include "kvsnap/error.h"
#include "kvsnap/tier.h"
#include "persist/files.h"

namespace kvsnap {
namespace {

constexpr size_t kMinimumKeyBytes = 16;
constexpr size_t kMaximumKeyBytes = size_t(1) << 20;

}  // namespace

std::string load_tier_key(const std::string& path) {
  detail::PrivacyRule rule;
  rule.call = "load_tier_key";
  rule.secret = true;
  std::string contents;
  try {
    contents = detail::read_private_file(path, rule);
  } catch (const Error& error) {
    const std::string what = error.what();
    // read_private_file's own errors name the call already; the open/read ones do not.
    throw Error(what.starts_with("load_tier_key: ") ? what : "load_tier_key: " + what);
  }
  if (contents.size() > kMaximumKeyBytes) {
    throw Error(fmt::format("load_tier_key: key file {} holds {} bytes; a key file is at most {}",
                            path, contents.size(), kMaximumKeyBytes));
  }
  while (!contents.empty() && std::isspace(static_cast<unsigned char>(contents.back()))) {
    contents.pop_back();
  }
  if (contents.size() < kMinimumKeyBytes) {
    throw Error(fmt::format(
        "load_tier_key: key file {} holds {} bytes; a key needs at least {} (e.g. head -c 32 "
        "/dev/urandom > {})",
        path, contents.size(), kMinimumKeyBytes, path));
  }
  return contents;
}

}  // namespace kvsnap
