#include "tier/dir_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kvsnap/error.h"
#include "persist/files.h"

namespace kvsnap::detail {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

void check_time(Deadline deadline) {
  if (Clock::now() >= deadline)
    throw StoreFailure("no answer before the deadline", StoreFailure::Reason::timed_out);
}

StoreFailure cannot_read(const std::string& file) {
  return StoreFailure(fmt::format("cannot read {} ({})", file, std::strerror(errno)),
                      StoreFailure::Reason::failed);
}

// The object in `file`, or nullopt when there is none: when the name is missing or holds
// anything but a regular file of at most DirStore::kMaximumObjectBytes — a link (never
// followed), a FIFO (never waited on), a device, a socket, a folder — or a file that grows past
// that size while it is read. Checks the deadline before every read. Throws StoreFailure when a
// file that is there cannot be read, or at the deadline, and FetchTooLarge (index 0) when it
// would pass `budget`, what the fetch may still hold.
std::optional<std::string> read_object(const std::string& file, Deadline deadline,
                                       bool own_files_only, int64_t budget) {
  constexpr int64_t kMaximum = DirStore::kMaximumObjectBytes;
  const auto fits = [&](int64_t size) {
    if (size > budget && size <= kMaximum) throw FetchTooLarge(0, budget);
    return size <= kMaximum;
  };
  struct stat status {};
  // What is not a regular file is not even opened (opening a device can do things).
  if (::lstat(file.c_str(), &status) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::nullopt;
    throw cannot_read(file);
  }
  if (!S_ISREG(status.st_mode) || status.st_size > kMaximum) return std::nullopt;
  const auto foreign = [&] {
    return own_files_only && status.st_uid != ::geteuid() && status.st_uid != 0;
  };
  if (foreign()) return std::nullopt;  // not even opened (below: swapped for one since)
  // Swapped for a link, a FIFO or a device since: O_NOFOLLOW fails, O_NONBLOCK does not wait,
  // and fstat below sees what was opened. A file this user may not read (another user's, mode
  // 0600, at a name one of ours had) is missing, as another user's file is: it does not fail
  // the lookup of everything else.
  const FileDescriptor object(
      ::open(file.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  if (object.get() < 0) {
    if (errno == ENOENT || errno == ELOOP || errno == ENXIO || errno == EACCES || errno == EPERM)
      return std::nullopt;
    throw cannot_read(file);
  }
  if (::fstat(object.get(), &status) != 0) throw cannot_read(file);
  if (!S_ISREG(status.st_mode) || foreign() || !fits(status.st_size)) return std::nullopt;
  std::string bytes;
  bytes.reserve(static_cast<size_t>(status.st_size));
  std::string buffer(size_t(1) << 20, '\0');
  for (;;) {
    check_time(deadline);
    const ssize_t n = ::read(object.get(), buffer.data(), buffer.size());
    if (n == 0) {
      (void)::futimens(object.get(), nullptr);  // used: its lifetime starts afresh (as GETEX)
      return bytes;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      throw cannot_read(file);
    }
    if (!fits(static_cast<int64_t>(bytes.size()) + n)) return std::nullopt;  // it grew
    bytes.append(buffer.data(), static_cast<size_t>(n));
  }
}

// Adds `member` to the index folder `folder` (made 0700 when missing), never through a link: a
// link (or anything but a folder) at the folder's name is left alone and the member is not
// added — that index only loses the entry, which costs restores; the member's file is created
// relative to the opened folder and only when missing (O_EXCL: a link at its name, even a
// dangling one, is not followed, and whatever is there already names the member).
void add_member(const std::string& folder, const std::string& member) {
  const auto failed = [&](const std::string& what) {
    return StoreFailure(fmt::format("cannot create {} ({})", what, std::strerror(errno)),
                        StoreFailure::Reason::failed);
  };
  // Twice at most: another process's sweep may remove the folder between the steps (ENOENT),
  // once; then the entry is left out (that index only loses it, which costs restores).
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (::mkdir(folder.c_str(), 0700) != 0 && errno != EEXIST) throw failed(folder);
    const FileDescriptor index(
        ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (index.get() < 0) {
      if (errno == ELOOP || errno == ENOTDIR) return;  // not a folder, or a link to one
      // Another user's folder at the name (a shared sticky folder): that index loses the entry;
      // the rest of the batch is written.
      if (errno == EACCES || errno == EPERM) return;
      if (errno == ENOENT) continue;
      throw failed(folder);
    }
    const int fd = ::openat(index.get(), member.c_str(),
                            O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && (errno == EACCES || errno == EPERM)) return;  // as above
    if (fd < 0 && errno == ENOENT) continue;
    if (fd < 0 && errno != EEXIST) throw failed((fs::path(folder) / member).string());
    if (fd >= 0) {
      ::close(fd);  // a new entry: the folder's modification time is now
    } else {
      (void)::futimens(index.get(), nullptr);  // there already: the set's lifetime starts afresh
    }
    return;
  }
}

// Whether `file` is another user's (not this one's, nor root's).
bool others(const std::string& file) {
  struct stat status {};
  return ::lstat(file.c_str(), &status) == 0 && status.st_uid != ::geteuid() && status.st_uid != 0;
}

// Removes the index folder `folder` (its entries: files or links, never followed; then it),
// until `deadline`. Whatever else is in it stays, and so does it. Whether it is gone.
bool remove_index(const std::string& folder, Deadline deadline) {
  const FileDescriptor index(
      ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (index.get() < 0) return false;
  const int listing = ::dup(index.get());  // closedir closes it
  DIR* entries = listing >= 0 ? ::fdopendir(listing) : nullptr;
  if (entries == nullptr) {
    if (listing >= 0) ::close(listing);
    return false;
  }
  while (const dirent* entry = ::readdir(entries)) {
    if (Clock::now() >= deadline) break;
    if (entry->d_type == DT_DIR) continue;  // "." and "..", or a folder nobody made here
    (void)::unlinkat(index.get(), entry->d_name, 0);
  }
  ::closedir(entries);
  return ::unlinkat(AT_FDCWD, folder.c_str(), AT_REMOVEDIR) == 0;  // fails unless it is empty
}

// Whether `name` is one this store writes: an object (kvsnap-c-, kvsnap-p-), an index set
// (kvsnap-i-), a sweep's clock file (kvsnap-clock-), or a temporary of an object's write.
bool swept_name(const std::string& name) {
  for (const char* prefix : {"kvsnap-c-", "kvsnap-p-", "kvsnap-i-", "kvsnap-clock-"}) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

}  // namespace

DirStore::DirStore(std::string folder, bool own_files_only, std::chrono::seconds ttl,
                   std::shared_ptr<StoreHealth> health)
    : folder_(std::move(folder)),
      own_files_only_(own_files_only),
      ttl_(ttl),
      health_(std::move(health)) {
  // Made private (0700) by the one call that creates it; one that is there already — also one
  // another user made a moment before, in a shared parent — is checked as any existing folder.
  fs::path target = fs::path(folder_).lexically_normal();     // "a/." is "a/"
  if (!target.has_filename()) target = target.parent_path();  // a trailing '/'
  std::error_code error;
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), error);
  if (::mkdir(target.c_str(), 0700) != 0) {
    // Any failure where something already is (EEXIST; EACCES before existence, on NFS) is
    // judged below as what is there.
    const int made = errno;
    if (!fs::exists(fs::symlink_status(target, error))) {
      throw Error(
          fmt::format("tier folder {}: cannot create it ({})", folder_, std::strerror(made)));
    }
  }
  if (!fs::is_directory(fs::status(folder_, error))) {
    throw Error(fmt::format("tier folder {}: exists and is not a folder", folder_));
  }
  if (own_files_only_) {
    PrivacyRule rule;
    rule.call = "Tier::open";
    rule.override_with = "give the tier a key (TierOptions::key, --tier-key-file)";
    check_private_folder(folder_, rule);
  }
}

std::chrono::seconds DirStore::sweep_interval() const {
  const std::chrono::seconds longest = kStaleTemporary;
  if (ttl_.count() <= 0) return longest;
  return std::clamp<std::chrono::seconds>(ttl_ / 8, std::chrono::seconds(1), longest);
}

// The folder's clock: the modification time of a file made there now. Ages are measured against
// it, not this host's clock, which may differ from a file server's (NFS) by more than the ages
// compared, and a sweep would then remove live temporaries and objects of other hosts. This
// host's clock when no file can be made.
void DirStore::sweep(Deadline deadline, int64_t most) {
  const timespec now = folder_now(folder_);
  const auto older_than = [&](const struct stat& status, std::chrono::seconds age) {
    return status.st_mtim.tv_sec < now.tv_sec - static_cast<time_t>(age.count());
  };
  // Entries before the current one that are still there: where the next sweep goes on when this
  // one runs out of time, so a folder too large for one sweep is swept all the same.
  int64_t position = 0, looked_at = 0;
  bool cut_off = false;
  (void)list_folder(folder_, [&](const char* entry) {
    if (position < sweep_resume_) {
      ++position;
      return true;
    }
    if (looked_at++ >= most || Clock::now() >= deadline) {
      cut_off = true;
      return false;
    }
    ++position;
    const std::string name = entry, file = (fs::path(folder_) / name).string();
    if (!swept_name(name)) return true;  // not this store's: left alone
    struct stat status {};
    if (::lstat(file.c_str(), &status) != 0) return true;
    if (own_files_only_ && status.st_uid != ::geteuid()) return true;  // another user's to sweep
    const bool temporary = name.find(".tmp-") != std::string::npos;
    const bool expired = temporary ? older_than(status, kStaleTemporary)
                                   : ttl_.count() > 0 && older_than(status, ttl_);
    if (!expired) return true;
    // An object, a temporary, or a link planted at a name; an index set. Once gone, the entries
    // after it move up (one that stays, e.g. an index cut off by the deadline, keeps its place).
    const bool removed = S_ISDIR(status.st_mode) ? !temporary && remove_index(file, deadline)
                                                 : ::unlink(file.c_str()) == 0;
    if (removed) --position;
    return true;
  });
  sweep_resume_ = cut_off ? position : 0;
}

std::string DirStore::path(const std::string& key) const {
  std::string name = key;
  std::replace(name.begin(), name.end(), ':', '-');
  return (fs::path(folder_) / name).string();
}

void DirStore::probe(std::span<const std::string> sets, std::span<const std::string> keys,
                     Deadline deadline, std::vector<std::vector<std::string>>& members,
                     std::vector<int64_t>& sizes) {
  members.assign(sets.size(), {});
  sizes.assign(keys.size(), -1);
  std::error_code error;
  for (size_t i = 0; i < sets.size(); ++i) {
    check_time(deadline);
    // An index is a folder, never a link to one (write adds nothing through a link either), and
    // without a key this user's (another user's, made first in a shared folder, lists what they
    // chose, and this user cannot add to it).
    if (fs::is_directory(fs::symlink_status(path(sets[i]), error)) &&
        !(own_files_only_ && others(path(sets[i])))) {
      // In use: its lifetime starts afresh (as EXPIRE after SMEMBERS).
      (void)::utimensat(AT_FDCWD, path(sets[i]).c_str(), nullptr, AT_SYMLINK_NOFOLLOW);
      (void)list_folder(path(sets[i]), [&](const char* name) {
        if (static_cast<int64_t>(members[i].size()) >= kMaximumIndexMembers) return false;
        if (members[i].size() % 1024 == 1023) check_time(deadline);
        members[i].emplace_back(name);
        return true;
      });
    }
    error.clear();
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    check_time(deadline);
    // What fetch would read: a regular file, not a link to one, of at most the largest object.
    const std::string file = path(keys[i]);
    const bool regular = fs::is_regular_file(fs::symlink_status(file, error));
    const uintmax_t size = regular ? fs::file_size(file, error) : 0;
    const bool exists =
        regular && !error && size <= static_cast<uintmax_t>(kMaximumObjectBytes) &&
        !(own_files_only_ && others(file)) &&                        // as fetch reads it:
        ::faccessat(AT_FDCWD, file.c_str(), R_OK, AT_EACCESS) == 0;  // one it can read
    // Asked after: in use (a prefix the asking process holds itself, an object its writer skips
    // as stored), so its lifetime starts afresh, as EXPIRE's does on Redis.
    if (exists) {
      sizes[i] = static_cast<int64_t>(size);
      (void)::utimensat(AT_FDCWD, file.c_str(), nullptr, AT_SYMLINK_NOFOLLOW);
    }
  }
}

std::vector<std::optional<std::string>> DirStore::fetch(std::span<const std::string> keys,
                                                        Deadline deadline, int64_t max_bytes) {
  // (A file that cannot be read is one object's failure, counted, not the folder's: the health
  // log is for writes the folder refuses.)
  std::vector<std::optional<std::string>> values;
  int64_t left = max_bytes;
  for (size_t i = 0; i < keys.size(); ++i) {
    check_time(deadline);
    try {
      values.push_back(read_object(path(keys[i]), deadline, own_files_only_, left));
    } catch (const FetchTooLarge&) {
      throw FetchTooLarge(i, max_bytes);
    }
    if (values.back()) left -= static_cast<int64_t>(values.back()->size());
  }
  return values;
}

Store::Refused DirStore::write(const WriteBatch& batch, Deadline deadline) {
  Refused refused;
  try {
    refused = write_batch(batch, deadline);
  } catch (const StoreFailure& failure) {  // full, read-only, gone: said once
    if (health_ != nullptr && failure.reason == StoreFailure::Reason::failed) {
      health_->writes_refused(failure.what());
    }
    throw;
  }
  if (health_ != nullptr) health_->writes_taken();
  return refused;
}

Store::Refused DirStore::write_batch(const WriteBatch& batch, Deadline deadline) {
  if (const auto now = Clock::now(); now >= next_sweep_) {
    next_sweep_ = now + sweep_interval();
    sweep(now + (deadline - now) / 2);  // the other half for the batch
  }
  for (const std::string& key : batch.doomed) {
    check_time(deadline);
    (void)::unlink(path(key).c_str());  // a name gone already, or never there: nothing to do
  }
  Refused refused;
  for (const auto& [key, value] : batch.objects) {
    check_time(deadline);
    // Never read back (as Redis refuses values over its limit); or the name holds another
    // user's file, which a shared sticky folder would not let this one replace (and which, in
    // a keyed store, is the same object if it is any): refused alone, not the batch.
    if (static_cast<int64_t>(value.size()) > kMaximumObjectBytes || others(path(key))) {
      ++refused.objects;
      refused.bytes += static_cast<int64_t>(value.size());
      continue;
    }
    try {
      write_file_atomically(path(key), value, /*clean_stale=*/false);
    } catch (const Error& e) {
      throw StoreFailure(e.what(), StoreFailure::Reason::failed);
    }
  }
  for (const auto& [set, member] : batch.index) {
    check_time(deadline);
    add_member(path(set), member);
  }
  return refused;
}

}  // namespace kvsnap::detail
