// What `kvsnap replay` writes besides its figures: text made safe for SVG.
#pragma once

#include <string>
#include <string_view>

namespace kvsnap::tools {

// `text` for an SVG's text and attributes: & < > " ' escaped, and what XML 1.0 cannot hold at
// all, even escaped (control characters other than tab, newline and carriage return; bytes
// that are not UTF-8), replaced by U+FFFD.
std::string xml_escape(std::string_view text);

}  // namespace kvsnap::tools
