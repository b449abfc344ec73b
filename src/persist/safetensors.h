// Internal: the safetensors format — 8-byte little-endian header length, a JSON header naming
// each tensor's dtype, shape and [begin, end) byte range, a `__metadata__` map of strings, then
// the raw little-endian data, fully indexed without holes or overlaps.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvsnap/array.h"

namespace kvsnap::detail {

// Bytes of the well-formed UTF-8 sequence at `text[at]` (no overlong forms, surrogates or code
// points past U+10FFFF, as JSON demands), or 0. `at` < text.size().
size_t utf8_length(std::string_view text, size_t at);

struct SafetensorsFile {
  std::vector<std::pair<std::string, Array>> tensors;  // in file order
  std::map<std::string, std::string> metadata;
  // Tensor name -> index in `tensors`, as decode_safetensors leaves them: at() in constant time
  // (a file of N tensors read by name would otherwise cost N^2 / 2 comparisons). Used only while
  // it covers every tensor; a file assembled by hand is searched.
  std::unordered_map<std::string, size_t> index;

  // The tensor named `name`; throws Error naming `context` when absent.
  const Array& at(const std::string& name, const char* context) const;
};

// Writes tensor `index`'s data into `place` (a compact array of its dtype and shape in the bytes
// being encoded) and returns true, or returns false to have it copied from the tensor's array.
// For tensors that view buffers another thread may write: the writer copies under their lock.
using TensorWriter = std::function<bool(size_t index, Array& place)>;

// The longest JSON header encode_safetensors writes: what the format's reference reader accepts
// (100 MB), so any reader (decode_safetensors included) can read what was written.
inline constexpr uint64_t kMaxWrittenSafetensorsHeader = 100'000'000;
// What encode_safetensors throws, before anything is written anywhere, for a file whose header
// would be longer than that; its callers name themselves in front of the message.
struct HeaderTooLong : Error {
  using Error::Error;
};
// Serializes tensors (any layout; written compact) and metadata to bytes, each tensor's data
// through `write` when given. Throws HeaderTooLong for a header over `max_header` bytes.
std::string encode_safetensors(const SafetensorsFile&, const TensorWriter& write = nullptr,
                               uint64_t max_header = kMaxWrittenSafetensorsHeader);
// The longest JSON header decode_safetensors reads by default (the format's own limit).
inline constexpr uint64_t kMaxSafetensorsHeader = uint64_t(100) << 20;
// Parses and validates bytes (every rule above); throws Error naming `source` and the rule
// broken. Nothing partial is returned. A header longer than `max_header` bytes is refused before
// it is parsed (parsing one costs several times its length in memory: ~2-4 GB for 100 MiB).
SafetensorsFile decode_safetensors(const std::string& bytes, const std::string& source,
                                   uint64_t max_header = kMaxSafetensorsHeader);
// The header length a file starting with `bytes` gives (its first 8 bytes, little-endian).
uint64_t header_length(std::string_view bytes);
// decode_safetensors for a file of `size` bytes read in parts: `head` holds its first 8 +
// header_length bytes. The tensors' arrays are outlines: their dtypes and shapes over one
// element (zero strides), nothing allocated; their data, together, covers the data section (the
// file after `head`) exactly once, in the order of `tensors`.
SafetensorsFile decode_safetensors_header(std::string_view head, uint64_t size,
                                          const std::string& source,
                                          uint64_t max_header = kMaxSafetensorsHeader);

// --- JSON read from files (which may be damaged or forged) ---

// Nesting parse_json refuses beyond: kvsnap's JSON nests 4 levels at most, and whatever recurses
// over a parsed value (rendering, comparing, copying) recurses once per level.
inline constexpr int kMaxJsonDepth = 32;
// Parses `text`. On failure returns null and sets `problem` to why: "is not valid JSON (...)" or
// "nests deeper than 32 levels" (found by a linear scan before parsing).
nlohmann::json parse_json(std::string_view text, std::string& problem);
// parse_json, refusing text of more than `max_values` values (scalars, arrays and objects)
// before it is parsed: counted in one pass that builds nothing, as JSON parsed into values takes
// several times its length. `problem` then reads "holds N JSON values, more than the M it may".
nlohmann::json parse_json(std::string_view text, int64_t max_values, std::string& problem);
// The problem for_each_element reports for text that is valid JSON but no array.
inline constexpr const char* kNotAnArray = "is not an array";
// Hands each element of the JSON array `text` to `take`, in order, each parsed alone (at most
// `max_values` values), never the whole text at once. Returns false with `problem` set when the
// text is not valid JSON (as parse_json says it), kNotAnArray, or "has an element of more than N
// JSON values"; what `take` throws passes through.
bool for_each_element(std::string_view text, int64_t max_values,
                      const std::function<void(nlohmann::json)>& take, std::string& problem);
// A short rendering of `value` for an error message, whatever its size: compact JSON, strings
// cut to 40 bytes, containers below the third level as their size, the whole cut to about 120
// characters; always valid UTF-8 (never throws for a string's bytes).
std::string describe_json(const nlohmann::json& value);
// `text` as a JSON string for an error message, cut to 40 bytes; bytes that are not UTF-8 (a
// cut may split a character) show as U+FFFD.
std::string cut_quoted(const std::string& text);
// Whether `v` is an integer JSON number an int64_t holds (nlohmann's get<int64_t> would wrap a
// larger unsigned one: 2^64 - 1 read as -1).
bool int64_number(const nlohmann::json& v);

// Whole-file helpers; read errors and decode errors throw Error.
std::string read_file(const std::string& path);
SafetensorsFile read_safetensors(const std::string& path);

}  // namespace kvsnap::detail
