// What `kvsnap replay` writes besides its figures, and how a run ends: the --chart file (checked
// before the runs, written atomically), text made safe for SVG, and the exit status of a
// failure.
#pragma once

#include <exception>
#include <functional>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

#include "kvsnap/error.h"

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

// After the results are printed: runs `steps` (writing the chart, saving the cache) in order,
// each whatever the others did, reporting a failure on `errors` as "kvsnap: <what>". Returns
// `verdict` (0 the runs agree, 1 they disagree) unless a step failed after runs that agree: 3.
// A disagreement stays 1: it is the result the caller asked for.
int finish_run(int verdict, const std::vector<std::function<void()>>& steps, std::ostream& errors);

// `text` for an SVG's text and attributes: & < > " ' escaped, and what XML 1.0 cannot hold at
// all, even escaped (control characters other than tab, newline and carriage return; bytes
// that are not UTF-8), replaced by U+FFFD.
std::string xml_escape(std::string_view text);

// Throws Error "<option> <path>: <why>" unless `path` can be written as write_replacing writes
// it: not a folder, in a folder that exists and in which this process can create a file (a
// probe beside `path` is created and removed). `path` itself is not touched.
void check_writable(const std::string& path, const std::string& option);
// Writes `text` to `path` atomically: a temporary beside it (`path`.tmp-<pid>, created with the
// umask like any program's output), then renamed over `path`. Throws Error "<option> <path>:
// <why>", `path` left as it was.
void write_replacing(const std::string& path, const std::string& text, const std::string& option);

}  // namespace kvsnap::tools
