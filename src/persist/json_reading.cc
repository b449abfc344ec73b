#include "persist/json_reading.h"

#include <fmt/format.h>

#include <functional>
#include <limits>

#include "persist/safetensors.h"

namespace kvsnap::detail {
namespace {

using Json = nlohmann::json;

// Error messages show this much of a value read from a file.
constexpr size_t kDescribedChars = 120;
constexpr size_t kDescribedStringBytes = 40;
constexpr int kDescribedLevels = 3;

// The deepest nesting of brackets outside strings: for valid JSON, the parser's depth.
bool nests_deeper_than(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

// Sets `problem` when `text` nests deeper than kMaxJsonDepth (a linear scan, before any parse).
bool too_deep(std::string_view text, std::string& problem) {
  if (!nests_deeper_than(text, kMaxJsonDepth)) return false;
  problem = fmt::format("nests deeper than {} levels", kMaxJsonDepth);
  return true;
}

// Parses `text`, found no deeper than kMaxJsonDepth; null with `problem` set when it is invalid.
Json parse_checked(std::string_view text, std::string& problem) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    problem = fmt::format("is not valid JSON ({})", e.what());
  }
  return nullptr;
}

}  // namespace

bool int64_number(const Json& v) {
  return v.is_number_integer() &&
         !(v.is_number_unsigned() &&
           v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
}

std::string cut_quoted(const std::string& text) {
  const bool cut = text.size() > kDescribedStringBytes;
  const Json shown = cut ? text.substr(0, kDescribedStringBytes) : text;
  std::string out = shown.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (cut) out.insert(out.size() - 1, "...");
  return out;
}

namespace {

// Appends `value` to `out`, containers `levels` deep, stopping once `out` is kDescribedChars long.
void render(const Json& value, int levels, std::string& out) {
  if (value.is_string()) {
    out += cut_quoted(value.get_ref<const std::string&>());
    return;
  }
  if (!value.is_structured()) {
    out += value.dump();  // a number, a boolean or null: short
    return;
  }
  const bool object = value.is_object();
  if (levels == 0) {
    const char* plural = value.size() == 1 ? "" : "s";
    out += object ? fmt::format("{{{} member{}}}", value.size(), plural)
                  : fmt::format("[{} element{}]", value.size(), plural);
    return;
  }
  out += object ? '{' : '[';
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (it != value.begin()) out += ',';
    if (out.size() > kDescribedChars) {
      out += "...";
      break;
    }
    if (object) out += cut_quoted(it.key()) + ':';
    render(*it, levels - 1, out);
  }
  out += object ? '}' : ']';
}

// A JSON array read element by element, each built alone and handed to `take` in order.
class ElementReader : public ValueEvents {
 public:
  ElementReader(int64_t most, const std::function<void(Json)>& take)
      : most_(most), builder_(most), take_(take) {}

 private:
  bool member(std::string name) override {
    builder_.key(std::move(name));
    return true;
  }
  bool scalar(Json value) override {
    if (depth_ == 0) return not_an_array();
    if (depth_ == 1) {
      take_(std::move(value));
      return true;
    }
    return added(builder_.add(std::move(value), false));
  }
  bool open(Json container) override {
    if (depth_ == 0 && !container.is_array()) return not_an_array();
    if (depth_ == 1) builder_.start(std::move(container));
    if (depth_ >= 2 && !added(builder_.add(std::move(container), true))) return false;
    ++depth_;
    return true;
  }
  bool close() override {
    if (--depth_ >= 1 && builder_.close()) take_(builder_.take());
    return true;
  }
  bool not_an_array() {
    problem_ = kNotAnArray;
    return false;
  }
  bool added(bool within) {
    if (!within) problem_ = fmt::format("has an element of more than {} JSON values", most_);
    return within;
  }

  int64_t most_;
  ValueBuilder builder_;
  const std::function<void(Json)>& take_;
};

}  // namespace

bool ValueCount::run(std::string_view text) {
  if (too_deep(text, problem_)) return false;
  if (!Json::sax_parse(text, this) && problem_.empty()) problem_ = "is not valid JSON";
  return problem_.empty();
}

bool ValueCount::parse_error(std::size_t, const std::string&,
                             const nlohmann::detail::exception& e) {
  problem_ = fmt::format("is not valid JSON ({})", e.what());  // as parse_json says it
  return false;
}

Json parse_json(std::string_view text, int64_t max_values, std::string& problem) {
  ValueCount count;
  if (!count.run(text)) {
    problem = count.failure();
    return nullptr;
  }
  if (count.values() > max_values) {
    problem =
        fmt::format("holds {} JSON values, more than the {} it may", count.values(), max_values);
    return nullptr;
  }
  problem.clear();
  return parse_checked(text, problem);  // its depth checked by run()
}

bool for_each_element(std::string_view text, int64_t max_values,
                      const std::function<void(Json)>& take, std::string& problem) {
  ElementReader reader(max_values, take);
  const bool read = reader.run(text);
  problem = reader.failure();
  return read;
}

Json parse_json(std::string_view text, std::string& problem) {
  problem.clear();
  return too_deep(text, problem) ? nullptr : parse_checked(text, problem);
}

std::string describe_json(const Json& value) {
  std::string out;
  render(value, kDescribedLevels, out);
  return out;
}

}  // namespace kvsnap::detail
