// Internal: the safetensors format — 8-byte little-endian header length, a JSON header naming
// each tensor's dtype, shape and [begin, end) byte range, a `__metadata__` map of strings, then
// the raw little-endian data, fully indexed without holes or overlaps.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvsnap/array.h"

namespace kvsnap::detail {

struct SafetensorsFile {
  std::vector<std::pair<std::string, Array>> tensors;  // in file order
  std::map<std::string, std::string> metadata;

  // The tensor named `name`; throws Error naming `context` when absent.
  const Array& at(const std::string& name, const char* context) const;
};

// Serializes tensors (any layout; written compact) and metadata to bytes.
std::string encode_safetensors(const SafetensorsFile&);
// Parses and validates bytes (every rule above); throws Error naming `source` and the rule
// broken. Nothing partial is returned.
SafetensorsFile decode_safetensors(const std::string& bytes, const std::string& source);

// Whole-file helpers; read errors and decode errors throw Error.
std::string read_file(const std::string& path);
SafetensorsFile read_safetensors(const std::string& path);

}  // namespace kvsnap::detail
