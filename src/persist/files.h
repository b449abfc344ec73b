// Internal: durable private file writes, the ownership and mode checks on what kvsnap loads, and
// the checksum kvsnap files carry.
#pragma once

#include <sys/types.h>

#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "persist/safetensors.h"

namespace kvsnap::detail {

// Writes `bytes` to `path` atomically: a temporary file in the same folder,
// `path`.tmp-<pid>-<n>-<place> (a name too long for that within 255 bytes: its first 180 bytes,
// "~" and a hash of it, in place of `path`'s file name) with n a count of this process's
// temporaries (so each call has its own: saves of one path from several threads do not touch each
// other's, and the last rename wins, one whole save) and <place> 16 hex digits naming this boot of
// this host and this PID namespace (writer_place(): writers of one pid in two containers, or on two
// hosts sharing the folder, name theirs apart; a name already there is skipped all the same, never
// written into), created mode 0600 whatever the umask (see create_private_file), fsync, rename over
// `path`, fsync of the folder. On failure before the rename `path` is untouched and Error is
// thrown; a failed fsync of the folder after it is an Error too (the new file is in place, but a
// crash could undo the rename). Removes stale temporaries of `path` first (see below), unless
// `clean_stale` is false (a folder of many files, shared across hosts, cleans its own:
// tier/dir_store.cc).
// `mode`: the file's permissions (0644 for a file a shared folder's other users read).
void write_file_atomically(const std::string& path, const std::string& bytes,
                           bool clean_stale = true, mode_t mode = 0600);
// The first half of write_file_atomically: the temporary written, synced and closed, not yet in
// place. commit() renames it over the path and syncs the folder (Error as
// write_file_atomically's); destroyed uncommitted, the temporary is removed and the path never
// changed. Several files written whole before any replaces its old one: an error while writing
// any of them (a full disk) leaves every old one as it was.
class PreparedFile {
 public:
  struct Aside;  // files.cc
  explicit PreparedFile(std::unique_ptr<Aside> aside);
  PreparedFile(PreparedFile&&) noexcept;
  PreparedFile& operator=(PreparedFile&&) noexcept;
  ~PreparedFile();
  void commit();
  // Whether commit renamed the file over its path (also when the folder's sync then failed).
  bool in_place() const { return in_place_; }

 private:
  void discard() noexcept;
  std::unique_ptr<Aside> aside_;
  bool in_place_ = false;
};
PreparedFile prepare_file_atomically(const std::string& path, const std::string& bytes,
                                     bool clean_stale = true, mode_t mode = 0600);
inline void write_file_atomically(const std::string& path, const std::string& bytes,
                                  bool clean_stale, mode_t mode) {
  prepare_file_atomically(path, bytes, clean_stale, mode).commit();
}
// Writes all of `bytes` to `fd` (again after EINTR and short writes); 0, or the errno of the
// write that failed.
int write_all(int fd, std::string_view bytes);
// The temporary the next write_file_atomically of this process will use, unless another thread
// saves first (for tests).
std::string next_temporary_path(const std::string& path);

// --- Private files: what kvsnap creates is 0600 / 0700; what it loads must be private. ---

// An open file descriptor, closed when destroyed (move-only).
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd = -1) : fd_(fd) {}
  ~FileDescriptor();
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  int get() const { return fd_; }  // -1 when none
  // Hands the descriptor to the caller, who closes it.
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// What check_private and check_private_folder demand, and how their errors read.
struct PrivacyRule {
  // The call that checks, first in the error ("PrefixCache::load").
  std::string call;
  // How the caller opts out, named at the end of the error: "set LoadOptions::allow_shared"
  // reads "...; set LoadOptions::allow_shared to trust it anyway". Empty: none is offered.
  std::string override_with;
  // The caller's explicit opt-in to a shared file or folder: nothing is checked.
  bool allow_shared = false;
  // A secret (e.g. a MAC key file): group and others must not read the file either.
  bool secret = false;
};

// Throws Error unless the open descriptor `fd` (of `path`, named in the error) is a regular file
// owned by this process's effective user or by root (root can change any file anyway; OpenSSH's
// StrictModes trusts the same two) that group and others cannot write (nor read, under
// rule.secret: a MAC key file is read with check_private or read_private_file). Checks
// fstat(fd): what passed is what is read through `fd`. The error names rule.call, the path, its
// owner (user name and uid), its mode in octal, what is wrong, the rule and rule.override_with.
// Checks nothing under rule.allow_shared.
void check_private(const std::string& path, int fd, const PrivacyRule& rule);
// The same for a folder (`fd` open on it): owned by this user or root, group and others cannot
// write it
// — or it has the sticky bit, like /tmp, and is owned by this user or root: others may create
// files in it, but only a file's owner can rename or remove one, so check_private of the file
// decides. (rule.secret is about a file's contents and does not apply to its folder.)
void check_private_folder(const std::string& path, int fd, const PrivacyRule& rule);
// Opens the folder `path` and checks it as above. Throws Error "cannot open <path> (<why>)".
void check_private_folder(const std::string& path, const PrivacyRule& rule);

// (sealed_file.cc) Before a save to `path` that is not SaveOptions::shared: throws
// check_private_folder's Error (under `call`, offering "set SaveOptions::shared") unless the folder
// that is to hold the file is one a load trusts, so that a save never writes a file its own load
// would refuse. A folder that is missing or cannot be searched is left to the write to report;
// one that cannot be checked otherwise (no descriptor left) is refused.
void check_save_folder(const std::string& path, const std::string& call, bool shared);

// Opens `path` for reading after the checks, so that no one can swap the file between the check
// and the read: the path is resolved (links included), the folder that really holds the file is
// opened and checked (check_private_folder), then the file is opened relative to that folder
// descriptor, not following a link, without blocking (a FIFO is refused, not waited on), and
// checked (check_private). Under rule.allow_shared `path` is opened (links followed) without
// blocking and checked for nothing but being a regular file. Throws Error "<rule.call>: cannot
// open <path> for reading (<why>)" or the checks' Error.
FileDescriptor open_private_file(const std::string& path, const PrivacyRule& rule);
// The most bytes a file can hold and be loaded: the machine's memory (a loader holds the file and
// what it decodes at once).
uint64_t loadable_bytes();
// The whole file, read through open_private_file's descriptor. A regular file of more than
// `max_bytes` is refused before any of it is reserved or read, and reading stops once more
// arrived (a file that grows, or is not a regular one): Error "<rule.call>: cannot load <path>:
// it holds ... bytes, more than ...". Throws open_private_file's Errors, or "<rule.call>: error
// reading <path> (<why>)"; std::bad_alloc when a file within the limit does not fit in memory
// (callers turn it into an Error).
std::string read_private_file(const std::string& path, const PrivacyRule& rule,
                              uint64_t max_bytes = loadable_bytes());
// The Error for a file of `size` bytes (`more`: "at least ", when it was still growing) over
// `max_bytes`: "<rule.call>: cannot load <path>: it holds ... bytes, more than ...".
Error too_large_to_load(const PrivacyRule& rule, const std::string& path, uint64_t size,
                        uint64_t max_bytes, const char* more = "");

// Opens `path` for writing, emptied: created mode 0600 whatever the umask (fchmod after open),
// never through a symbolic link. An existing file that is not a regular file, that another user
// owns or that has other names (hard links) is refused: writing into it could hand its contents
// to someone else. Throws Error "<call>: cannot open <path> for writing (<why>)" or "<call>:
// refusing to write into <path> (owner ..., mode ...): <why>". `exclusive`: only a file it
// creates (O_EXCL); when something is already at `path`, returns no descriptor (get() < 0).
// `mode`: 0644 for a file a shared folder's other users read.
FileDescriptor create_private_file(const std::string& path, const std::string& call,
                                   bool exclusive = false, mode_t mode = 0600);

// Creates folder `path` and every missing folder above it, each mode 0700 whatever the umask
// (fchmod right after mkdir); folders that exist keep their modes (neither loosened nor
// tightened); the folder above each one made is synced, so its entry survives a crash. Returns
// the first error (ENOTDIR when a component is not a folder), else none.
std::error_code make_private_folders(const std::string& path);

// Calls visit(name) for each entry of `folder` but "." and "..", in the order the system lists
// them, until visit returns false; false when the folder cannot be listed. opendir and readdir,
// not std::filesystem's directory_iterator: libstdc++ allocates inside a noexcept constructor
// of it, so running out of memory there would terminate the process.
bool list_folder(const std::string& folder, const std::function<bool(const char* name)>& visit);

// Removes temporaries of `path` (and only of it) left by writers that died mid-save (a kill -9).
// One named from this place (see write_file_atomically) is stale when no process <pid> runs here,
// or, of this process's pid, when no write of this process uses it now (an earlier process of the
// same pid: a container's engine is pid 1 each time). One named from another place — another
// container or host, whose processes cannot be probed from here —, the names older kvsnap gave
// (`path`.tmp-<pid>-<n>, `path`.tmp-<pid>), and every one where the place cannot tell
// containers apart (no /proc: only the host name) are stale once unchanged for
// kStaleForeignTemporary by the folder's clock (a file made there: a shared folder's server may
// keep another time than this host): no save takes that long. Errors are ignored (best effort).
// (Nothing for a path that names no file: names_no_file.)
void remove_stale_temporaries(const std::string& path);
// Whether `path` names no file: empty, or a folder's ("dir/", ".", "..").
inline bool names_no_file(const std::string& path) {
  const std::filesystem::path name = std::filesystem::path(path).filename();
  return name.empty() || name == "." || name == "..";
}
// After a load read `path` (by `rule`): removes its stale temporaries when the folder they lie in
// is one the load trusted — the folder `path` names is the one open_private_file checked (no
// link on the way leads elsewhere), or rule.allow_shared trusts any. Best effort, as above.
void remove_stale_temporaries_after_load(const std::string& path, const PrivacyRule& rule);
inline constexpr int64_t kStaleForeignTemporary = 3600;  // seconds

// The time by the clock that stamps files in `folder` (a shared folder's server may keep another
// time than this host): the modification time of a file made there now, or this host's time
// when none can be made.
timespec folder_now(const std::string& folder);

// This boot of this host and this process's PID namespace, as 16 hex digits (a hash of the
// kernel's boot id, the namespace's inode and the host name).
const std::string& writer_place();

// kvsnap files are sealed: metadata "checksum" holds the xxHash64, as 16 hex digits, of every
// byte of the file with those 16 digits written as '0' — so any damaged byte (data, header,
// padding, length) makes the file fail its check.
inline constexpr const char* kChecksumPlaceholder = "0000000000000000";

// The errno of syncing `folder` ("" is the working folder) so that the entries renamed or made
// in it survive a crash; 0 when done. A folder this process cannot open for reading (EACCES) or a
// file system that cannot sync folders (EINVAL) is no failure (0) — there is nothing more a
// writer can do there.
int sync_folder_error(const std::string& folder);

// Sealed files (sealed_file.cc). Encodes `file` (its tensors' data through `write`, when given:
// see encode_safetensors) with metadata "checksum" set to the file's seal.
std::string encode_sealed(SafetensorsFile file, const TensorWriter& write = nullptr);
// Throws Error naming `source` unless metadata "checksum" of `file` (decoded from `bytes`) is
// the seal of `bytes`.
void check_seal(const std::string& bytes, const SafetensorsFile& file, const std::string& source);

// A sealed file read in parts (sealed_file.cc): decoded as decode_safetensors decodes it, its
// tensors read straight into their arrays, and the seal of every byte (`actual`: 16 hex digits,
// empty when the header holds no one checksum entry of that length), checked by check_seal.
struct SealedFile {
  SafetensorsFile file;
  std::string actual;
};
// Up to `n` bytes into `into`; 0 at the end. Throws Error on a failed read.
using ByteReader = std::function<size_t(char* into, size_t n)>;
// Whether a read keeps tensor `index` of `file` (in the order of their data), asked just before
// its data is read: `file` holds the data of the tensors before it that were kept, and outlines
// (decode_safetensors_header) of the rest. A tensor not kept is hashed as it passes and left an
// outline, its data never held.
using TensorFilter = std::function<bool(size_t index, const SafetensorsFile& file)>;
// Reads a file of `size` bytes from `read`: Error naming `source` as decode_safetensors does, or
// when it ends before `size` bytes or goes on past them. Without `keep`, every tensor is kept.
SealedFile read_sealed(const ByteReader& read, uint64_t size, const std::string& source,
                       const TensorFilter& keep = nullptr);
SealedFile read_sealed(const std::string& bytes, const std::string& source,
                       const TensorFilter& keep = nullptr);
// The file through open_private_file's descriptor, refused as read_private_file refuses it (more
// than `max_bytes`) and as read_sealed does; std::bad_alloc when its tensors do not fit in memory.
SealedFile read_sealed_file(const std::string& path, const PrivacyRule& rule,
                            uint64_t max_bytes = loadable_bytes(),
                            const TensorFilter& keep = nullptr);
// Throws check_seal's Error unless the seal read is the file's "checksum".
void check_seal(const SealedFile& sealed, const std::string& source);
// What is wrong with a file whose metadata "version" is `version`, not `known`: that version is
// unknown — or, when `check_seal` (null: the data is not read yet) throws, the file is damaged
// (the damage may be in the version itself), which the message says too.
std::string unknown_version(const std::string& version, int known,
                            const std::function<void()>& check_seal);
// What is wrong with `metadata`'s "format" when it is missing or not `known` (nullopt when it
// is known) — and, for a sealed file (`metadata` holds a "checksum") whose `check_seal` throws,
// that the file is damaged, as unknown_version says (a damaged byte in "format" or its key).
std::optional<std::string> unknown_format(const std::map<std::string, std::string>& metadata,
                                          const std::string& known,
                                          const std::function<void()>& check_seal);

}  // namespace kvsnap::detail
