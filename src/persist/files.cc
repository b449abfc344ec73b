#include "persist/files.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace kvsnap::detail {

void write_file_atomically(const std::string& path, const std::string& bytes) {
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

std::string checksum(const SafetensorsFile& file) {
  XXH64_state_t* state = XXH64_createState();
  XXH64_reset(state, 0);
  const auto feed = [&](const std::string& text) {
    XXH64_update(state, text.data(), text.size() + 1);
  };
  for (const auto& [name, array] : file.tensors) {
    feed(fmt::format("{} {} {}", name, dtype_name(array.dtype()), shape_string(array.shape())));
    if (array.size() > 0) {
      const Array compact = array.is_contiguous() ? array : array.contiguous();
      XXH64_update(state, compact.bytes(), static_cast<size_t>(compact.nbytes()));
    }
  }
  for (const auto& [key, value] : file.metadata) {
    if (key != "checksum") feed(fmt::format("{}={}", key, value));
  }
  const XXH64_hash_t hash = XXH64_digest(state);
  XXH64_freeState(state);
  return fmt::format("{:016x}", hash);
}

}  // namespace kvsnap::detail
