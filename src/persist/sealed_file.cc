// Sealed files (files.h) read one tensor at a time: the header first, then each tensor's bytes
// straight into its array, hashed as they pass — a load holds what it decodes, not the file's
// bytes as well (a trie file of 8 GB took 16 GB to load).
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "persist/files.h"

namespace kvsnap::detail {
namespace {

// Reads exactly `bytes` into `into` unless the source ends first; returns what was read.
uint64_t read_up_to(const ByteReader& read, char* into, uint64_t bytes) {
  uint64_t done = 0;
  while (done < bytes) {
    const size_t n = read(into + done, static_cast<size_t>(bytes - done));
    if (n == 0) break;
    done += n;
  }
  return done;
}

}  // namespace

SealedFile read_sealed(const ByteReader& read, uint64_t size, const std::string& source) {
  const auto fail = [&](const std::string& rule) {
    return Error(fmt::format("safetensors {}: {}", source, rule));
  };
  const auto ended = [&](uint64_t at) {
    return fail(
        fmt::format("it ends at byte {}, before the {} bytes it held when opened", at, size));
  };
  std::string head(static_cast<size_t>(std::min<uint64_t>(size, 8)), '\0');
  if (const uint64_t got = read_up_to(read, head.data(), head.size()); got != head.size()) {
    throw ended(got);
  }
  // The header is read only when the checks on its length would pass (decode refuses it).
  const uint64_t length = header_length(head);
  if (size >= 8 && length <= size - 8 && length <= kMaxSafetensorsHeader) {
    head.resize(static_cast<size_t>(8 + length));
    if (const uint64_t got = read_up_to(read, head.data() + 8, length); got != length) {
      throw ended(8 + got);
    }
  }
  SealedFile sealed{decode_safetensors_header(head, size, source), ""};
  // The seal: every byte, the checksum's own digits read as '0' (encode_sealed).
  const auto checksum = sealed.file.metadata.find("checksum");
  const size_t digits = std::strlen(kChecksumPlaceholder);
  const size_t at = checksum != sealed.file.metadata.end() && checksum->second.size() == digits
                        ? checksum_position(head, checksum->second)
                        : std::string::npos;
  const std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t*)> state(XXH64_createState(),
                                                                                XXH64_freeState);
  if (state == nullptr) throw std::bad_alloc();
  XXH64_reset(state.get(), 0);
  if (at != std::string::npos) {
    XXH64_update(state.get(), head.data(), at);
    XXH64_update(state.get(), kChecksumPlaceholder, digits);
    XXH64_update(state.get(), head.data() + at + digits, head.size() - at - digits);
  }
  uint64_t offset = head.size();
  std::string().swap(head);  // hashed and decoded: not held while the data is read
  for (auto& [name, array] : sealed.file.tensors) {  // in the order of their data, which they tile
    const auto bytes = static_cast<uint64_t>(array.nbytes());
    char* const into = static_cast<char*>(array.mutable_bytes());
    if (const uint64_t got = read_up_to(read, into, bytes); got != bytes) throw ended(offset + got);
    XXH64_update(state.get(), into, static_cast<size_t>(bytes));
    offset += bytes;
  }
  char extra = 0;
  if (read_up_to(read, &extra, 1) != 0) {
    throw fail(fmt::format("it holds more than the {} bytes it held when opened", size));
  }
  if (at != std::string::npos) sealed.actual = fmt::format("{:016x}", XXH64_digest(state.get()));
  return sealed;
}

SealedFile read_sealed(const std::string& bytes, const std::string& source) {
  size_t at = 0;
  const ByteReader read = [&](char* into, size_t n) {
    n = std::min(n, bytes.size() - at);
    std::memcpy(into, bytes.data() + at, n);
    at += n;
    return n;
  };
  return read_sealed(read, bytes.size(), source);
}

SealedFile read_sealed_file(const std::string& path, const PrivacyRule& rule, uint64_t max_bytes) {
  const FileDescriptor file = open_private_file(path, rule);
  struct stat status {};
  if (::fstat(file.get(), &status) != 0) {
    throw Error(fmt::format("{}: error reading {} ({})", rule.call, path, std::strerror(errno)));
  }
  // The size it has now: a file whose size the folder misreports (procfs, some FUSE mounts) is
  // refused as one that shrank or grew while read.
  const auto size = static_cast<uint64_t>(status.st_size);
  if (size > max_bytes) {
    throw Error(
        fmt::format("{}: cannot load {}: it holds {} bytes, more than the {} bytes a load "
                    "accepts{}",
                    rule.call, path, size, max_bytes,
                    max_bytes == loadable_bytes() ? " (the machine's memory)" : ""));
  }
  const ByteReader read = [&](char* into, size_t n) -> size_t {
    for (;;) {
      const ssize_t got = ::read(file.get(), into, std::min<size_t>(n, size_t(1) << 30));
      if (got >= 0) return static_cast<size_t>(got);
      if (errno != EINTR) {
        throw Error(
            fmt::format("{}: error reading {} ({})", rule.call, path, std::strerror(errno)));
      }
    }
  };
  return read_sealed(read, size, path);
}

void check_seal(const SealedFile& sealed, const std::string& source) {
  const auto it = sealed.file.metadata.find("checksum");
  if (it == sealed.file.metadata.end()) {
    throw Error(fmt::format("{}: metadata \"checksum\" is missing", source));
  }
  if (sealed.actual != it->second) {
    throw Error(fmt::format("{}: checksum {} does not match the contents{}: the file is damaged",
                            source, cut_quoted(it->second),
                            sealed.actual.empty() ? "" : fmt::format(" ({})", sealed.actual)));
  }
}

}  // namespace kvsnap::detail
