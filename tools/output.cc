#include "output.h"

#include <cstdint>
#include <new>
#include <ostream>

namespace kvsnap::tools {

int failure_status(const std::exception_ptr& failure, bool runs_started) {
  try {
    std::rethrow_exception(failure);
  } catch (const InputError&) {
    return 2;
  } catch (const Error&) {
    return runs_started ? 3 : 2;
  } catch (...) {
    return 3;
  }
}

int finish_run(int verdict, const std::vector<std::function<void()>>& steps, std::ostream& errors) {
  bool failed = false;
  for (const std::function<void()>& step : steps) {
    try {
      step();
    } catch (const std::bad_alloc& e) {
      errors << "kvsnap: out of memory (" << e.what() << ")\n";
      failed = true;
    } catch (const std::exception& e) {
      errors << "kvsnap: " << e.what() << "\n";
      failed = true;
    }
  }
  errors.flush();
  return verdict != 0 ? verdict : failed ? 3 : 0;
}

namespace {

// The length of the UTF-8 sequence of a character XML 1.0 allows at `text[i]`, or 0 when the
// bytes there are not one (invalid UTF-8, a control character, U+FFFE, U+FFFF).
size_t xml_character(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char first = byte(i);
  if (first < 0x80) return first >= 0x20 || first == '\t' || first == '\n' || first == '\r';
  const size_t length = first >= 0xF0 ? 4 : first >= 0xE0 ? 3 : first >= 0xC0 ? 2 : 0;
  if (length == 0 || first > 0xF4 || i + length > text.size()) return 0;
  uint32_t code = first & (0x7F >> length);
  for (size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    code = (code << 6) | (byte(i + k) & 0x3F);
  }
  const uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
  const bool valid = code >= least[length] && code <= 0x10FFFF &&
                     !(code >= 0xD800 && code <= 0xDFFF) && code != 0xFFFE && code != 0xFFFF;
  return valid ? length : 0;
}

}  // namespace

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t length = xml_character(text, i);
    if (length == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
      continue;
    }
    switch (text[i]) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out.append(text.substr(i, length));
    }
    i += length;
  }
  return out;
}

}  // namespace kvsnap::tools
