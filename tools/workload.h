// Multi-turn workloads for `kvsnap replay`: the JSONL format, the chat rendering into tokens of
// the built-in model's byte-level vocabulary, and how requests refer to earlier ones.
//
// One JSON object per line (blank lines and lines starting with '#' are skipped):
//   {"id": "a1", "messages": [{"role": "system", "content": "..."}, {"role": "user", ...}]}
//   {"id": "a2", "after": "a1", "messages": [{"role": "user", "content": "..."}]}
//   {"id": "a1r", "regenerate": "a1"}
//   {"id": "a1e", "edit": "a1", "messages": [{"role": "user", "content": "..."}]}
// Optional "max_tokens" (1..4096, default 16) bounds the reply. "after" continues a request's
// conversation (its prompt and generated reply, then these messages); "regenerate" repeats a
// request's prompt; "edit" replaces a request's messages with these.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kvsnap {
struct ModelConfig;
}

namespace kvsnap::tools {

// The byte-level chat vocabulary: bytes 0..255, then role and end markers.
enum Token : int32_t { kSystem = 256, kUser = 257, kAssistant = 258, kTool = 259, kEnd = 260 };
constexpr int64_t kVocabularyNeeded = 261;
// Throws Error "replay: the model's vocabulary of N is smaller than the 261 tokens the chat
// format needs" when `vocab_size` < kVocabularyNeeded.
void check_vocabulary(int64_t vocab_size);

struct Message {
  int32_t role = kUser;  // kSystem, kUser, kAssistant or kTool
  std::string content;
};

struct Request {
  std::string id;
  enum class Kind { fresh, after, regenerate, edit } kind = Kind::fresh;
  std::string reference;  // the id named by after / regenerate / edit
  std::vector<Message> messages;
  int64_t max_tokens = 16;
  int64_t line = 0;  // where it came from
};

struct Workload {
  std::string name;
  std::vector<Request> requests;
};

// Parses JSONL. Throws kvsnap::Error "<source> line N: <what is wrong>" for the first bad line.
// Time and memory are linear in the text's size (nlohmann-json parses each line, a message's
// content is moved out of it, not copied again).
Workload parse_workload(const std::string& text, const std::string& source);
// Reads and parses a workload file; throws Error "cannot read <path>: <reason>" when the file
// cannot be opened or read (a failed read is never taken for an empty file).
Workload load_workload(const std::string& path);
// The default workload embedded in the binary (data/workload.jsonl).
Workload embedded_workload();
// An embedded workload by name: "default", "many-users" (data/many-users.jsonl: 16 users
// on one long system prompt, for --parallel) or "code-edits" (data/code-edits.jsonl: a coding
// agent quoting files back, for --speculate). Throws Error naming the known ones.
Workload embedded_workload(const std::string& name);
std::vector<std::string> embedded_workload_names();
// The model config embedded from data/model-16m.json (weights beyond the cache, for the
// parallel figures).
ModelConfig embedded_model_16m();

// Tokens of `messages`: per message the role token, the content's bytes, kEnd.
std::vector<int32_t> render(const std::vector<Message>& messages);
// render(messages).size(), without rendering.
int64_t rendered_length(const std::vector<Message>& messages);

// Per request, in order, the fewest tokens its prompt can have whatever replies the requests
// it refers to get (each reply adds at least one token), computed from the messages' lengths
// alone. Exact for a request that refers to no other. Throws Error when a request refers to
// an id no earlier request has.
std::vector<int64_t> minimum_prompt_lengths(const Workload& workload);

// Builds prompts as the replay goes, from the replies generated so far.
class PromptBuilder {
 public:
  // The prompt for `request`; every request it refers to must have been recorded.
  // `boundaries` gets the offsets where messages end (restore points an engine would ask for).
  std::vector<int32_t> prompt(const Request& request, std::vector<int64_t>* boundaries) const;
  void record(const Request& request, std::vector<int32_t> prompt, std::vector<int32_t> reply);

 private:
  struct Done {
    std::vector<int32_t> context;  // what the request's messages were appended to
    std::vector<int32_t> prompt, reply;
    std::vector<int64_t> boundaries;
  };
  std::map<std::string, Done> done_;
};

}  // namespace kvsnap::tools
