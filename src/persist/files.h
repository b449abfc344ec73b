// Internal: durable file writes and the checksum kvsnap files carry.
#pragma once

#include <map>
#include <string>

#include "persist/safetensors.h"

namespace kvsnap::detail {

// Writes `bytes` to `path` atomically: a temporary file in the same folder, fsync, rename over
// `path`, fsync of the folder. On failure `path` is untouched and Error is thrown.
// Removes stale temporaries of `path` first (see below).
void write_file_atomically(const std::string& path, const std::string& bytes);

// Removes `path`.tmp-<pid> files left by writers that died mid-save (a kill -9): only those of
// `path`, and only when no process <pid> runs. Errors are ignored (best effort).
void remove_stale_temporaries(const std::string& path);

// kvsnap files are sealed: metadata "checksum" holds the xxHash64, as 16 hex digits, of every
// byte of the file with those 16 digits written as '0' — so any damaged byte (data, header,
// padding, length) makes the file fail its check.
inline constexpr const char* kChecksumPlaceholder = "0000000000000000";

// Encodes `file` with metadata "checksum" set to the file's seal.
std::string encode_sealed(SafetensorsFile file);
// Throws Error naming `source` unless metadata "checksum" of `file` (decoded from `bytes`) is
// the seal of `bytes`.
void check_seal(const std::string& bytes, const SafetensorsFile& file, const std::string& source);

}  // namespace kvsnap::detail
