#include "persist/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace kvsnap::detail {

namespace {

// What a file's temporaries are named after: its name, or — where the name leaves no room for
// ".tmp-PID-NUMBER-PLACE" within a folder entry's 255 bytes — its first 180 bytes (fewer, not to
// cut a UTF-8 character: some file systems refuse invalid UTF-8) and a hash of the whole (the
// same for every save of it: stale ones are still found).
std::string temporary_stem(const std::string& filename) {
  constexpr size_t kMostName = 255, kSuffix = 5 + 10 + 1 + 20 + 1 + 16;
  if (filename.size() + kSuffix <= kMostName) return filename;
  size_t kept = 180;
  while (kept > 0 && (static_cast<unsigned char>(filename[kept]) & 0xC0) == 0x80) --kept;
  return fmt::format("{}~{:016x}", filename.substr(0, kept),
                     XXH64(filename.data(), filename.size(), 0));
}

// A temporary's name after `prefix`: "<pid>-<n>-<place>", or as older kvsnap named them,
// "<pid>-<n>" or "<pid>" (place empty, number -1 where absent).
struct TemporaryName {
  pid_t pid = 0;  // 0: not a temporary's name
  int64_t number = -1;
  std::string place;
};

TemporaryName parse_temporary(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return {};
  std::vector<std::string> parts;
  for (size_t at = prefix.size();;) {
    const size_t dash = name.find('-', at);
    parts.push_back(name.substr(at, dash == std::string::npos ? dash : dash - at));
    if (dash == std::string::npos) break;
    at = dash + 1;
  }
  const auto made_of = [](const std::string& text, size_t most, auto is_digit) {
    return !text.empty() && text.size() <= most &&
           std::all_of(text.begin(), text.end(), [&](unsigned char c) { return is_digit(c); });
  };
  const auto decimal = [](unsigned char c) { return std::isdigit(c) != 0; };
  const auto hex = [](unsigned char c) { return std::isdigit(c) != 0 || (c >= 'a' && c <= 'f'); };
  if (parts.size() > 3 || !made_of(parts[0], 9, decimal)) return {};
  if (parts.size() >= 2 && !made_of(parts[1], 18, decimal)) return {};  // fits an int64
  if (parts.size() == 3 && (parts[2].size() != 16 || !made_of(parts[2], 16, hex))) return {};
  TemporaryName out;
  out.pid = static_cast<pid_t>(std::stol(parts[0]));
  if (parts.size() >= 2) out.number = std::stoll(parts[1]);
  if (parts.size() == 3) out.place = parts[2];
  return out;
}

// The numbers of this process's temporaries being written now: the only ones of its pid, named
// from its place, that are not stale. Never destroyed: a writer thread may save during the
// process's exit, after static objects would have gone.
struct InFlightSet {
  std::mutex mutex;
  std::set<int64_t> numbers;
};
InFlightSet& in_flight() {
  static InFlightSet* const set = new InFlightSet;
  return *set;
}

bool writing(int64_t number) {
  InFlightSet& set = in_flight();
  const std::lock_guard<std::mutex> lock(set.mutex);
  return set.numbers.count(number) > 0;
}

// Where this process runs, and whether that tells this host's boot and PID namespace apart from
// others' (without /proc, only the host name: other containers may share it).
struct Place {
  std::string hex;
  bool probeable = false;
};
const Place& place() {
  static const Place* const here = [] {  // never destroyed, as in_flight()
    std::string boot;
    std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;  // empty where there is none
    std::string identity = boot;
    struct stat ns {};
    const bool namespaced = ::stat("/proc/self/ns/pid", &ns) == 0;
    if (namespaced) {
      identity +=
          fmt::format(" {} {}", static_cast<uint64_t>(ns.st_dev), static_cast<uint64_t>(ns.st_ino));
    }
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) == 0) identity += fmt::format(" {}", host);
    return new Place{fmt::format("{:016x}", XXH64(identity.data(), identity.size(), 0)),
                     !boot.empty() && namespaced};
  }();
  return *here;
}

}  // namespace

int sync_folder_error(const std::string& folder) {
  const FileDescriptor dir(
      ::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  const int error = dir.get() < 0 ? errno : ::fsync(dir.get()) != 0 ? errno : 0;
  return error == EACCES || error == EINVAL ? 0 : error;
}

timespec folder_now(const std::string& folder) {
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  std::string name = (std::filesystem::path(folder) / "kvsnap-clock-XXXXXX").string();
  const int fd = ::mkstemp(name.data());
  if (fd < 0) return now;
  struct stat status {};
  if (::fstat(fd, &status) == 0) now = status.st_mtim;
  ::close(fd);
  ::unlink(name.c_str());
  return now;
}

bool list_folder(const std::string& folder, const std::function<bool(const char* name)>& visit) {
  const std::unique_ptr<DIR, int (*)(DIR*)> listing(::opendir(folder.c_str()), ::closedir);
  if (listing == nullptr) return false;
  while (const dirent* entry = ::readdir(listing.get())) {
    if (std::strcmp(entry->d_name, ".") == 0 || std::strcmp(entry->d_name, "..") == 0) continue;
    if (!visit(entry->d_name)) break;
  }
  return true;
}

const std::string& writer_place() { return place().hex; }

void remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  try {
    const fs::path target(path);
    if (names_no_file(path)) return;
    const std::string prefix = temporary_stem(target.filename().string()) + ".tmp-";
    const fs::path folder = target.parent_path().empty() ? fs::path(".") : target.parent_path();
    const Place& here = place();
    std::optional<time_t> now;  // the folder's clock, read once there is an age to judge
    // Best effort: an unreadable folder is left as it is.
    (void)list_folder(folder.string(), [&](const char* name) {
      const TemporaryName temporary = parse_temporary(name, prefix);
      if (temporary.pid <= 0) return true;
      const fs::path file = folder / name;
      bool stale = false;
      if (temporary.place != here.hex || !here.probeable) {
        struct stat status {};
        if (!now) now = folder_now(folder.string()).tv_sec;
        stale = ::lstat(file.c_str(), &status) == 0 &&
                status.st_mtim.tv_sec < *now - static_cast<time_t>(kStaleForeignTemporary);
      } else if (temporary.pid != ::getpid()) {
        // kill(pid, 0) probes without signalling: ESRCH means no such process (EPERM: one runs).
        stale = ::kill(temporary.pid, 0) != 0 && errno == ESRCH;
      } else {
        stale = !writing(temporary.number);
      }
      if (stale) (void)::unlink(file.c_str());  // best effort: the next one may go
      return true;
    });
  } catch (const std::exception&) {  // out of memory naming a path: best effort
  }
}

void remove_stale_temporaries_after_load(const std::string& path, const PrivacyRule& rule) {
  if (!rule.allow_shared) {
    const std::filesystem::path given(path);
    const std::string folder = given.parent_path().empty() ? "." : given.parent_path().string();
    char* const file = ::realpath(path.c_str(), nullptr);
    char* const named = ::realpath(folder.c_str(), nullptr);
    const bool same = file != nullptr && named != nullptr &&
                      std::filesystem::path(file).parent_path() == std::filesystem::path(named);
    std::free(file);
    std::free(named);
    if (!same) return;  // the folder named was not the one checked: left as it is
  }
  remove_stale_temporaries(path);
}

namespace {

// How many temporaries this process has named: each save's own, so saves of one path from
// several threads never write, rename or remove each other's.
std::atomic<uint64_t> temporaries_named{0};

std::string temporary_path(const std::string& path, uint64_t number) {
  const std::filesystem::path target(path);
  return (target.parent_path() / fmt::format("{}.tmp-{}-{}-{}",
                                             temporary_stem(target.filename().string()), ::getpid(),
                                             number, writer_place()))
      .string();
}

}  // namespace

// Marks a temporary's number as being written while it lives (see remove_stale_temporaries).
// Not in the anonymous namespace: PreparedFile::Aside holds one (GCC's -Wsubobject-linkage, in
// unity builds).
class InFlight {
 public:
  explicit InFlight(int64_t number) : number_(number) {
    InFlightSet& set = in_flight();
    const std::lock_guard<std::mutex> lock(set.mutex);
    set.numbers.insert(number);
  }
  ~InFlight() {
    InFlightSet& set = in_flight();
    const std::lock_guard<std::mutex> lock(set.mutex);
    set.numbers.erase(number_);
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  int64_t number_;
};

std::string next_temporary_path(const std::string& path) {
  return temporary_path(path, temporaries_named.load());
}

namespace {

// The rename of `path` into its folder is durable only once the folder is synced too. Throws
// when that fails (sync_folder_error).
void sync_folder(const std::string& path) {
  const std::string folder = std::filesystem::path(path).parent_path().string();
  const int error = sync_folder_error(folder);
  if (error == 0) return;
  throw Error(
      fmt::format("writing {}: syncing its folder {} after the rename failed ({}): the new "
                  "file is in place but may not survive a crash",
                  path, folder.empty() ? "." : folder, std::strerror(error)));
}

}  // namespace

int write_all(int fd, std::string_view bytes) {
  for (size_t written = 0; written < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    written += static_cast<size_t>(n);
  }
  return 0;
}

struct PreparedFile::Aside {
  std::string path, temporary;
  InFlight marked;  // the temporary is never swept as stale while it waits
};

PreparedFile::PreparedFile(std::unique_ptr<Aside> aside) : aside_(std::move(aside)) {}
PreparedFile::PreparedFile(PreparedFile&& other) noexcept
    : aside_(std::move(other.aside_)), in_place_(other.in_place_) {}
PreparedFile& PreparedFile::operator=(PreparedFile&& other) noexcept {
  if (this != &other) {
    discard();
    aside_ = std::move(other.aside_);
    in_place_ = other.in_place_;
  }
  return *this;
}
PreparedFile::~PreparedFile() { discard(); }

void PreparedFile::discard() noexcept {
  if (aside_ != nullptr) (void)::unlink(aside_->temporary.c_str());
  aside_.reset();
}

void PreparedFile::commit() {
  if (aside_ == nullptr) {
    throw Error(
        "PreparedFile::commit: nothing to commit (committed, or discarded after a failure)");
  }
  if (::rename(aside_->temporary.c_str(), aside_->path.c_str()) != 0) {
    const int error = errno;
    const std::string path = aside_->path;
    discard();
    throw Error(fmt::format("writing {}: rename failed ({})", path, std::strerror(error)));
  }
  const std::string path = aside_->path;
  aside_.reset();
  in_place_ = true;
  sync_folder(path);
}

PreparedFile prepare_file_atomically(const std::string& path, const std::string& bytes,
                                     bool clean_stale, mode_t mode) {
  if (clean_stale) remove_stale_temporaries(path);
  // The temporary is created here (O_EXCL): a name already there — a temporary of a process
  // with this pid in another PID namespace (containers sharing the folder) — is never written
  // into; the next number is tried.
  constexpr int kNames = 64;
  const std::string call = fmt::format("writing {}", path);
  std::unique_ptr<PreparedFile::Aside> aside;
  FileDescriptor created;
  for (int tried = 1; created.get() < 0; ++tried) {
    const uint64_t number = temporaries_named.fetch_add(1);
    // Marked before the file exists: never swept.
    aside.reset(new PreparedFile::Aside{path, temporary_path(path, number),
                                        InFlight(static_cast<int64_t>(number))});
    created = create_private_file(aside->temporary, call, /*exclusive=*/true, mode);
    if (created.get() < 0 && tried == kNames) {
      throw Error(fmt::format("{}: the {} temporary names up to {} are all taken", call, kNames,
                              aside->temporary));
    }
  }
  PreparedFile prepared(std::move(aside));  // from here, removed unless committed
  // `error`: the errno of the step, read before anything else (close) can change it.
  const auto fail = [&](const char* step, int error) {
    return Error(fmt::format("writing {}: {} failed ({})", path, step, std::strerror(error)));
  };
  const int fd = created.release();
  if (const int error = write_all(fd, bytes); error != 0) {
    ::close(fd);
    throw fail("write", error);
  }
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    throw fail("fsync", error);
  }
  if (::close(fd) != 0) throw fail("close", errno);
  return prepared;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

namespace {

// "nobody (uid 65534)", or "uid 1234 (no user name)".
std::string user(uid_t uid) {
  std::vector<char> buffer(16384);
  struct passwd entry {};
  struct passwd* found = nullptr;
  if (::getpwuid_r(uid, &entry, buffer.data(), buffer.size(), &found) == 0 && found != nullptr) {
    return fmt::format("{} (uid {})", found->pw_name, uid);
  }
  return fmt::format("uid {} (no user name)", uid);
}

// "its group", "others" or "group and others", for the bits of `mode` among group | other.
std::string who(mode_t mode, mode_t group, mode_t other) {
  if ((mode & group) != 0 && (mode & other) != 0) return "group and others";
  return (mode & group) != 0 ? "its group" : "others";
}

std::string describe(const struct stat& status) {
  return fmt::format("owner {}, mode {:04o}", user(status.st_uid), status.st_mode & 07777);
}

// What makes `status` (of a folder, or of a file) not private under `rule`; empty when nothing.
std::vector<std::string> problems(const struct stat& status, bool folder, const PrivacyRule& rule) {
  // Root can change any file anyway: what root owns is trusted, as OpenSSH's StrictModes does.
  const bool trusted_owner = status.st_uid == ::geteuid() || status.st_uid == 0;
  const mode_t mode = status.st_mode;
  // In a sticky folder others may add files but only a file's owner can rename or remove it.
  const bool sticky = folder && (mode & S_ISVTX) != 0 && trusted_owner;
  std::vector<std::string> out;
  if (folder ? !S_ISDIR(mode) : !S_ISREG(mode)) {
    out.push_back(folder ? "it is not a folder" : "it is not a regular file");
  }
  if (!trusted_owner) out.push_back("another user owns it");
  if (!sticky && (mode & (S_IWGRP | S_IWOTH)) != 0) {
    out.push_back(who(mode, S_IWGRP, S_IWOTH) + " can write it");
  }
  if (!folder && rule.secret && (mode & (S_IRGRP | S_IROTH)) != 0) {
    out.push_back(who(mode, S_IRGRP, S_IROTH) + " can read it");
  }
  return out;
}

// check_private and check_private_folder; `what` names the checked path in the error.
void check(const std::string& what, int fd, bool folder, const PrivacyRule& rule) {
  if (rule.allow_shared) return;
  struct stat status {};
  if (::fstat(fd, &status) != 0) {
    throw Error(fmt::format("{}: cannot check {} ({})", rule.call, what, std::strerror(errno)));
  }
  const std::vector<std::string> found = problems(status, folder, rule);
  if (found.empty()) return;
  std::string reasons;
  for (const std::string& problem : found) reasons += (reasons.empty() ? "" : ", ") + problem;
  throw Error(fmt::format(
      "{}: refusing the {} {} ({}): {}; kvsnap trusts only {} that this user, {}, {}owns and "
      "that group and others cannot write{}{}{}",
      rule.call, folder ? "folder" : "file", what, describe(status), reasons,
      folder ? "folders" : "files", user(::geteuid()), ::geteuid() == 0 ? "" : "or root ",
      folder ? " (or sticky folders, like /tmp)" : (rule.secret ? " or read" : ""),
      rule.override_with.empty() ? "" : "; ",
      rule.override_with.empty() ? "" : rule.override_with + " to trust it anyway"));
}

}  // namespace

void check_private(const std::string& path, int fd, const PrivacyRule& rule) {
  check(path, fd, false, rule);
}

void check_private_folder(const std::string& path, int fd, const PrivacyRule& rule) {
  check(path, fd, true, rule);
}

void check_private_folder(const std::string& path, const PrivacyRule& rule) {
  if (rule.allow_shared) return;
  const FileDescriptor folder(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (folder.get() < 0) {
    throw Error(fmt::format("{}: cannot open {} ({})", rule.call, path, std::strerror(errno)));
  }
  check(path, folder.get(), true, rule);
}

FileDescriptor open_private_file(const std::string& path, const PrivacyRule& rule) {
  const auto cannot_open = [&](int error) {
    return Error(
        fmt::format("{}: cannot open {} for reading ({})", rule.call, path, std::strerror(error)));
  };
  if (rule.allow_shared) {
    // Links are followed, as below, but nothing blocks (a FIFO is not waited on) and only a
    // regular file is read (not a FIFO, a device such as /dev/zero, a socket).
    FileDescriptor file(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
    if (file.get() < 0) throw cannot_open(errno);
    struct stat status {};
    if (::fstat(file.get(), &status) != 0) throw cannot_open(errno);
    if (S_ISDIR(status.st_mode)) throw cannot_open(EISDIR);
    if (!S_ISREG(status.st_mode)) {
      throw Error(fmt::format("{}: cannot open {} for reading (it is not a regular file)",
                              rule.call, path));
    }
    return file;
  }
  // The folder checked must be the one that really holds the file: resolve links first.
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (resolved == nullptr) throw cannot_open(errno);
  const std::filesystem::path real(resolved);
  std::free(resolved);
  const std::string named =
      real == path ? path : fmt::format("{} (resolved to {})", path, real.string());
  const FileDescriptor folder(
      ::open(real.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (folder.get() < 0) throw cannot_open(errno);
  check(fmt::format("{} holding {}", real.parent_path().string(), named), folder.get(), true, rule);
  // Relative to the checked folder, and never through a link swapped in since: what is checked
  // below is what is read.
  FileDescriptor file(::openat(folder.get(), real.filename().c_str(),
                               O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  struct stat status {};
  if (file.get() < 0) throw cannot_open(errno);
  if (::fstat(file.get(), &status) == 0 && S_ISDIR(status.st_mode)) throw cannot_open(EISDIR);
  check(named, file.get(), false, rule);
  return file;
}

std::string read_private_file(const std::string& path, const PrivacyRule& rule,
                              uint64_t max_bytes) {
  const FileDescriptor file = open_private_file(path, rule);
  const auto too_large = [&](uint64_t size, const char* more) {
    return too_large_to_load(rule, path, size, max_bytes, more);
  };
  struct stat status {};
  std::string bytes;
  if (::fstat(file.get(), &status) == 0 && S_ISREG(status.st_mode)) {
    if (static_cast<uint64_t>(status.st_size) > max_bytes)
      throw too_large(static_cast<uint64_t>(status.st_size), "");
    bytes.reserve(static_cast<size_t>(status.st_size));
  }
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(file.get(), buffer, sizeof buffer);
    if (n == 0) return bytes;
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("{}: error reading {} ({})", rule.call, path, std::strerror(errno)));
    }
    if (static_cast<uint64_t>(n) > max_bytes - bytes.size()) {
      throw too_large(bytes.size() + static_cast<uint64_t>(n), "at least ");
    }
    bytes.append(buffer, static_cast<size_t>(n));
  }
}

Error too_large_to_load(const PrivacyRule& rule, const std::string& path, uint64_t size,
                        uint64_t max_bytes, const char* more) {
  return Error(
      fmt::format("{}: cannot load {}: it holds {}{} bytes, more than the {} bytes a load "
                  "accepts{}",
                  rule.call, path, more, size, max_bytes,
                  max_bytes == loadable_bytes() ? " (the machine's memory)" : ""));
}

uint64_t loadable_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::numeric_limits<uint64_t>::max();
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

FileDescriptor create_private_file(const std::string& path, const std::string& call, bool exclusive,
                                   mode_t mode) {
  // Not O_TRUNC: whatever is there is checked before anything in it changes. O_NONBLOCK: a FIFO
  // planted at the name would block the open until someone read it (now it fails, or opens and
  // is refused below as not a regular file); it changes nothing for a regular file.
  FileDescriptor file(::open(
      path.c_str(),
      O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | (exclusive ? O_EXCL : 0), 0600));
  if (file.get() < 0 && exclusive && errno == EEXIST) return file;
  if (file.get() < 0) {
    throw Error(
        fmt::format("{}: cannot open {} for writing ({})", call, path, std::strerror(errno)));
  }
  // A file this call created (O_EXCL) goes again when a step below fails.
  const auto fail = [&](std::string message) {
    if (exclusive) (void)::unlink(path.c_str());
    return Error(std::move(message));
  };
  struct stat status {};
  if (::fstat(file.get(), &status) != 0) {
    throw fail(fmt::format("{}: cannot check {} ({})", call, path, std::strerror(errno)));
  }
  const char* refused = !S_ISREG(status.st_mode)       ? "it is not a regular file"
                        : status.st_uid != ::geteuid() ? "another user owns it"
                        : status.st_nlink != 1         ? "it has other names (hard links)"
                                                       : nullptr;
  if (refused != nullptr) {
    throw fail(fmt::format("{}: refusing to write into {} ({}): {}", call, path, describe(status),
                           refused));
  }
  if (::fchmod(file.get(), mode) != 0 || ::ftruncate(file.get(), 0) != 0) {
    throw fail(
        fmt::format("{}: cannot make {} private and empty ({})", call, path, std::strerror(errno)));
  }
  return file;
}

std::error_code make_private_folders(const std::string& path) {
  std::filesystem::path built;
  for (const std::filesystem::path& part : std::filesystem::path(path).lexically_normal()) {
    built /= part;
    if (part.empty()) continue;  // after a trailing '/'
    if (::mkdir(built.c_str(), 0700) == 0) {
      // Exactly 0700 whatever the umask, through a descriptor of the folder just made.
      const FileDescriptor folder(
          ::open(built.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (folder.get() < 0 || ::fchmod(folder.get(), 0700) != 0) {
        return {errno, std::generic_category()};
      }
      // Its entry in the folder above is durable only once that folder is synced too (else a
      // crash could take the new folder, and the file saved in it, away).
      if (const int error = sync_folder_error(built.parent_path().string()); error != 0) {
        return {error, std::generic_category()};
      }
      continue;
    }
    if (errno != EEXIST) return {errno, std::generic_category()};
    struct stat status {};
    if (::stat(built.c_str(), &status) != 0) return {errno, std::generic_category()};
    if (!S_ISDIR(status.st_mode)) return {ENOTDIR, std::generic_category()};
  }
  return {};
}

}  // namespace kvsnap::detail
