// `kvsnap replay --speculate K`: greedy decoding with speculation over the prefix cache —
// prompt-lookup drafts of up to K tokens verified in one forward, rejected ones rolled back by
// kvsnap::Speculation — compared with plain greedy decoding, token for token.
#pragma once

#include <kvsnap/prefix_cache.h>
#include <kvsnap/speculation.h>

#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "model/model.h"
#include "replay.h"
#include "workload.h"

namespace kvsnap::tools {

// Drafting without a second model: the longest n-gram (max_ngram tokens down to min_ngram)
// that ends the context and occurred earlier in it proposes what followed its most recent
// earlier occurrence. A continuation that runs into the context's end goes on over the drafts
// themselves (a loop of period p keeps proposing).
class PromptLookup {
 public:
  explicit PromptLookup(int64_t max_ngram = 4, int64_t min_ngram = 1);
  // Writes up to `k` drafts continuing `context` into `drafts` (cleared first; none without a
  // match).
  void draft(std::span<const int32_t> context, int64_t k, std::vector<int32_t>& drafts) const;

 private:
  int64_t max_ngram_, min_ngram_;
};

// Decode-phase figures of one run.
struct DecodeStats {
  int64_t tokens = 0;        // reply tokens generated in the decode phase (after the prefill's)
  double seconds = 0;        // decode phase: after each prefill forward to the end of the reply
  double round_seconds = 0;  // in Speculation::begin/accept: scheduling captures and rollback
  int64_t rounds = 0, drafted = 0, accepted = 0;
  int64_t forwards = 0;  // decode forwards (verify or plain)
  double acceptance_rate() const {
    return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0;
  }
  double tokens_per_second() const {
    return seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
  }
};

struct SpeculativeRun {
  RunResult run;
  DecodeStats decode;
};

struct SpeculateOptions {
  int64_t speculate = 4;   // drafts per round; 0: plain greedy decoding
  double draft_noise = 0;  // see SpeculativeDecoder
  int64_t max_paged_out_bytes = int64_t(8) << 30;
  std::function<void(size_t, size_t)> progress = [](size_t, size_t) {};
};

// Every request in order through one prefix cache (as replay() with the cache), decoding each
// reply greedily with speculation.
SpeculativeRun replay_speculative(const Workload&, const Model&, const SpeculateOptions&);

// How one verify forward settles its drafts: `choose(j)` takes (and records) the model's token
// from row j, which follows the last token and the first j drafts; `done(token)` says whether
// the token ends the reply. A draft is accepted when it equals the model's token there, up to
// the first one that differs or ends the reply.
struct SettledDrafts {
  int64_t kept = 0;      // drafts the layers keep (Speculation::accept): never a reply's end
  int64_t accepted = 0;  // drafts equal to the model's tokens: kept, plus one that ended it
  int32_t last = 0;      // the last token chosen: the next round's first
};
SettledDrafts settle_drafts(std::span<const int32_t> drafts,
                            const std::function<int32_t(int64_t)>& choose,
                            const std::function<bool(int32_t)>& done);

// Greedy decoding of one sequence with speculation rounds (K = 0: plain decode steps).
class SpeculativeDecoder {
 public:
  // `draft_noise`: the probability that a draft is replaced by another token before
  // verification — a knob that lowers acceptance to measure speed and rollback below 1.
  SpeculativeDecoder(const Model& model, std::vector<Cache*> layers, int64_t speculate,
                     double draft_noise = 0);
  // The reply after a prefill: `logits` is the prefill's last row, `context` the prompt. Every
  // generated token goes to result.reply (with its logits) and, when given, to `session`; the
  // layers end with every reply token but the last evaluated, as plain decoding leaves them.
  void decode(PrefixCache::Session* session, std::vector<int32_t> context, Array logits,
              int64_t max_tokens, RequestResult& result, DecodeStats& stats);

 private:
  const Model& model_;
  std::vector<Cache*> layers_;
  int64_t speculate_;
  double draft_noise_;
  std::mt19937 noise_{17};
  PromptLookup lookup_;
  Speculation round_;
  std::vector<int32_t> verify_;  // the last token, then the drafts
};

struct SpeculateReport {
  SpeculativeRun speculative, plain;  // both with the prefix cache
  RunResult uncached;                 // plain greedy decoding without it: the reference
  Comparison comparison;              // speculative against the reference
  Comparison plain_comparison;        // plain with the cache (the speed baseline) against it
  std::string table, json;
  bool agree() const {
    return comparison.first_difference.empty() && plain_comparison.first_difference.empty();
  }
};

// The three runs and their figures (table and JSON: replay's, plus speculate, acceptance_rate,
// decode_tokens_per_s, decode_tokens_per_s_plain, rollback_share, plain_agree; "agree" when
// both runs with the cache agree with the reference).
SpeculateReport speculate_report(const Workload&, const Model&, const SpeculateOptions&,
                                 const std::function<void(size_t, size_t)>& uncached_progress,
                                 const std::function<void(size_t, size_t)>& plain_progress);
// Compares both runs with the reference and writes the table and the JSON of `r`'s runs.
void finish_report(SpeculateReport& r, const std::string& workload, const SpeculateOptions&);

}  // namespace kvsnap::tools
