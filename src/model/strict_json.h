// JSON the built-in model and the CLI read from files a person wrote (model configs, workloads):
// an object that holds a key twice is refused — nlohmann's parse keeps the last one silently,
// so a config's second "hidden" would quietly win, a workload's second "after" hide the first.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace kvsnap::detail {

// Thrown by parse_without_duplicate_keys: the key an object holds twice.
struct DuplicateKey {
  std::string key;
};

// nlohmann::json::parse (its exceptions for text that is not JSON), throwing DuplicateKey for
// an object that holds a key twice.
inline nlohmann::json parse_without_duplicate_keys(std::string_view text) {
  std::vector<std::set<std::string>> keys;  // of each object open at this point
  const nlohmann::json::parser_callback_t check = [&](int, nlohmann::json::parse_event_t event,
                                                      nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) keys.emplace_back();
    if (event == Event::object_end) keys.pop_back();
    if (event == Event::key && !keys.back().insert(parsed.get<std::string>()).second) {
      throw DuplicateKey{parsed.get<std::string>()};
    }
    return true;
  };
  return nlohmann::json::parse(text, check);
}

}  // namespace kvsnap::detail
