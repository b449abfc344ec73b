// What `kvsnap replay` writes besides its figures, and how a run ends: the --chart file (checked
// before the runs, written atomically), text made safe for SVG, the lock that keeps two runs off
// one --cache-dir, and the exit status of a failure.
#pragma once

#include <exception>
#include <functional>
#include <iosfwd>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsnap/error.h"
#include "persist/files.h"

namespace kvsnap::tools {

// An Error about what a run was given — a request (its exact length over the context length), a
// saved cache (another model's, damaged, refused) — rather than a failure of the run itself.
struct InputError : Error {
  using Error::Error;
};

// The exit status of a failure (README: exit status): 2 for bad arguments and inputs — an
// InputError, or any Error before the runs started —, 3 for anything else: an Error once the
// runs have started (an internal failure, a cache that cannot be saved), out of memory, any
// other exception.
int failure_status(const std::exception_ptr& failure, bool runs_started);

// What a failure says after "kvsnap: ": the exception's message; for std::bad_alloc "out of
// memory (<what>): ..." and what needs less memory.
std::string failure_message(const std::exception_ptr& failure);

// After the results are printed: runs `steps` (writing the chart, saving the cache) in order,
// each whatever the others did, then check_stdout (the steps print too), reporting a failure on
// `errors` as "kvsnap: <failure_message>". Returns `verdict` (0 the runs agree, 1 they
// disagree) unless a step failed after runs that agree: 3. A disagreement stays 1: it is the
// result the caller asked for.
int finish_run(int verdict, const std::vector<std::function<void()>>& steps, std::ostream& errors);
// Flushes standard output; throws Error when what was written there did not get out (a full
// disk, a closed pipe): finish_run's last step, so the run exits 3.
void check_stdout();

// `text` for an SVG's text and attributes: & < > " ' escaped, and what XML 1.0 cannot hold at
// all, even escaped (control characters other than tab, newline and carriage return; bytes
// that are not UTF-8), replaced by U+FFFD.
std::string xml_escape(std::string_view text);

// Throws Error "<option> <path>: <why>" unless `path` can be written as write_replacing writes
// it: not a folder, in a folder that exists and in which this process can create a file (a
// probe beside `path` is created and removed). `path` itself is not touched.
void check_writable(const std::string& path, const std::string& option);
// Throws Error "<option> <path>: it is <what> (<input>)..." when `path` is one of `inputs`
// (pairs of what it is — "the workload" — and its path), which the output would replace: the same
// file under any name (device and inode), or the same path once resolved (a file the run makes
// later: a cache directory's lock). Empty paths are passed over.
void check_apart(const std::string& path, const std::string& option,
                 const std::vector<std::pair<std::string, std::string>>& inputs);
// Writes `text` to `path` atomically: a temporary beside it (`path`.tmp-<pid>, created with the
// umask like any program's output), then renamed over `path`. Throws Error "<option> <path>:
// <why>", `path` left as it was.
void write_replacing(const std::string& path, const std::string& text, const std::string& option);

// An exclusive advisory lock (flock) on a --cache-dir, held until destroyed (move-only: closing
// the descriptor releases it).
class CacheDirLock {
 public:
  CacheDirLock() = default;
  explicit CacheDirLock(int fd) : file_(fd) {}
  bool held() const { return file_.get() >= 0; }

 private:
  detail::FileDescriptor file_;
};

// The lock file lock_cache_dir takes in its folder.
inline constexpr const char* kCacheDirLockFile = "kvsnap.lock";

// Takes the lock on `dir`/kvsnap.lock (created when missing: mode 0600, or 0644 when `shared`,
// so that the folder's other users can lock it too; never through a link), without waiting, and
// writes this process's id into it. Two processes that load a --cache-dir at start and save it
// at the end would otherwise overwrite each other's saves. Throws Error "cache directory <dir>:
// in use by another kvsnap run (pid N) ..." (or "by another process" when the holder left no
// live pid) when another holds it, or naming why the lock file cannot be used.
CacheDirLock lock_cache_dir(const std::string& dir, bool shared);

}  // namespace kvsnap::tools
