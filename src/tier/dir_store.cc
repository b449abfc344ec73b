#include "tier/dir_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kvsnap/error.h"
#include "persist/files.h"
#include "persist/safetensors.h"

namespace kvsnap::detail {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

void check_time(Deadline deadline) {
  if (Clock::now() >= deadline)
    throw StoreFailure("no answer before the deadline", StoreFailure::Reason::timed_out);
}

}  // namespace

DirStore::DirStore(std::string folder) : folder_(std::move(folder)) {
  std::error_code error;
  const fs::file_status status = fs::status(folder_, error);
  if (fs::exists(status) && !fs::is_directory(status)) {
    throw Error(fmt::format("tier folder {}: exists and is not a folder", folder_));
  }
  if (!fs::exists(status)) {
    fs::create_directories(folder_, error);
    if (error) {
      throw Error(fmt::format("tier folder {}: cannot create it ({})", folder_, error.message()));
    }
    fs::permissions(folder_, fs::perms::owner_all, error);  // what it holds is private
  }
}

std::string DirStore::path(const std::string& key) const {
  std::string name = key;
  std::replace(name.begin(), name.end(), ':', '-');
  return (fs::path(folder_) / name).string();
}

void DirStore::probe(std::span<const std::string> sets, std::span<const std::string> keys,
                     Deadline deadline, std::vector<std::vector<std::string>>& members,
                     std::vector<bool>& exists) {
  members.assign(sets.size(), {});
  exists.assign(keys.size(), false);
  std::error_code error;
  for (size_t i = 0; i < sets.size(); ++i) {
    check_time(deadline);
    for (fs::directory_iterator it(path(sets[i]), error), end; !error && it != end;
         it.increment(error)) {
      members[i].push_back(it->path().filename().string());
    }
    error.clear();
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    check_time(deadline);
    exists[i] = fs::is_regular_file(path(keys[i]), error);
  }
}

std::vector<std::optional<std::string>> DirStore::fetch(std::span<const std::string> keys,
                                                        Deadline deadline) {
  std::vector<std::optional<std::string>> values;
  for (const std::string& key : keys) {
    check_time(deadline);
    const std::string file = path(key);
    try {
      values.emplace_back(read_file(file));
    } catch (const Error&) {
      if (fs::exists(file))
        throw StoreFailure(fmt::format("cannot read {}", file), StoreFailure::Reason::failed);
      values.emplace_back(std::nullopt);
    }
  }
  return values;
}

int64_t DirStore::write(const WriteBatch& batch, Deadline deadline) {
  for (const auto& [key, value] : batch.objects) {
    check_time(deadline);
    try {
      write_file_atomically(path(key), value);
    } catch (const Error& e) {
      throw StoreFailure(e.what(), StoreFailure::Reason::failed);
    }
  }
  for (const auto& [set, member] : batch.index) {
    check_time(deadline);
    std::error_code error;
    fs::create_directories(path(set), error);
    const std::string file = (fs::path(path(set)) / member).string();
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
      throw StoreFailure(fmt::format("cannot create {} ({})", file, std::strerror(errno)),
                         StoreFailure::Reason::failed);
    }
    ::close(fd);
  }
  return 0;
}

}  // namespace kvsnap::detail
