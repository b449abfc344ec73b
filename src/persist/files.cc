#include "persist/files.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace kvsnap::detail {

void remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const std::string prefix = target.filename().string() + ".tmp-";
  std::error_code error;
  fs::directory_iterator entries(
      target.parent_path().empty() ? fs::path(".") : target.parent_path(), error);
  if (error) return;
  for (const fs::directory_entry& entry : entries) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    // kill(pid, 0) probes without signalling: ESRCH means no such process (EPERM: one runs).
    if (pid > 0 && pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) {
      fs::remove(entry.path(), error);
    }
  }
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  remove_stale_temporaries(path);
  const std::string temporary = fmt::format("{}.tmp-{}", path, ::getpid());
  const auto fail = [&](const char* step) {
    const std::string reason = std::strerror(errno);
    ::unlink(temporary.c_str());
    return Error(fmt::format("writing {}: {} failed ({})", path, step, reason));
  };
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw fail("open");
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      throw fail("write");
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    throw fail("fsync");
  }
  if (::close(fd) != 0) throw fail("close");
  if (::rename(temporary.c_str(), path.c_str()) != 0) throw fail("rename");
  // The rename is durable only once the folder is synced too.
  const std::string folder = std::filesystem::path(path).parent_path().string();
  const int dir = ::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
}

namespace {

// The metadata entry as encode_safetensors writes it (compact JSON).
std::string checksum_entry(const std::string& value) {
  return fmt::format("\"checksum\":\"{}\"", value);
}

// xxHash64 of `bytes` with the 16 characters at `at` read as the placeholder.
std::string seal_of(std::string_view bytes, size_t at) {
  const size_t digits = std::strlen(kChecksumPlaceholder);
  XXH64_state_t* state = XXH64_createState();
  XXH64_reset(state, 0);
  XXH64_update(state, bytes.data(), at);
  XXH64_update(state, kChecksumPlaceholder, digits);
  XXH64_update(state, bytes.data() + at + digits, bytes.size() - at - digits);
  const XXH64_hash_t hash = XXH64_digest(state);
  XXH64_freeState(state);
  return fmt::format("{:016x}", hash);
}

// Where the value of the one "checksum" entry starts in `bytes`' header, or npos when the header
// holds it other than exactly once.
size_t checksum_position(std::string_view bytes, const std::string& value) {
  uint64_t length = 0;
  for (size_t i = 0; i < 8 && i < bytes.size(); ++i) {
    length |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  }
  if (bytes.size() < 8 || length > bytes.size() - 8) return std::string_view::npos;
  const std::string_view header = bytes.substr(8, length);
  const std::string entry = checksum_entry(value);
  const size_t found = header.find(entry);
  if (found == std::string_view::npos || header.find(entry, found + 1) != std::string_view::npos) {
    return std::string_view::npos;
  }
  return 8 + found + entry.size() - value.size() - 1;
}

}  // namespace

std::string encode_sealed(SafetensorsFile file) {
  file.metadata["checksum"] = kChecksumPlaceholder;
  std::string bytes = encode_safetensors(file);
  const size_t at = checksum_position(bytes, kChecksumPlaceholder);
  if (at == std::string::npos) throw Error("encode_sealed: internal error: no checksum entry");
  const std::string seal = seal_of(bytes, at);
  bytes.replace(at, seal.size(), seal);
  return bytes;
}

void check_seal(const std::string& bytes, const SafetensorsFile& file, const std::string& source) {
  const auto it = file.metadata.find("checksum");
  if (it == file.metadata.end()) {
    throw Error(fmt::format("{}: metadata \"checksum\" is missing", source));
  }
  const size_t at = it->second.size() == std::strlen(kChecksumPlaceholder)
                        ? checksum_position(bytes, it->second)
                        : std::string::npos;
  const std::string actual = at == std::string::npos ? "" : seal_of(bytes, at);
  if (actual != it->second) {
    throw Error(fmt::format("{}: checksum {} does not match the contents{}: the file is damaged",
                            source, it->second,
                            actual.empty() ? "" : fmt::format(" ({})", actual)));
  }
}

}  // namespace kvsnap::detail
