#include "json_parse.h"

#include <fmt/format.h>
#include <kvsnap/error.h>

#include <cstdint>
#include <string>

namespace kvsnap::tools {
namespace {

// Recursive descent over [begin, end). Raw pointers, not string_view's operator[]: an
// unoptimized build would make a call per byte of a long string.
class Parser {
 public:
  Parser(const char* begin, const char* end) : begin_(begin), at_(begin), end_(end) {}

  nlohmann::json document() {
    if (end_ - at_ >= 3 && std::string_view(at_, 3) == "\xEF\xBB\xBF") at_ += 3;
    nlohmann::json value = parse_value(0);
    skip_space();
    if (at_ != end_) fail("unexpected text after the value");
    return value;
  }

 private:
  // Deeper than the workload format needs (3) by far, shallow enough for any stack.
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(fmt::format("{} at byte {}", what, at_ - begin_ + 1));
  }

  void skip_space() {
    while (at_ != end_ && (*at_ == ' ' || *at_ == '\t' || *at_ == '\n' || *at_ == '\r')) ++at_;
  }

  void expect(char c, const char* what) {
    skip_space();
    if (at_ == end_ || *at_ != c) fail(fmt::format("expected {}", what));
    ++at_;
  }

  // Consumes c when it comes next (after whitespace).
  bool next_is(char c) {
    skip_space();
    if (at_ == end_ || *at_ != c) return false;
    ++at_;
    return true;
  }

  nlohmann::json parse_value(int depth) {
    if (depth > kMaxDepth) fail(fmt::format("nesting deeper than {} levels", kMaxDepth));
    skip_space();
    if (at_ == end_) fail("unexpected end of input; expected a value");
    switch (*at_) {
      case '{':
        return parse_object(depth);
      case '[':
        return parse_array(depth);
      case '"':
        return parse_string();
      case 't':
        return parse_literal("true", true);
      case 'f':
        return parse_literal("false", false);
      case 'n':
        return parse_literal("null", nullptr);
      default:
        if (*at_ != '-' && (*at_ < '0' || *at_ > '9')) fail("expected a value");
        return parse_number();
    }
  }

  nlohmann::json parse_object(int depth) {
    ++at_;  // '{'
    nlohmann::json object = nlohmann::json::object();
    if (next_is('}')) return object;
    do {
      skip_space();
      if (at_ == end_ || *at_ != '"') fail("expected a string key");
      std::string key = parse_string();
      expect(':', "':' after a key");
      object[std::move(key)] = parse_value(depth + 1);
    } while (next_is(','));
    expect('}', "',' or '}'");
    return object;
  }

  nlohmann::json parse_array(int depth) {
    ++at_;  // '['
    nlohmann::json array = nlohmann::json::array();
    if (next_is(']')) return array;
    do {
      array.push_back(parse_value(depth + 1));
    } while (next_is(','));
    expect(']', "',' or ']'");
    return array;
  }

  nlohmann::json parse_literal(std::string_view word, nlohmann::json value) {
    if (static_cast<size_t>(end_ - at_) < word.size() || std::string_view(at_, word.size()) != word)
      fail("invalid literal");
    at_ += word.size();
    return value;
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?, converted by nlohmann.
  nlohmann::json parse_number() {
    const char* start = at_;
    const auto digits = [&](const char* what) {
      if (at_ == end_ || *at_ < '0' || *at_ > '9') fail(fmt::format("expected a digit {}", what));
      while (at_ != end_ && *at_ >= '0' && *at_ <= '9') ++at_;
    };
    if (*at_ == '-') ++at_;
    if (at_ != end_ && *at_ == '0') {
      ++at_;
    } else {
      digits("after '-'");
    }
    if (at_ != end_ && *at_ == '.') {
      ++at_;
      digits("after '.'");
    }
    if (at_ != end_ && (*at_ == 'e' || *at_ == 'E')) {
      ++at_;
      if (at_ != end_ && (*at_ == '+' || *at_ == '-')) ++at_;
      digits("in the exponent");
    }
    const std::string_view number(start, static_cast<size_t>(at_ - start));
    try {
      return nlohmann::json::parse(number.begin(), number.end());
    } catch (const nlohmann::json::exception&) {  // 1e400: out of a double's range
      at_ = start;
      fail(fmt::format("number {} out of range", number));
    }
  }

  unsigned hex4() {
    if (end_ - at_ < 4) fail("expected four hex digits after \\u");
    unsigned value = 0;
    for (int i = 0; i < 4; ++i, ++at_) {
      const char c = *at_;
      const unsigned digit = c >= '0' && c <= '9'   ? unsigned(c - '0')
                             : c >= 'a' && c <= 'f' ? unsigned(c - 'a' + 10)
                             : c >= 'A' && c <= 'F' ? unsigned(c - 'A' + 10)
                                                    : 16u;
      if (digit == 16u) fail("expected four hex digits after \\u");
      value = value * 16 + digit;
    }
    return value;
  }

  // After "\u": the code point, joining a surrogate pair.
  unsigned code_point() {
    const unsigned first = hex4();
    if (first >= 0xDC00 && first <= 0xDFFF) fail("a low surrogate \\uDC00..\\uDFFF comes alone");
    if (first < 0xD800 || first > 0xDBFF) return first;
    if (end_ - at_ < 2 || at_[0] != '\\' || at_[1] != 'u')
      fail("a high surrogate \\uD800..\\uDBFF needs a low one after it");
    at_ += 2;
    const unsigned second = hex4();
    if (second < 0xDC00 || second > 0xDFFF)
      fail("a high surrogate \\uD800..\\uDBFF needs a low one after it");
    return 0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00);
  }

  static void append_utf8(std::string& out, unsigned point) {
    if (point < 0x80) {
      out += static_cast<char>(point);
    } else if (point < 0x800) {
      out += static_cast<char>(0xC0 | (point >> 6));
      out += static_cast<char>(0x80 | (point & 0x3F));
    } else if (point < 0x10000) {
      out += static_cast<char>(0xE0 | (point >> 12));
      out += static_cast<char>(0x80 | ((point >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (point & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (point >> 18));
      out += static_cast<char>(0x80 | ((point >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((point >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (point & 0x3F));
    }
  }

  // The length of the well-formed UTF-8 sequence at at_ (RFC 3629: no overlong forms, no
  // surrogates, nothing above U+10FFFF), or 0.
  size_t utf8_length() const {
    const auto byte = [&](ptrdiff_t i) { return static_cast<unsigned char>(at_[i]); };
    const ptrdiff_t left = end_ - at_;
    const auto continuation = [&](ptrdiff_t i, unsigned low = 0x80, unsigned high = 0xBF) {
      return i < left && byte(i) >= low && byte(i) <= high;
    };
    const unsigned lead = byte(0);
    if (lead >= 0xC2 && lead <= 0xDF) return continuation(1) ? 2 : 0;
    if (lead >= 0xE0 && lead <= 0xEF) {
      const unsigned low = lead == 0xE0 ? 0xA0 : 0x80, high = lead == 0xED ? 0x9F : 0xBF;
      return continuation(1, low, high) && continuation(2) ? 3 : 0;
    }
    if (lead >= 0xF0 && lead <= 0xF4) {
      const unsigned low = lead == 0xF0 ? 0x90 : 0x80, high = lead == 0xF4 ? 0x8F : 0xBF;
      return continuation(1, low, high) && continuation(2) && continuation(3) ? 4 : 0;
    }
    return 0;
  }

  std::string parse_string() {
    ++at_;  // '"'
    std::string out;
    for (;;) {
      const char* run = at_;
      while (at_ != end_) {
        const auto c = static_cast<unsigned char>(*at_);
        if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80) break;
        ++at_;
      }
      out.append(run, static_cast<size_t>(at_ - run));
      if (at_ == end_) fail("unterminated string");
      const auto c = static_cast<unsigned char>(*at_);
      if (c == '"') {
        ++at_;
        return out;
      }
      if (c < 0x20) fail("control character in a string (write it as an escape)");
      if (c >= 0x80) {
        const size_t length = utf8_length();
        if (length == 0) fail("ill-formed UTF-8");
        out.append(at_, length);
        at_ += length;
        continue;
      }
      ++at_;  // '\\'
      if (at_ == end_) fail("unterminated string");
      switch (*at_++) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u':
          append_utf8(out, code_point());
          break;
        default:
          --at_;
          fail("invalid escape");
      }
    }
  }

  const char* begin_;
  const char* at_;
  const char* end_;
};

}  // namespace

nlohmann::json parse_json(std::string_view text) {
  return Parser(text.data(), text.data() + text.size()).document();
}

}  // namespace kvsnap::tools
