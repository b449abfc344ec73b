// Internal: durable file writes and the checksum kvsnap files carry.
#pragma once

#include <map>
#include <string>

#include "persist/safetensors.h"

namespace kvsnap::detail {

// Writes `bytes` to `path` atomically: a temporary file in the same folder, fsync, rename over
// `path`, fsync of the folder. On failure `path` is untouched and Error is thrown.
void write_file_atomically(const std::string& path, const std::string& bytes);

// xxHash64 (hex) of every tensor's name, dtype, shape and bytes, and every metadata entry but
// "checksum", in a canonical order.
std::string checksum(const SafetensorsFile& file);

}  // namespace kvsnap::detail
