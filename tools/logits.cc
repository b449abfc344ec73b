#include "logits.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "output.h"

namespace kvsnap::tools {
namespace {

// Rows are written in slices of about this much (a decode step's row is a few KB).
constexpr size_t kBufferBytes = size_t{1} << 20;

// A file in `folder` with no name: O_TMPFILE, or (where the file system has none) a name
// removed at once. -1 with errno set when neither works.
int unnamed_file(const std::string& folder) {
  int fd = ::open(folder.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0 || (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL)) return fd;
  std::string name = folder + "/kvsnap-logits-XXXXXX";
  fd = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd >= 0) (void)::unlink(name.c_str());
  return fd;
}

}  // namespace

std::string logits_folder() {
  if (const char* tmpdir = std::getenv("TMPDIR"); tmpdir != nullptr && *tmpdir != '\0') {
    return tmpdir;
  }
  return ::access("/var/tmp", W_OK | X_OK) == 0 ? "/var/tmp" : "/tmp";
}

LogitsTape::LogitsTape() {
  buffer_.reserve(kBufferBytes);  // before the file: nothing to close should it throw
  const std::string folder = logits_folder();
  fd_ = unnamed_file(folder);
  if (fd_ < 0) {
    throw Error(
        fmt::format("replay: cannot keep reply logits in {} ({}); set TMPDIR to a "
                    "writable folder",
                    folder, std::strerror(errno)));
  }
}

LogitsTape::~LogitsTape() {
  if (fd_ >= 0) ::close(fd_);
}

void LogitsTape::flush() const {
  size_t done = 0;
  while (done < buffer_.size()) {
    const ssize_t n = ::pwrite(fd_, buffer_.data() + done, buffer_.size() - done,
                               static_cast<off_t>(written_ + static_cast<int64_t>(done)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(
          fmt::format("replay: cannot keep reply logits in {} ({}); set TMPDIR to a "
                      "folder with room",
                      logits_folder(), n < 0 ? std::strerror(errno) : "nothing written"));
    }
    done += static_cast<size_t>(n);
  }
  written_ += static_cast<int64_t>(buffer_.size());
  buffer_.clear();
}

int64_t LogitsTape::append(std::span<const float> row) {
  const size_t size = row.size_bytes();
  if (buffer_.size() + size > kBufferBytes && !buffer_.empty()) flush();
  const int64_t position = bytes();
  const auto* data = reinterpret_cast<const char*>(row.data());
  buffer_.insert(buffer_.end(), data, data + size);
  return position;
}

void LogitsTape::read(int64_t position, std::span<float> out) const {
  if (position + static_cast<int64_t>(out.size_bytes()) > written_) flush();
  auto* to = reinterpret_cast<char*>(out.data());
  size_t done = 0;
  while (done < out.size_bytes()) {
    const ssize_t n = ::pread(fd_, to + done, out.size_bytes() - done,
                              static_cast<off_t>(position + static_cast<int64_t>(done)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(fmt::format("replay: cannot read back reply logits kept in {} ({})",
                              logits_folder(), n < 0 ? std::strerror(errno) : "end of file"));
    }
    done += static_cast<size_t>(n);
  }
}

LogitRows LogitRows::of(const std::vector<std::vector<float>>& rows) {
  LogitRows out;
  for (const std::vector<float>& row : rows) out.push_back(row);
  return out;
}

void LogitRows::push_back(std::span<const float> row) {
  if (!positions_.empty() && static_cast<int64_t>(row.size()) != width_) {
    throw Error(
        fmt::format("replay: a logits row of {} floats after rows of {}", row.size(), width_));
  }
  if (tape_ == nullptr) tape_ = std::make_shared<LogitsTape>();
  positions_.push_back(tape_->append(row));
  width_ = static_cast<int64_t>(row.size());
}

void LogitRows::read(size_t i, std::vector<float>& out) const {
  out.resize(static_cast<size_t>(width_));
  tape_->read(positions_.at(i), out);
}

std::vector<std::vector<float>> LogitRows::all() const {
  std::vector<std::vector<float>> rows(positions_.size());
  for (size_t i = 0; i < rows.size(); ++i) read(i, rows[i]);
  return rows;
}

void check_logits_room(const Workload& workload, int64_t vocab, int runs) {
  try {
    const LogitsTape probe;  // the folder takes a tape at all
  } catch (const Error& e) {
    throw InputError(e.what());
  }
  int64_t rows = 0;
  for (const Request& request : workload.requests) rows += request.max_tokens;
  // In doubles: exact far past any disk, and no product overflows.
  const double need = static_cast<double>(rows) * static_cast<double>(vocab) * 4.0 * runs;
  const std::string folder = logits_folder();
  struct statvfs status {};
  if (::statvfs(folder.c_str(), &status) != 0) return;  // the first write will say
  const double free = static_cast<double>(status.f_bavail) * static_cast<double>(status.f_frsize);
  if (need <= free) return;
  throw InputError(fmt::format(
      "replay: the agreement check keeps every reply token's logits, up to {:.0f} bytes for {} "
      "runs of {} requests in {}, which has {:.0f} free; set TMPDIR to a folder with room",
      need, runs, workload.requests.size(), folder, free));
}

}  // namespace kvsnap::tools
