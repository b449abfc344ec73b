#include "workload.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <kvsnap/error.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "model/strict_json.h"

namespace kvsnap::tools {
namespace {

// A text from the workload for an error message: quoted, its first 64 bytes at most (a line may
// hold a gigabyte).
std::string cut(const std::string& text) {
  return text.size() <= 64 ? fmt::format("\"{}\"", text)
                           : fmt::format("\"{}...\" ({} bytes)", text.substr(0, 64), text.size());
}

// A JSON value for an error message: a number or literal as written, a string cut, an array or
// object by its type only (dumping a deeply nested one recurses once per level).
std::string describe(const nlohmann::json& value) {
  if (value.is_string()) return cut(value.get_ref<const std::string&>());
  if (value.is_array() || value.is_object()) return std::string("an ") + value.type_name();
  return value.dump();
}

int32_t parse_role(const std::string& role) {
  if (role == "system") return kSystem;
  if (role == "user") return kUser;
  if (role == "assistant") return kAssistant;
  if (role == "tool") return kTool;
  return -1;
}

// `json` is not const so that message contents can be moved out of it (a message may be tens
// of megabytes); every other field is only read, each after checking that it is there.
Request parse_line(nlohmann::json& json, const std::set<std::string>& known,
                   const std::function<Error(const std::string&)>& fail) {
  if (!json.is_object()) throw fail("expected a JSON object");
  Request request;
  for (const auto& [key, value] : json.items()) {
    if (key != "id" && key != "after" && key != "regenerate" && key != "edit" &&
        key != "messages" && key != "max_tokens") {
      throw fail(
          fmt::format("unknown field {} (known: id, after, regenerate, edit, messages, "
                      "max_tokens)",
                      cut(key)));
    }
  }
  if (!json.contains("id") || !json["id"].is_string() || json["id"].get<std::string>().empty()) {
    throw fail("\"id\" must be a non-empty string");
  }
  request.id = json["id"].get<std::string>();
  if (known.count(request.id) > 0) throw fail(fmt::format("id {} is used twice", cut(request.id)));
  int references = 0;
  for (const auto& [key, kind] : {std::pair{"after", Request::Kind::after},
                                  std::pair{"regenerate", Request::Kind::regenerate},
                                  std::pair{"edit", Request::Kind::edit}}) {
    if (!json.contains(key)) continue;
    ++references;
    if (!json[key].is_string()) throw fail(fmt::format("\"{}\" must be a string id", key));
    request.kind = kind;
    request.reference = json[key].get<std::string>();
    if (known.count(request.reference) == 0) {
      throw fail(fmt::format("\"{}\" names {}, which no earlier line defines", key,
                             cut(request.reference)));
    }
  }
  if (references > 1) throw fail("use at most one of \"after\", \"regenerate\", \"edit\"");
  if (json.contains("messages")) {
    auto& messages = json["messages"];
    if (!messages.is_array() || messages.empty())
      throw fail("\"messages\" must be a non-empty array");
    for (size_t i = 0; i < messages.size(); ++i) {
      auto& m = messages[i];
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
          !m.contains("content") || !m["content"].is_string()) {
        throw fail(fmt::format("message {} needs string \"role\" and \"content\"", i));
      }
      for (const auto& [key, value] : m.items()) {
        if (key != "role" && key != "content") {
          throw fail(
              fmt::format("message {} has unknown field {} (known: role, content)", i, cut(key)));
        }
      }
      const int32_t role = parse_role(m["role"].get<std::string>());
      if (role < 0) {
        throw fail(fmt::format("message {} has role {} (use system, user, assistant or tool)", i,
                               cut(m["role"].get<std::string>())));
      }
      request.messages.push_back({role, std::move(m["content"].get_ref<std::string&>())});
    }
  }
  if (request.kind == Request::Kind::regenerate && !request.messages.empty()) {
    throw fail("\"regenerate\" repeats a prompt and takes no \"messages\"");
  }
  if (request.kind != Request::Kind::regenerate && request.messages.empty()) {
    throw fail("\"messages\" is required");
  }
  if (json.contains("max_tokens")) {
    const auto& m = json["max_tokens"];
    if (!m.is_number_integer() || m.get<int64_t>() < 1 || m.get<int64_t>() > 4096) {
      throw fail(fmt::format("\"max_tokens\" is {}; need an integer in [1, 4096]", describe(m)));
    }
    request.max_tokens = m.get<int64_t>();
  }
  return request;
}

using detail::DuplicateKey;
using detail::parse_without_duplicate_keys;

}  // namespace

Workload parse_workload(const std::string& text, const std::string& source) {
  Workload workload;
  workload.name = source;
  std::set<std::string> known;
  int64_t number = 0;
  // A UTF-8 byte order mark (editors on some systems write one) is not part of line 1, whether a
  // comment or a request follows it.
  const size_t start = text.starts_with("\xEF\xBB\xBF") ? 3 : 0;
  for (size_t begin = start; begin < text.size();) {
    const size_t end = std::min(text.find('\n', begin), text.size());
    const std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    ++number;
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string_view::npos || line[first] == '#') continue;
    const auto fail = [&](const std::string& what) {
      return Error(fmt::format("{} line {}: {}", source, number, what));
    };
    nlohmann::json json;
    try {
      json = parse_without_duplicate_keys(line);
    } catch (const nlohmann::json::exception& e) {
      throw fail(fmt::format("not valid JSON ({})", e.what()));
    } catch (const DuplicateKey& duplicate) {
      throw fail(fmt::format("key {} appears twice in one object (which one counts is ambiguous)",
                             cut(duplicate.key)));
    }
    Request request = parse_line(json, known, fail);
    request.line = number;
    known.insert(request.id);
    workload.requests.push_back(std::move(request));
  }
  if (workload.requests.empty())
    throw Error(fmt::format("{}: the workload has no requests", source));
  return workload;
}

Workload load_workload(const std::string& path) {
  const auto fail = [&](int error) {
    return Error(fmt::format("cannot read {}: {}", path, std::strerror(error)));
  };
  struct File {
    int descriptor;
    ~File() {
      if (descriptor >= 0) ::close(descriptor);
    }
  } file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.descriptor < 0) throw fail(errno);
  std::string text;
  struct stat info {};
  // A workload is text of at most 1 GiB: `kvsnap replay /dev/zero` (or a pipe that never ends)
  // is refused instead of read until memory runs out; a larger file before any of it is read.
  constexpr size_t kMost = size_t(1) << 30;
  const auto too_large = [&] {
    return Error(fmt::format("{}: larger than 1 GiB, the most a workload may hold", path));
  };
  if (::fstat(file.descriptor, &info) == 0 && S_ISREG(info.st_mode)) {
    if (static_cast<uint64_t>(info.st_size) > kMost) throw too_large();
    text.reserve(static_cast<size_t>(info.st_size));
  }
  char buffer[1 << 16];
  for (;;) {
    const ssize_t count = ::read(file.descriptor, buffer, sizeof buffer);
    if (count == 0) break;
    if (count > 0 && text.size() + static_cast<size_t>(count) > kMost) throw too_large();
    if (count < 0) {
      if (errno == EINTR) continue;
      throw fail(errno);
    }
    text.append(buffer, static_cast<size_t>(count));
  }
  return parse_workload(text, path);
}

void check_vocabulary(int64_t vocab_size) {
  if (vocab_size < kVocabularyNeeded) {
    throw Error(fmt::format(
        "replay: the model's vocabulary of {} is smaller than the {} tokens the chat format needs",
        vocab_size, kVocabularyNeeded));
  }
}

std::vector<int32_t> render(const std::vector<Message>& messages) {
  std::vector<int32_t> out;
  for (const Message& m : messages) {
    out.push_back(m.role);
    for (unsigned char c : m.content) out.push_back(c);
    out.push_back(kEnd);
  }
  return out;
}

int64_t rendered_length(const std::vector<Message>& messages) {
  int64_t length = 0;
  for (const Message& m : messages) length += static_cast<int64_t>(m.content.size()) + 2;
  return length;
}

std::vector<int64_t> minimum_prompt_lengths(const Workload& workload) {
  // The fewest tokens of a request's prompt and of its context (what its own messages follow),
  // as PromptBuilder builds them.
  struct Bounds {
    int64_t prompt = 0, context = 0;
  };
  std::map<std::string, Bounds> known;
  std::vector<int64_t> lengths;
  lengths.reserve(workload.requests.size());
  for (const Request& request : workload.requests) {
    Bounds bounds;
    if (request.kind != Request::Kind::fresh) {
      const auto reference = known.find(request.reference);
      if (reference == known.end()) {
        throw Error(fmt::format(
            "minimum_prompt_lengths: request \"{}\" refers to \"{}\", which no earlier request "
            "defines",
            request.id, request.reference));
      }
      if (request.kind == Request::Kind::regenerate) {
        bounds = reference->second;
      } else if (request.kind == Request::Kind::after) {
        // The reply adds at least one token: its own, or the end token an empty reply gets.
        bounds.context = reference->second.prompt + 1;
      } else {
        bounds.context = reference->second.context;
      }
    }
    if (request.kind != Request::Kind::regenerate) {
      bounds.prompt = bounds.context + rendered_length(request.messages) + 1;  // + kAssistant
    }
    known[request.id] = bounds;
    lengths.push_back(bounds.prompt);
  }
  return lengths;
}

std::vector<int32_t> PromptBuilder::prompt(const Request& request,
                                           std::vector<int64_t>* boundaries) const {
  std::vector<int32_t> context;
  std::vector<int64_t> marks;
  if (request.kind != Request::Kind::fresh) {
    const Done& ref = done_.at(request.reference);
    if (request.kind == Request::Kind::regenerate) {
      if (boundaries != nullptr) *boundaries = ref.boundaries;
      return ref.prompt;
    }
    if (request.kind == Request::Kind::after) {
      context = ref.prompt;
      context.insert(context.end(), ref.reply.begin(), ref.reply.end());
      if (ref.reply.empty() || ref.reply.back() != kEnd) context.push_back(kEnd);
      marks = ref.boundaries;
      marks.push_back(static_cast<int64_t>(context.size()));
    } else {  // edit: the same context, other messages
      context = ref.context;
      for (int64_t b : ref.boundaries) {
        if (b <= static_cast<int64_t>(context.size())) marks.push_back(b);
      }
    }
  }
  std::vector<int32_t> prompt = context;
  for (const Message& m : request.messages) {
    const std::vector<int32_t> tokens = render({m});
    prompt.insert(prompt.end(), tokens.begin(), tokens.end());
    marks.push_back(static_cast<int64_t>(prompt.size()));
  }
  prompt.push_back(kAssistant);
  if (boundaries != nullptr) *boundaries = marks;
  return prompt;
}

void PromptBuilder::record(const Request& request, std::vector<int32_t> prompt,
                           std::vector<int32_t> reply) {
  Done done;
  if (request.kind == Request::Kind::regenerate) {
    done = done_.at(request.reference);
  } else {
    // The context is the prompt without this request's messages and the assistant marker.
    const int64_t own = rendered_length(request.messages) + 1;
    done.context.assign(prompt.begin(), prompt.end() - static_cast<std::ptrdiff_t>(own));
    (void)this->prompt(request, &done.boundaries);
  }
  done.prompt = std::move(prompt);
  done.reply = std::move(reply);
  done_[request.id] = std::move(done);
}

}  // namespace kvsnap::tools
