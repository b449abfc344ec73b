// Sealed files (files.h): written whole, checked whole or read one tensor at a time — the header
// first, then each tensor's bytes straight into its array, hashed as they pass, so a load holds
// what it decodes, not the file's bytes as well (a trie file of 8 GB took 16 GB to load).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "persist/files.h"

namespace kvsnap::detail {
namespace {

// The part a tensor not kept is read in.
constexpr uint64_t kPassingPart = uint64_t{1} << 20;

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

// The metadata entry as encode_safetensors writes it (compact JSON).
std::string checksum_entry(const std::string& value) {
  return fmt::format("\"checksum\":\"{}\"", value);
}

// Where the value of the one "checksum" entry starts in the header `bytes` begins with, or npos
// when the header holds it other than exactly once.
size_t checksum_position(std::string_view bytes, const std::string& value) {
  const uint64_t length = header_length(bytes);
  if (bytes.size() < 8 || length > bytes.size() - 8) return std::string_view::npos;
  const std::string_view header = bytes.substr(8, length);
  const std::string entry = checksum_entry(value);
  const size_t found = header.find(entry);
  if (found == std::string_view::npos || header.find(entry, found + 1) != std::string_view::npos) {
    return std::string_view::npos;
  }
  return 8 + found + entry.size() - value.size() - 1;
}

// Where `file`'s checksum stands in the bytes it was decoded from (`bytes`: at least the length
// and the header), or npos: none, one of another length, or not once.
size_t seal_position(const SafetensorsFile& file, std::string_view bytes) {
  const auto it = file.metadata.find("checksum");
  return it != file.metadata.end() && it->second.size() == std::strlen(kChecksumPlaceholder)
             ? checksum_position(bytes, it->second)
             : std::string::npos;
}

// xxHash64, fed in parts.
class Hash {
 public:
  Hash() : state_(XXH64_createState(), XXH64_freeState) {
    if (state_ == nullptr) throw std::bad_alloc();
    XXH64_reset(state_.get(), 0);
  }
  void add(const void* data, size_t bytes) { XXH64_update(state_.get(), data, bytes); }
  // `bytes` with the checksum's 16 characters at `at` read as the placeholder.
  void add_sealed(std::string_view bytes, size_t at) {
    const size_t digits = std::strlen(kChecksumPlaceholder);
    add(bytes.data(), at);
    add(kChecksumPlaceholder, digits);
    add(bytes.data() + at + digits, bytes.size() - at - digits);
  }
  std::string hex() const { return fmt::format("{:016x}", XXH64_digest(state_.get())); }

 private:
  std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t*)> state_;
};

std::string seal_of(std::string_view bytes, size_t at) {
  Hash hash;
  hash.add_sealed(bytes, at);
  return hash.hex();
}

// Throws Error naming `source` unless `actual` (empty: no seal to read) is `file`'s checksum.
void check_actual(const SafetensorsFile& file, const std::string& actual,
                  const std::string& source) {
  const auto it = file.metadata.find("checksum");
  if (it == file.metadata.end()) {
    throw Error(fmt::format("{}: metadata \"checksum\" is missing", source));
  }
  if (actual != it->second) {
    throw Error(fmt::format("{}: checksum {} does not match the contents{}: the file is damaged",
                            source, cut_quoted(it->second),
                            actual.empty() ? "" : fmt::format(" ({})", actual)));
  }
}

}  // namespace

std::string encode_sealed(SafetensorsFile file, const TensorWriter& write) {
  file.metadata["checksum"] = kChecksumPlaceholder;
  std::string bytes = encode_safetensors(file, write);
  const size_t at = checksum_position(bytes, kChecksumPlaceholder);
  if (at == std::string::npos) throw Error("encode_sealed: internal error: no checksum entry");
  const std::string seal = seal_of(bytes, at);
  bytes.replace(at, seal.size(), seal);
  return bytes;
}

void check_seal(const std::string& bytes, const SafetensorsFile& file, const std::string& source) {
  const size_t at = seal_position(file, bytes);
  check_actual(file, at == std::string::npos ? "" : seal_of(bytes, at), source);
}

void check_seal(const SealedFile& sealed, const std::string& source) {
  check_actual(sealed.file, sealed.actual, source);
}

// `why`, and that the file is damaged when `check_seal` (null: not read yet) throws.
static std::string or_damaged(std::string why, const std::function<void()>& check_seal) {
  if (check_seal) {
    try {
      check_seal();
    } catch (const Error&) {
      why += ", or the file is damaged: its checksum does not match either";
    }
  }
  return why;
}

std::string unknown_version(const std::string& version, int known,
                            const std::function<void()>& check_seal) {
  return or_damaged(fmt::format("version {} is unknown (this build reads version {})",
                                cut_quoted(version), known),
                    check_seal);
}

std::optional<std::string> unknown_format(const std::map<std::string, std::string>& metadata,
                                          const std::string& known,
                                          const std::function<void()>& check_seal) {
  const auto format = metadata.find("format");
  if (format != metadata.end() && format->second == known) return std::nullopt;
  std::string why = format == metadata.end()
                        ? "metadata \"format\" is missing"
                        : fmt::format("format {} is not {}", cut_quoted(format->second), known);
  return metadata.contains("checksum") ? or_damaged(std::move(why), check_seal) : why;
}

SealedFile read_sealed(const ByteReader& read, uint64_t size, const std::string& source,
                       const TensorFilter& keep) {
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
  const size_t at = seal_position(sealed.file, head);
  Hash hash;
  if (at != std::string::npos) hash.add_sealed(head, at);
  uint64_t offset = head.size();
  std::string().swap(head);   // hashed and decoded: not held while the data is read
  std::vector<char> passing;  // what a tensor not kept passes through, a part at a time
  // In the order of their data, which they tile.
  for (size_t i = 0; i < sealed.file.tensors.size(); ++i) {
    Array& array = sealed.file.tensors[i].second;
    const auto bytes = static_cast<uint64_t>(array.nbytes());
    if (!keep || keep(i, sealed.file)) {
      array = Array::uninitialized(array.dtype(), array.shape());
      char* const into = static_cast<char*>(array.mutable_bytes());
      if (const uint64_t got = read_up_to(read, into, bytes); got != bytes)
        throw ended(offset + got);
      hash.add(into, static_cast<size_t>(bytes));
    } else {
      passing.resize(static_cast<size_t>(std::min<uint64_t>(bytes, kPassingPart)));
      for (uint64_t done = 0; done < bytes;) {
        const uint64_t part = std::min<uint64_t>(bytes - done, passing.size());
        if (const uint64_t got = read_up_to(read, passing.data(), part); got != part)
          throw ended(offset + done + got);
        hash.add(passing.data(), static_cast<size_t>(part));
        done += part;
      }
    }
    offset += bytes;
  }
  char extra = 0;
  if (read_up_to(read, &extra, 1) != 0) {
    throw fail(fmt::format("it holds more than the {} bytes it held when opened", size));
  }
  if (at != std::string::npos) sealed.actual = hash.hex();
  return sealed;
}

SealedFile read_sealed(const std::string& bytes, const std::string& source,
                       const TensorFilter& keep) {
  size_t at = 0;
  const ByteReader read = [&](char* into, size_t n) {
    n = std::min(n, bytes.size() - at);
    std::memcpy(into, bytes.data() + at, n);
    at += n;
    return n;
  };
  return read_sealed(read, bytes.size(), source, keep);
}

SealedFile read_sealed_file(const std::string& path, const PrivacyRule& rule, uint64_t max_bytes,
                            const TensorFilter& keep) {
  const FileDescriptor file = open_private_file(path, rule);
  struct stat status {};
  if (::fstat(file.get(), &status) != 0) {
    throw Error(fmt::format("{}: error reading {} ({})", rule.call, path, std::strerror(errno)));
  }
  // The size it has now: a file whose size the folder misreports (procfs, some FUSE mounts) is
  // refused as one that shrank or grew while read.
  const auto size = static_cast<uint64_t>(status.st_size);
  if (size > max_bytes) throw too_large_to_load(rule, path, size, max_bytes);
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
  return read_sealed(read, size, path, keep);
}

void check_save_folder(const std::string& path, const std::string& call, bool shared) {
  if (shared) return;
  const std::string parent = std::filesystem::path(path).parent_path().string();
  const std::string folder = parent.empty() ? "." : parent;
  // O_PATH: a folder this user may write into but not list (0333, a drop box) is checked too.
  const FileDescriptor fd(::open(folder.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    // Missing, not a folder, or not searchable: the write fails and says so. Anything else (out
    // of descriptors) must not let an unchecked save through.
    if (errno == ENOENT || errno == ENOTDIR || errno == EACCES) return;
    throw Error(
        fmt::format("{}: cannot check the folder {} ({})", call, folder, std::strerror(errno)));
  }
  check_private_folder(folder, fd.get(),
                       PrivacyRule{.call = call,
                                   .override_with = "set SaveOptions::shared (its loads then need "
                                                    "LoadOptions::allow_shared)",
                                   .allow_shared = false});
}

}  // namespace kvsnap::detail
