// measure_ideals: what each request of a workload would evaluate at best, from the longest
// prefix it shares with what earlier requests held. One walk down a token trie per request:
// linear in the workload's tokens, where comparing with every earlier request was quadratic.
#include <kvsnap/error.h>

#include <unordered_map>

#include "replay.h"

namespace kvsnap::tools {
namespace {

// Sequences added so far, as a trie of their tokens: the longest prefix of a query any of them
// shares.
class PrefixIndex {
 public:
  int64_t longest(const std::vector<int32_t>& tokens) const {
    uint64_t node = 0;
    int64_t depth = 0;
    for (const int32_t token : tokens) {
      const auto child = children_.find(key(node, token));
      if (child == children_.end()) break;
      node = child->second;
      ++depth;
    }
    return depth;
  }
  void add(const std::vector<int32_t>& tokens) {
    uint64_t node = 0;
    for (const int32_t token : tokens) {
      if (children_.size() + 1 >= kMostNodes) {
        throw Error(
            "replay: a workload of more than 2^32 distinct prefixes (its requests' tokens)");
      }
      node = children_.try_emplace(key(node, token), children_.size() + 1).first->second;
    }
  }

 private:
  static constexpr uint64_t kMostNodes = uint64_t(1) << 32;
  // A node's child by token: nodes are numbered from 1 (0 is the root), fewer than 2^32 of them.
  static uint64_t key(uint64_t node, int32_t token) {
    return node << 32 | static_cast<uint32_t>(token);
  }
  std::unordered_map<uint64_t, uint64_t> children_;
};

}  // namespace

void measure_ideals(const std::vector<std::vector<int32_t>>& prompts,
                    std::vector<RequestResult>& requests) {
  PrefixIndex seen, evaluated;  // what earlier requests held
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::vector<int32_t>& prompt = prompts[i];
    RequestResult& result = requests[i];
    const int64_t longest_seen = std::min(seen.longest(prompt), result.prompt_tokens);
    result.ideal = std::max<int64_t>(1, result.prompt_tokens - longest_seen);
    const int64_t longest_evaluated = std::min(evaluated.longest(prompt), longest_seen);
    result.floor = std::max<int64_t>(1, result.prompt_tokens - longest_evaluated);
    std::vector<int32_t> sequence = prompt;
    sequence.insert(sequence.end(), result.reply.begin(), result.reply.end());
    seen.add(sequence);
    sequence.pop_back();  // a decoder never evaluates its last sampled token
    evaluated.add(sequence);
  }
}

}  // namespace kvsnap::tools
