// parse_redis_address (redis_store.h): a Redis address's parts, the password decoded and never
// shown in an error.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "kvsnap/error.h"
#include "tier/redis_store.h"

namespace kvsnap::detail {
namespace {

Error bad_address(const std::string& address, const std::string& rule) {
  return Error(fmt::format(
      "tier address {}: {} (expected redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] or dir:PATH)",
      redact_address(address), rule));
}

int parse_number(const std::string& address, std::string_view text, int low, int high,
                 const char* what) {
  int value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || value < low ||
      value > high) {
    // A port or database that is not digits is not shown: it may be (part of) a password
    // written without its '@'.
    const bool shown =
        std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
    throw bad_address(address,
                      fmt::format("{} {} is not a number in [{}, {}]", what,
                                  shown ? fmt::format("\"{}\"", text) : "(not shown)", low, high));
  }
  return value;
}

std::string percent_decode(const std::string& address, std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      out += text[i];
      continue;
    }
    int value = 0;
    const char* first = text.data() + i + 1;
    if (i + 2 >= text.size()) throw bad_address(address, "a % escape needs two hex digits");
    const auto [end, error] = std::from_chars(first, first + 2, value, 16);
    if (error != std::errc() || end != first + 2) {
      throw bad_address(address, "a % escape needs two hex digits");
    }
    out += static_cast<char>(value);
    i += 2;
  }
  return out;
}

}  // namespace

RedisAddress parse_redis_address(const std::string& address) {
  const std::string scheme = "redis://";
  if (address.rfind(scheme, 0) != 0) throw bad_address(address, "it does not start with redis://");
  std::string_view rest = std::string_view(address).substr(scheme.size());
  RedisAddress out;
  if (const size_t at = rest.rfind('@'); at != std::string_view::npos) {
    const std::string_view credentials = rest.substr(0, at);
    const size_t colon = credentials.find(':');
    if (colon == std::string_view::npos) throw bad_address(address, "credentials need a ':'");
    out.user = percent_decode(address, credentials.substr(0, colon));
    out.password = percent_decode(address, credentials.substr(colon + 1));
    if (out.password.empty()) throw bad_address(address, "the password after ':' is empty");
    rest = rest.substr(at + 1);
  }
  if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
    out.database = parse_number(address, rest.substr(slash + 1), 0, 1 << 20, "database");
    rest = rest.substr(0, slash);
  }
  std::string_view host = rest;
  const size_t bracket = rest.rfind(']');
  const size_t colon = rest.rfind(':');
  if (colon != std::string_view::npos && (bracket == std::string_view::npos || colon > bracket)) {
    out.port = parse_number(address, rest.substr(colon + 1), 1, 65535, "port");
    host = rest.substr(0, colon);
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) throw bad_address(address, "the host is empty");
  out.host = std::string(host);
  return out;
}

}  // namespace kvsnap::detail
