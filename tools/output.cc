#include "output.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <new>
#include <ostream>

#include "persist/files.h"
#include "persist/safetensors.h"

namespace kvsnap::tools {

int failure_status(const std::exception_ptr& failure, bool runs_started) {
  try {
    std::rethrow_exception(failure);
  } catch (const InputError&) {
    return 2;
  } catch (const Error&) {
    return runs_started ? 3 : 2;
  } catch (...) {
    return 3;
  }
}

std::string failure_message(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::bad_alloc& e) {
    return fmt::format(
        "out of memory ({}): the run needs more memory than this process can have; a smaller "
        "--budget, --parallel or --block-tokens, or a smaller workload, needs less",
        e.what());
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an unknown exception";
  }
}

void check_stdout() {
  std::cout.flush();
  if (!std::cout) {
    throw Error("writing the results to standard output failed (is the disk full?)");
  }
}

int finish_run(int verdict, const std::vector<std::function<void()>>& steps, std::ostream& errors) {
  bool failed = false;
  // Standard output last: the steps print too (the chart's line).
  std::vector<std::function<void()>> all = steps;
  all.emplace_back(check_stdout);
  for (const std::function<void()>& step : all) {
    try {
      step();
    } catch (const std::exception&) {
      errors << "kvsnap: " << failure_message(std::current_exception()) << "\n";
      failed = true;
    }
  }
  errors.flush();
  return verdict != 0 ? verdict : failed ? 3 : 0;
}

namespace {

// The length of the UTF-8 sequence of a character XML 1.0 allows at `text[i]`, or 0 when the
// bytes there are not one (invalid UTF-8, a control character, U+FFFE, U+FFFF).
size_t xml_character(std::string_view text, size_t i) {
  const size_t length = detail::utf8_length(text, i);
  const auto first = static_cast<unsigned char>(text[i]);
  if (length == 1) return first >= 0x20 || first == '\t' || first == '\n' || first == '\r';
  const std::string_view character = text.substr(i, length);
  return character == "\xEF\xBF\xBE" || character == "\xEF\xBF\xBF" ? 0 : length;
}

std::string pid_suffix() { return fmt::format(".tmp-{}", ::getpid()); }

}  // namespace

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t length = xml_character(text, i);
    if (length == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
      continue;
    }
    switch (text[i]) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out.append(text.substr(i, length));
    }
    i += length;
  }
  return out;
}

void check_apart(const std::string& path, const std::string& option,
                 const std::vector<std::pair<std::string, std::string>>& inputs) {
  struct stat out {};
  const bool exists = ::stat(path.c_str(), &out) == 0;
  std::error_code error;
  const auto resolved = std::filesystem::weakly_canonical(std::filesystem::absolute(path), error);
  for (const auto& [what, input] : inputs) {
    if (input.empty()) continue;
    struct stat in {};
    const bool same_file = exists && ::stat(input.c_str(), &in) == 0 && in.st_dev == out.st_dev &&
                           in.st_ino == out.st_ino;
    std::error_code other;
    const bool same_path =
        !error &&
        std::filesystem::weakly_canonical(std::filesystem::absolute(input), other) == resolved &&
        !other;
    if (same_file || same_path) {
      throw Error(
          fmt::format("{} {}: it is {} ({}), which the output would replace: give "
                      "another path",
                      option, path, what, input));
    }
  }
}

void check_writable(const std::string& path, const std::string& option) {
  const auto fail = [&](const std::string& why) {
    return Error(fmt::format("{} {}: {}", option, path, why));
  };
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) throw fail("it is a folder");
  // The file is replaced (a temporary renamed over it): only a regular file can be, or a device
  // (/dev/null), a pipe or a link would be replaced by the output.
  struct stat there {};
  if (::lstat(path.c_str(), &there) == 0) {
    if (!S_ISREG(there.st_mode)) {
      throw fail("it is not a regular file (a device, pipe, socket or link): give a file's path");
    }
    const std::string parent = std::filesystem::path(path).parent_path().string();
    struct stat folder {};
    if (there.st_uid != ::geteuid() && ::geteuid() != 0 &&
        ::stat(parent.empty() ? "." : parent.c_str(), &folder) == 0 &&
        (folder.st_mode & S_ISVTX) != 0 && folder.st_uid != ::geteuid()) {
      throw fail("another user owns it, in a sticky folder: it cannot be replaced");
    }
  }
  const std::string probe = path + pid_suffix();
  const auto create = [&] {
    return ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  };
  int descriptor = create();
  if (descriptor < 0 && errno == EEXIST && ::unlink(probe.c_str()) == 0) {
    descriptor = create();  // left by a process of the same pid, killed mid-write
  }
  if (descriptor < 0) throw fail(fmt::format("cannot write it ({})", std::strerror(errno)));
  ::close(descriptor);
  ::unlink(probe.c_str());
}

void write_replacing(const std::string& path, const std::string& text, const std::string& option) {
  // A temporary of our own, created here (O_EXCL): a file someone else made at the name (in a
  // shared folder, during the run) is passed over, never written into and renamed into place.
  std::string temporary;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 100; ++attempt) {
    temporary = path + pid_suffix() + (attempt == 0 ? "" : fmt::format("-{}", attempt));
    fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    throw Error(fmt::format("{} {}: cannot write it ({})", option, path, std::strerror(errno)));
  }
  const auto fail = [&](const char* step) {
    const std::string reason = std::strerror(errno);
    ::unlink(temporary.c_str());
    return Error(fmt::format("{} {}: cannot write it ({} failed: {})", option, path, step, reason));
  };
  // A file it replaces keeps its permissions (one made private stays private); a new one gets
  // the umask's.
  struct stat old {};
  if (::lstat(path.c_str(), &old) == 0 && S_ISREG(old.st_mode) &&
      ::fchmod(fd, old.st_mode & 07777) != 0) {
    ::close(fd);
    throw fail("chmod");
  }
  if (const int error = detail::write_all(fd, text); error != 0) {
    ::close(fd);
    errno = error;
    throw fail("write");
  }
  // Durable before it replaces the old one: a crash leaves one chart or the other, whole.
  if (::fsync(fd) != 0) {
    ::close(fd);
    throw fail("fsync");
  }
  if (::close(fd) != 0) throw fail("close");
  if (::rename(temporary.c_str(), path.c_str()) != 0) throw fail("rename");
  // The rename itself durable: after a crash, the new chart (not the old one) is there.
  if (const int error = detail::sync_folder_error(std::filesystem::path(path).parent_path());
      error != 0) {
    throw Error(fmt::format("{} {}: written, but the folder's sync failed ({})", option, path,
                            std::strerror(error)));
  }
}

namespace {

// Who holds the lock on `fd`: "another kvsnap run (pid N)" when the file names a live process,
// else "another process".
std::string lock_holder(int fd) {
  char text[64] = {};
  const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
  long pid = 0;
  if (n > 0 && std::sscanf(text, "pid %ld", &pid) == 1 && pid > 0 &&
      (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM)) {
    return fmt::format("another kvsnap run (pid {})", pid);
  }
  return "another process";
}

}  // namespace

CacheDirLock lock_cache_dir(const std::string& dir, bool shared) {
  const std::string path = (std::filesystem::path(dir) / kCacheDirLockFile).string();
  const auto fail = [&](const std::string& why) {
    return Error(fmt::format("cache directory {}: {}", dir, why));
  };
  const mode_t mode = shared ? 0644 : 0600;
  constexpr int kFlags = O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | kFlags, mode);
  const bool writable = fd >= 0;
  if (fd < 0 && errno == EACCES) fd = ::open(path.c_str(), O_RDONLY | kFlags);  // another's
  if (fd < 0) {
    throw fail(fmt::format("cannot open its lock file {} ({})", path, std::strerror(errno)));
  }
  CacheDirLock lock(fd);
  struct stat status {};
  if (::fstat(fd, &status) != 0 || !S_ISREG(status.st_mode)) {
    throw fail(fmt::format("its lock file {} is not a regular file", path));
  }
  // Another name for a file elsewhere (planted in a shared folder) would be truncated and
  // rewritten with the pid.
  if (status.st_nlink != 1) {
    throw fail(fmt::format("its lock file {} has {} names (a hard link to another file); remove it",
                           path, status.st_nlink));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) {
      throw fail(fmt::format("cannot lock {} ({})", path, std::strerror(errno)));
    }
    throw fail(fmt::format(
        "in use by {} (it holds {}): two runs on one cache directory would overwrite each "
        "other's saves; wait for it to end or use another --cache-dir",
        lock_holder(fd), path));
  }
  if (writable && status.st_uid == ::geteuid()) {
    (void)::fchmod(fd, mode);  // whatever the umask
    // The pid only names the holder in another run's error: the lock holds without it.
    const std::string pid = fmt::format("pid {}\n", ::getpid());
    (void)(::ftruncate(fd, 0) == 0 && ::pwrite(fd, pid.data(), pid.size(), 0) >= 0);
  }
  return lock;
}

}  // namespace kvsnap::tools
