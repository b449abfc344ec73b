// Internal to persist/: reading JSON from files that may be damaged or forged without holding
// more of it as values than its use needs (nlohmann's SAX interface). JSON parsed into values
// takes several times its length: a forged 100 MiB safetensors header of `{}`s took 4 GB and
// 20 s. safetensors.h declares what the other layers use (parse_json, for_each_element,
// describe_json).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvsnap::detail {

// Counts the values (scalars, arrays and objects) of JSON text in one pass that builds nothing
// (nlohmann's SAX interface): text parsed into values takes several times its length (a forged
// 100 MiB safetensors header of `{}`s took 4 GB and 20 s), so what would hold more values than
// it may is refused before it is parsed.
class ValueCount : public nlohmann::json_sax<nlohmann::json> {
 public:
  // Counts `text`'s values; false, with problem_ set as parse_json sets it (or as a subclass
  // stopping early set it), when it is not valid JSON.
  bool run(std::string_view text);

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override { return open(); }
  bool key(string_t&) override { return true; }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override;

  int64_t values() const { return values_; }
  const std::string& failure() const { return problem_; }

 protected:
  int depth_ = 0;
  int64_t values_ = 0;
  std::string problem_;

 private:
  bool value() {
    ++values_;
    return true;
  }
  bool open() {
    ++depth_;
    return value();
  }
  bool close() {
    --depth_;
    return true;
  }
};

// One JSON value built from the SAX events of its part of a larger text, alone and of at most
// `most` values (a header's tensor entry, one node of a list), never the whole text at once.
class ValueBuilder {
 public:
  explicit ValueBuilder(int64_t most) : most_(most) {}
  void start(nlohmann::json container) {
    value_ = std::move(container);
    path_.assign(1, &value_);
    count_ = 1;
  }
  void key(std::string name) { key_ = std::move(name); }
  // Adds a scalar, or a container the next values go into (`opens`); false past `most` values.
  bool add(nlohmann::json value, bool opens) {
    if (++count_ > most_) return false;
    nlohmann::json& into = *path_.back();
    nlohmann::json* added = &into;
    if (into.is_object()) {
      added = &(into[key_] = std::move(value));
    } else {
      into.push_back(std::move(value));
      added = &into.back();
    }
    if (opens) path_.push_back(added);
    return true;
  }
  // Closes the innermost open container: true when that was the value's own.
  bool close() {
    path_.pop_back();
    return path_.empty();
  }
  nlohmann::json take() { return std::exchange(value_, nullptr); }

 private:
  int64_t most_, count_ = 0;
  nlohmann::json value_;
  std::vector<nlohmann::json*> path_;  // the open containers, outermost first (pointers stay valid:
                                       // only closed siblings move when a container grows)
  std::string key_;                    // the innermost object's key being read
};

// The SAX events as four hooks, for readers that build values from them: a scalar, a container
// opened (given empty), the innermost one closed, and an object's key.
class ValueEvents : public ValueCount {
 public:
  bool null() override { return scalar(nullptr); }
  bool boolean(bool value) override { return scalar(value); }
  bool number_integer(number_integer_t value) override { return scalar(value); }
  bool number_unsigned(number_unsigned_t value) override { return scalar(value); }
  bool number_float(number_float_t value, const string_t&) override { return scalar(value); }
  bool string(string_t& value) override { return scalar(std::move(value)); }
  bool binary(binary_t&) override { return scalar(nullptr); }  // not in JSON text
  bool start_object(std::size_t) override { return open(nlohmann::json::object()); }
  bool start_array(std::size_t) override { return open(nlohmann::json::array()); }
  bool key(string_t& name) override { return member(std::move(name)); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }

 protected:
  virtual bool scalar(nlohmann::json value) = 0;
  virtual bool open(nlohmann::json container) = 0;
  virtual bool close() = 0;
  virtual bool member(std::string name) = 0;
};

}  // namespace kvsnap::detail
