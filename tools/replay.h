// `kvsnap replay`: a multi-turn workload through the built-in model, with the prefix cache and
// without, greedy-decoding every reply, and the figures that compare the two runs.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "kvsnap/prefix_cache.h"
#include "kvsnap/tier.h"
#include "logits.h"
#include "model/model.h"
#include "output.h"
#include "workload.h"

namespace kvsnap::tools {

struct RequestResult {
  std::string id;
  int64_t prompt_tokens = 0;
  int64_t evaluated = 0;    // prompt tokens the model evaluated
  int64_t reused = 0;       // prompt tokens restored from the cache
  int64_t ideal = 0;        // max(1, prompt tokens never seen before)
  int64_t floor = 0;        // max(1, prompt tokens never evaluated before): the best a cache of
                            // evaluated state can do (a decoder never evaluates its last token)
  double ttft_seconds = 0;  // request start to the first reply token's logits
  // From when the request could start — the run's start, or the end of the request it follows
  // (after / regenerate / edit) — to its start: time queued behind other requests (the
  // sequential run serves one at a time; --parallel: until a slot took it).
  double waited_seconds = 0;
  std::vector<int32_t> reply;
  LogitRows logits;  // per reply token, the logits it was chosen from (on its run's tape)
};

struct RunResult {
  bool with_cache = false;
  std::vector<RequestResult> requests;
  int64_t paged_out_bytes = 0;
  int64_t evicted_nodes = 0;
  int64_t trie_nodes = 0;
  int64_t loaded_nodes = -1;  // nodes loaded from the cache directory at start; -1: none loaded
  // Of them, evicted at once by a budget smaller than the saving run's (counted in
  // evicted_nodes too): the cache saved at the end holds only what fits.
  int64_t load_evicted_nodes = 0;
  double seconds = 0;
  bool with_tier = false;
  TierStats tier;  // with_tier: the tier's counters at the end (its writes flushed)
  // With a cache_dir: saves the run's prefix cache there (PrefixCache::save, and its Error). A
  // run never saves by itself: its caller saves once it has checked the run (and printed its
  // results). Holds the run's caches alive until destroyed. Empty without a cache_dir.
  std::function<void()> save_cache;
};

struct ReplayOptions {
  bool with_cache = true;
  int64_t max_paged_out_bytes = int64_t(8) << 30;
  // With the cache: load the trie from here at start when saved there; RunResult::save_cache
  // saves it there.
  std::string cache_dir;
  // Trust a cache_dir (and the cache saved in it) that another user owns or that group or
  // others can write (LoadOptions::allow_shared); by default check_cache_dir refuses it.
  bool shared_cache_dir = false;
  std::string model_id;  // recorded with the saved trie, checked when loading it
  // With the cache: a store shared with other processes below the prefix cache (Tier::open's
  // address; empty: none), opened with `tier_options` for the model's layers. The run waits for
  // its writes (at most 10 s) before it returns.
  std::string tier;
  TierOptions tier_options;
  // Called after each request with (done, total).
  std::function<void(size_t, size_t)> progress = [](size_t, size_t) {};
};

// Runs every request in order. Before any model work it refuses (throws Error) a workload with
// a request that cannot fit the model's context (check_context_length) and an unusable cache
// directory (check_cache_dir); before evaluating each request it checks the request's exact
// prompt length, which replies make longer than the minimum, in the same words (InputError).
// A saved cache that cannot be loaded throws InputError (load_saved_cache).
RunResult replay(const Workload&, const Model&, const ReplayOptions&);

// Loads the prefix cache saved in `dir` into `prefix` when there is one (LoadOptions::
// allow_shared = `shared`) and sets run.loaded_nodes and run.load_evicted_nodes (-1 and 0 when
// none was saved). Throws InputError with PrefixCache's message for a cache saved for another
// model_id, damaged or refused.
void load_saved_cache(PrefixCache& prefix, const std::string& dir, const std::string& model_id,
                      bool shared, RunResult& run);

// Shared by the sequential and the parallel replay:
// The index of the largest logit (greedy decoding; the first on ties).
int32_t argmax(const float* logits, int64_t n);
// The q-quantile of `values`, linearly interpolated; 0 for none. Error for q outside [0, 1].
double percentile(std::vector<double> values, double q);
// Throws the InputError of check_context_length for `request`'s exact prompt length.
void check_prompt_fits(const Workload& workload, const Request& request, int64_t prompt_tokens,
                       int64_t context_length);
// Fills each request's ideal (prompt tokens no earlier request had seen, at least one) and
// floor (those never evaluated before: what a cache of evaluated state can at best skip),
// earlier meaning before it in workload order; `prompts[i]` is request i's prompt.
void measure_ideals(const std::vector<std::vector<int32_t>>& prompts,
                    std::vector<RequestResult>& requests);

// Throws InputError "<workload> line N: request \"<id>\": prompt of at least P tokens + max_tokens
// M = T exceeds the model's context length of C" for the first request whose minimum prompt length
// (minimum_prompt_lengths) plus max_tokens exceeds `context_length`. Linear in the number of
// requests; renders nothing.
void check_context_length(const Workload& workload, int64_t context_length);

// The clock the tools time runs with, and seconds on it from `start` to now.
using Clock = std::chrono::steady_clock;
inline double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The file PrefixCache::save writes in its folder.
inline constexpr const char* kSavedCacheFile = "prefix_cache.safetensors";

// Makes sure `dir` is a folder the prefix cache can be saved in and loaded from: creates it
// when missing (mode 0700 for each folder made, whatever the umask), and writes (then removes)
// a probe file. Throws Error "cache directory <dir>: <why>" otherwise. Unless `shared`, it also
// refuses, before any work, a `dir` or saved cache file that another user owns or that group or
// others can write (Error "replay --cache-dir: refusing the folder <dir> (owner ..., mode ...):
// ...; pass --shared-cache-dir to trust it anyway").
void check_cache_dir(const std::string& dir, bool shared = false);

struct Comparison {
  bool same_tokens = true;
  std::string first_difference;  // empty when the runs agree
  double max_logit_difference = 0;
};
// The runs agree when they hold the same requests with the same replies and every logit is
// within `tolerance` of the other run's, relative to its size above 1 (|a - b| / max(1, |b|)).
Comparison compare(const RunResult& cached, const RunResult& uncached, double tolerance);

struct Summary {
  int64_t requests = 0, prompt_tokens = 0, evaluated_cached = 0, evaluated_uncached = 0, ideal = 0;
  int64_t gap_seen_not_evaluated = 0, gap_restore_points = 0;
  double ttft_median_cached = 0, ttft_p90_cached = 0, ttft_median_uncached = 0,
         ttft_p90_uncached = 0;
  int64_t paged_out_bytes = 0, evicted_nodes = 0, trie_nodes = 0, loaded_nodes = -1,
          load_evicted_nodes = 0;
  double seconds_cached = 0, seconds_uncached = 0;
  bool with_tier = false;
  TierStats tier;
};
Summary summarize(const RunResult& cached, const RunResult& uncached);

// Whether the cached run restored state earlier runs saved: a warm start, or tier hits.
bool restored_from_before(const Summary&);
std::string format_table(const Summary&, const Comparison&, const std::string& workload);
// The tables' lines on a warm start (none when `loaded` < 0): how many nodes were loaded and how
// many of them the budget evicted at once.
std::string warm_start_lines(int64_t loaded, int64_t load_evicted);
// The tables' lines on the tokens evaluated with the cache over the ideal: after a warm start
// (or tier hits) the ideal's meaning; else what the tokens over it were.
std::string ideal_gap_lines(int64_t evaluated, int64_t ideal, int64_t seen_not_evaluated,
                            int64_t restore_points, bool warm);
// The JSON's "gap": its parts, or null after a warm start (or tier hits), when the cached run
// evaluates fewer tokens than the ideal (which counts tokens new to this run).
nlohmann::json gap_json(int64_t seen_not_evaluated, int64_t restore_points, bool warm);
// Throws Error "CALL: runs of N and M requests: ..." unless both runs hold as many requests
// (the outputs that pair two runs' requests pair runs of one workload).
void check_paired(const RunResult& a, const RunResult& b, const char* call);
// Both runs' requests, paired (check_paired).
std::string format_json(const Summary&, const Comparison&, const RunResult& cached,
                        const RunResult& uncached, const std::string& workload);
// An SVG chart of tokens evaluated per request, with and without the cache, and the ideal
// (check_paired).
std::string format_chart(const RunResult& cached, const RunResult& uncached);

}  // namespace kvsnap::tools
