// A JSON parser for workload lines: the language nlohmann::json::parse accepts (RFC 8259, UTF-8,
// a leading byte-order mark skipped, the last of duplicate keys kept), into nlohmann::json. It
// exists for speed: strings are copied in runs between escapes, so a line with a 50 MB message
// parses in about 0.1 s even unoptimized, where nlohmann's lexer, which handles every byte
// through several calls, takes ~1 s optimized and ~4 s in a debug build.
//
//   nlohmann::json line = kvsnap::tools::parse_json(R"({"id": "a", "max_tokens": 4})");
#pragma once

#include <nlohmann/json.hpp>
#include <string_view>

namespace kvsnap::tools {

// The value `text` holds. Throws kvsnap::Error "<what is wrong> at byte N" (N counts from 1) when
// `text` is not one JSON value (surrounding whitespace aside) or nests deeper than 64 levels.
// Numbers are converted by nlohmann, so their types (integer, unsigned, float) are nlohmann's.
nlohmann::json parse_json(std::string_view text);

}  // namespace kvsnap::tools
