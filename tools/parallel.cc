#include "parallel.h"

#include <fmt/format.h>
#include <kvsnap/paged_kv_cache.h>
#include <kvsnap/prefix_cache.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

namespace kvsnap::tools {
namespace {

int64_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const auto [end_a, end_b] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return end_a - a.begin();
}

// What a request for `prompt` could restore from a sequence holding `other`: their common
// prefix, but never the prompt's last token (a request evaluates at least that one).
int64_t restorable(std::span<const int32_t> prompt, std::span<const int32_t> other) {
  return std::min(common_prefix(prompt, other), static_cast<int64_t>(prompt.size()) - 1);
}

// Distinct prefixes of `sequences`: the nodes of a trie holding them all (sum of lengths less
// the common prefixes of neighbours in sorted order).
int64_t distinct_prefixes(std::vector<std::span<const int32_t>> sequences) {
  std::sort(sequences.begin(), sequences.end(), [](auto a, auto b) {
    return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end());
  });
  int64_t total = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    total += static_cast<int64_t>(sequences[i].size());
    if (i > 0) total -= common_prefix(sequences[i - 1], sequences[i]);
  }
  return total;
}

// A request running on a slot.
struct Running {
  size_t index = 0;
  std::vector<int32_t> prompt;
  std::optional<PrefixCache::Session> session;
  std::span<const int32_t> remaining;  // the session's: prompt tokens to evaluate
  size_t fed = 0;                      // of them, evaluated so far
  int32_t next = 0;                    // the token the next decode step feeds
  Clock::time_point admitted;          // when it took its slot
  RequestResult result;
  bool prefilling() const { return fed < remaining.size(); }
};

class Scheduler {
 public:
  Scheduler(const Workload& workload, const Model& model, const ParallelOptions& options)
      : workload_(workload),
        model_(model),
        options_(options),
        caches_(model.make_caches({.paged = true, .block_tokens = options.block_tokens})),
        layers_(cache_pointers(caches_)),
        prefix_(layers_, {.max_paged_out_bytes = options.max_paged_out_bytes,
                          .slots = static_cast<SeqId>(options.parallel)}),
        slots_(static_cast<size_t>(options.parallel)),
        held_(static_cast<size_t>(options.parallel)),
        results_(workload.requests.size()),
        prompts_(workload.requests.size()) {
    for (size_t i = 0; i < workload.requests.size(); ++i) {
      const Request& request = workload.requests[i];
      if (request.kind == Request::Kind::fresh) {
        ready_.insert(i);
      } else {
        followers_.emplace(request.reference, i);
      }
    }
    for (Cache* layer : layers_) {
      if (auto* paged = dynamic_cast<PagedKVCache*>(layer)) paged_.push_back(paged);
    }
    const ModelConfig& c = model.config();
    token_bytes_ = static_cast<int64_t>(paged_.size()) * c.kv_heads * c.head_dim * 2 *
                   static_cast<int64_t>(sizeof(float));
  }

  ParallelRun run() {
    if (!options_.cache_dir.empty()) {
      load_saved_cache(prefix_, options_.cache_dir, options_.model_id, options_.shared_cache_dir,
                       out_.run);
    }
    start_ = Clock::now();
    while (done_ < workload_.requests.size()) {
      admit();
      if (!step()) {
        throw Error(
            "replay --parallel: no request can run (a request follows one that never "
            "finishes)");
      }
    }
    out_.run.seconds = since(start_);
    measure_ideals(prompts_, results_);
    out_.run.with_cache = true;
    out_.run.requests = std::move(results_);
    out_.run.paged_out_bytes = prefix_.paged_out_bytes();
    out_.run.evicted_nodes = prefix_.stats().evicted_nodes;
    out_.run.trie_nodes = prefix_.node_count();
    out_.parallel = options_.parallel;
    return std::move(out_);
  }

  // Saves the prefix cache (RunResult::save_cache).
  void save(const std::string& dir, const std::string& model_id, const SaveOptions& options) const {
    prefix_.save(dir, model_id, options);
  }

 private:
  // When request `i` may start (the request it follows has finished), if it may.
  std::optional<Clock::time_point> arrival(size_t i) const {
    const Request& request = workload_.requests[i];
    if (request.kind == Request::Kind::fresh) return start_;
    const auto it = finished_.find(request.reference);
    if (it == finished_.end()) return std::nullopt;
    return it->second;
  }

  // The requests that may start, in the workload's order, while a slot is free: each step looks
  // only at those (not at every request of the workload), and builds each one's prompt once.
  void admit() {
    for (auto it = ready_.begin(); it != ready_.end();) {
      const auto free =
          std::find_if(slots_.begin(), slots_.end(), [](const auto& s) { return !s.has_value(); });
      if (free == slots_.end()) return;
      const size_t i = *it++;
      if (try_admit(i, *arrival(i))) ready_.erase(i);
    }
  }

  // Request `i`'s prompt and its message ends, built once (the requests it follows have
  // finished: it no longer changes).
  struct Built {
    std::vector<int32_t> prompt;
    std::vector<int64_t> boundaries;
  };
  Built& built(size_t i) {
    auto it = built_.find(i);
    if (it == built_.end()) {
      Built b;
      b.prompt = builder_.prompt(workload_.requests[i], &b.boundaries);
      it = built_.emplace(i, std::move(b)).first;
    }
    return it->second;
  }

  // Starts request `i` on the free slot whose state it shares most with; false when it should
  // wait for a prefilling sequence that will hold more of its prompt.
  bool try_admit(size_t i, Clock::time_point arrived) {
    const Request& request = workload_.requests[i];
    const std::vector<int32_t>& prompt = built(i).prompt;
    check_prompt_fits(workload_, request, static_cast<int64_t>(prompt.size()),
                      model_.config().context_length);
    SeqId best = -1;
    int64_t reuse = -1;
    for (size_t s = 0; s < slots_.size(); ++s) {
      if (slots_[s]) continue;
      const int64_t m = prefix_.match(static_cast<SeqId>(s), prompt);
      if (m > reuse) reuse = m, best = static_cast<SeqId>(s);
    }
    for (const auto& other : slots_) {
      if (other && other->prefilling() && restorable(prompt, other->prompt) > reuse) return false;
    }
    Running& r = slots_[static_cast<size_t>(best)].emplace();
    r.index = i;
    r.admitted = Clock::now();
    r.result.waited_seconds = std::chrono::duration<double>(r.admitted - arrived).count();
    Built taken = std::move(built(i));
    built_.erase(i);
    r.prompt = std::move(taken.prompt);
    r.session.emplace(prefix_.begin(best, r.prompt));
    const RestorePoints points = restore_points(i, r, taken.boundaries);
    r.session->schedule_snapshots(points.boundaries);
    r.session->schedule_branch_points(points.lookahead);
    r.remaining = r.session->remaining();
    r.result.id = request.id;
    r.result.logits = LogitRows(tape_);
    r.result.prompt_tokens = static_cast<int64_t>(r.prompt.size());
    r.result.evaluated = static_cast<int64_t>(r.remaining.size());
    r.result.reused = r.result.prompt_tokens - r.result.evaluated;
    held_[static_cast<size_t>(best)] = r.prompt;
    // A slot is queued once: sample() takes a finished request's slot out of the queue.
    if (std::find(admission_.begin(), admission_.end(), best) != admission_.end()) {
      throw Error(fmt::format("replay --parallel: internal error: slot {} queued twice", best));
    }
    admission_.push_back(best);
    return true;
  }

  // The message ends past what the session restored (user nodes), and where the prompts of
  // requests waiting to start leave this one (the first kLookahead of them: each costs building
  // its prompt, so every one looked at counts, sharing or not): a request sharing more of this
  // prompt than the cache holds waits for this prefill, then restores exactly there. Those are
  // guesses, ordinary nodes: evicted and merged like any other, not kept as user nodes.
  struct RestorePoints {
    std::vector<int64_t> boundaries, lookahead;
  };
  RestorePoints restore_points(size_t admitted, const Running& r,
                               const std::vector<int64_t>& boundaries) {
    constexpr size_t kLookahead = 16;
    const int64_t cached = r.session->cached(), length = static_cast<int64_t>(r.prompt.size());
    RestorePoints points;
    for (int64_t b : boundaries) {
      if (b >= cached && b <= length) points.boundaries.push_back(b);
    }
    std::set<int64_t> lookahead;
    size_t looked = 0;
    for (auto it = ready_.begin(); it != ready_.end() && looked < kLookahead; ++it) {
      const size_t j = *it;
      if (j == admitted) continue;  // the one request of ready_ admitted (admit() erases it after)
      ++looked;
      const int64_t shared = restorable(built(j).prompt, r.prompt);
      if (shared > cached && shared < length) lookahead.insert(shared);
    }
    points.lookahead.assign(lookahead.begin(), lookahead.end());
    return points;
  }

  // One forward over every running sequence; false when none runs.
  bool step() {
    std::vector<Model::Chunk> chunks;
    std::vector<bool> prefill;
    for (size_t s = 0; s < slots_.size(); ++s) {
      Running* r = slots_[s] ? &*slots_[s] : nullptr;
      if (r == nullptr || r->prefilling()) continue;
      chunks.push_back({static_cast<int32_t>(s), std::span<const int32_t>(&r->next, 1)});
      prefill.push_back(false);
    }
    int64_t budget = options_.prefill_chunk;
    std::erase_if(admission_, [&](SeqId s) {
      return !slots_[static_cast<size_t>(s)] || !slots_[static_cast<size_t>(s)]->prefilling();
    });
    for (SeqId s : admission_) {
      if (budget == 0) break;
      Running& r = *slots_[static_cast<size_t>(s)];
      const auto n = std::min<int64_t>(budget, static_cast<int64_t>(r.remaining.size() - r.fed));
      chunks.push_back({s, r.remaining.subspan(r.fed, static_cast<size_t>(n))});
      prefill.push_back(true);
      budget -= n;
    }
    if (chunks.empty()) return false;
    const Array logits = model_.forward(chunks, layers_);
    // A prefill that ends here has its first token's logits now, as the sequential run times
    // it: not after the other rows' sampling, closing and recording below.
    const Clock::time_point logits_ready = Clock::now();
    ++out_.steps;
    if (!prefill.front() && prefill.back()) ++out_.fused_steps;  // decode rows come first
    const int64_t vocab = model_.config().vocab_size;
    for (size_t k = 0; k < chunks.size(); ++k) {
      Running& r = *slots_[static_cast<size_t>(chunks[k].seq)];
      if (prefill[k]) {
        r.fed += chunks[k].tokens.size();
        if (r.prefilling()) continue;
        r.result.ttft_seconds = std::chrono::duration<double>(logits_ready - r.admitted).count();
        r.session->prefill_done();
      }
      sample(chunks[k].seq, r, logits.data<float>() + static_cast<int64_t>(k) * vocab, vocab);
    }
    measure_memory();
    return true;
  }

  // Greedy decoding of one token from `row`; finishes the request at its end.
  void sample(SeqId slot, Running& r, const float* row, int64_t vocab) {
    r.result.logits.push_back({row, static_cast<size_t>(vocab)});
    const int32_t token = argmax(row, vocab);
    r.result.reply.push_back(token);
    r.session->append_output(token);
    held_[static_cast<size_t>(slot)].push_back(token);
    ++out_.reply_tokens;
    const Request& request = workload_.requests[r.index];
    if (token != kEnd && static_cast<int64_t>(r.result.reply.size()) < request.max_tokens) {
      r.next = token;
      return;
    }
    r.session->close();
    builder_.record(request, r.prompt, r.result.reply);
    finished_[request.id] = Clock::now();
    const auto [first, last] = followers_.equal_range(request.id);
    for (auto it = first; it != last; ++it) ready_.insert(it->second);
    prompts_[r.index] = std::move(r.prompt);
    results_[r.index] = std::move(r.result);
    slots_[static_cast<size_t>(slot)].reset();
    // Out of the prefill queue now (a request that ends in its prefill's step is still there):
    // the next request admitted to this slot is queued afresh.
    std::erase(admission_, slot);
    options_.progress(++done_, workload_.requests.size());
  }

  void measure_memory() {
    int64_t live = 0, in_use = 0;
    for (const PagedKVCache* paged : paged_) {
      const PagedKVCache::PoolStats stats = paged->pool_stats();
      live += stats.live_bytes;
      in_use += stats.bytes_in_use;
    }
    out_.kv.pool_bytes = std::max(out_.kv.pool_bytes, in_use);
    if (live <= out_.kv.peak_bytes || paged_.empty()) return;
    std::vector<std::span<const int32_t>> held;
    int64_t tokens = 0;
    for (size_t s = 0; s < held_.size(); ++s) {
      const int64_t offset = paged_.front()->offset(static_cast<SeqId>(s));
      held.push_back(std::span<const int32_t>(held_[s]).first(static_cast<size_t>(offset)));
      tokens += offset;
    }
    out_.kv = {live, tokens * token_bytes_, distinct_prefixes(std::move(held)) * token_bytes_,
               out_.kv.pool_bytes};
  }

  const Workload& workload_;
  const Model& model_;
  const ParallelOptions& options_;
  std::vector<std::unique_ptr<Cache>> caches_;
  std::vector<Cache*> layers_;
  std::vector<PagedKVCache*> paged_;
  int64_t token_bytes_ = 0;  // keys and values of one token in every paged layer
  PrefixCache prefix_;
  PromptBuilder builder_;
  std::vector<std::optional<Running>> slots_;
  std::vector<std::vector<int32_t>> held_;  // per slot: its sequence's tokens (a prefix of)
  std::vector<SeqId> admission_;            // slots in the order their requests came in
  std::map<std::string, Clock::time_point> finished_;
  std::multimap<std::string, size_t> followers_;  // by the id of the request they follow
  std::set<size_t> ready_;                        // may start, not yet admitted
  std::map<size_t, Built> built_;                 // prompts of ready requests, built once
  std::vector<RequestResult> results_;
  const std::shared_ptr<LogitsTape> tape_ = std::make_shared<LogitsTape>();  // replies' logits
  std::vector<std::vector<int32_t>> prompts_;
  size_t done_ = 0;
  Clock::time_point start_;
  ParallelRun out_;
};

}  // namespace

ParallelRun replay_parallel(const Workload& workload, const Model& model,
                            const ParallelOptions& options) {
  if (options.parallel < 1 || options.prefill_chunk < 1 || options.block_tokens < 1) {
    throw Error(fmt::format(
        "replay: --parallel {}, --prefill-chunk {} and the block size {} must all be >= 1",
        options.parallel, options.prefill_chunk, options.block_tokens));
  }
  check_vocabulary(model.config().vocab_size);
  check_context_length(workload, model.config().context_length);
  if (!options.cache_dir.empty()) check_cache_dir(options.cache_dir, options.shared_cache_dir);
  auto scheduler = std::make_shared<Scheduler>(workload, model, options);
  ParallelRun run = scheduler->run();
  if (!options.cache_dir.empty()) {
    run.run.save_cache = [scheduler, dir = options.cache_dir, id = options.model_id,
                          shared = options.shared_cache_dir] {
      scheduler->save(dir, id, {.shared = shared});
    };
  }
  return run;
}

namespace {

// Time to first token as the --parallel report counts it in both columns: from when the
// request could start (the run's start, or the end of the request it follows), so the time it
// queued for a slot — or, in the sequential run, behind the requests before it — is included.
double ttft_from_arrival(const RequestResult& r) { return r.waited_seconds + r.ttft_seconds; }

struct Totals {
  int64_t prompt_tokens = 0, evaluated = 0, ideal = 0, reply_tokens = 0;
  int64_t seen_not_evaluated = 0, restore_points = 0;  // the gap over the ideal, as replay's
  std::vector<double> ttft;
  double seconds = 0;
  double throughput() const {
    return seconds > 0 ? static_cast<double>(reply_tokens) / seconds : 0.0;
  }
};

Totals totals(const RunResult& run) {
  Totals t;
  for (const RequestResult& r : run.requests) {
    t.prompt_tokens += r.prompt_tokens;
    t.evaluated += r.evaluated;
    t.ideal += r.ideal;
    t.seen_not_evaluated += r.floor - r.ideal;
    t.restore_points += r.evaluated - r.floor;
    t.reply_tokens += static_cast<int64_t>(r.reply.size());
    t.ttft.push_back(ttft_from_arrival(r));
  }
  t.seconds = run.seconds;
  return t;
}

double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

}  // namespace

std::string format_parallel_table(const ParallelRun& parallel, const RunResult& uncached,
                                  const Comparison& c, const std::string& workload) {
  const Totals a = totals(parallel.run), b = totals(uncached);
  const auto row = [](const std::string& name, const std::string& x, const std::string& y) {
    return fmt::format("  {:<32} {:>20} {:>20}\n", name, x, y);
  };
  const auto ms = [](double seconds) { return fmt::format("{:.1f}", seconds * 1e3); };
  const auto mib = [](int64_t bytes) {
    return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
  };
  std::string out =
      fmt::format("kvsnap replay --parallel {}: {} ({} requests, {} prompt tokens)\n\n",
                  parallel.parallel, workload, parallel.run.requests.size(), a.prompt_tokens);
  out += warm_start_lines(parallel.run.loaded_nodes, parallel.run.load_evicted_nodes);
  out += row("", fmt::format("{} slots, cache", parallel.parallel), "sequential, no cache");
  out += row("tokens evaluated", std::to_string(a.evaluated), std::to_string(b.evaluated));
  out += row("ideal (never seen before)", std::to_string(a.ideal), "");
  out += row("time to first token, median ms", ms(percentile(a.ttft, 0.5)),
             ms(percentile(b.ttft, 0.5)));
  out +=
      row("time to first token, p90 ms", ms(percentile(a.ttft, 0.9)), ms(percentile(b.ttft, 0.9)));
  out += row("reply tokens per second", fmt::format("{:.1f}", a.throughput()),
             fmt::format("{:.1f}", b.throughput()));
  out += row("total time s", fmt::format("{:.2f}", a.seconds), fmt::format("{:.2f}", b.seconds));
  out += row("forward steps", std::to_string(parallel.steps), "");
  out += row("paged-out bytes", std::to_string(parallel.run.paged_out_bytes), "");
  out += row("evicted trie nodes", std::to_string(parallel.run.evicted_nodes), "");
  out +=
      "\n  time to first token counts from when a request could start (the run's start, or the "
      "end of the\n    request it follows) in both columns: the time it queued — for a slot, or "
      "behind the requests\n    before it — is included\n";
  const KVMemory& kv = parallel.kv;
  out += fmt::format(
      "\n  full-attention memory at its peak: {} in blocks the live sequences use; {} if each held "
      "its own copy\n    ({:.1f}x), the shared prefixes once and each sequence's own tokens: "
      "{} ({:.3f}x of that)\n",
      mib(kv.peak_bytes), mib(kv.unshared_bytes), ratio(kv.unshared_bytes, kv.peak_bytes),
      mib(kv.ideal_bytes), ratio(kv.peak_bytes, kv.ideal_bytes));
  out +=
      fmt::format("    the pools at their peak: {} with the blocks only the prefix cache keeps\n",
                  mib(kv.pool_bytes));
  out += ideal_gap_lines(a.evaluated, a.ideal, a.seen_not_evaluated, a.restore_points,
                         parallel.run.loaded_nodes >= 0);
  out += fmt::format("  throughput vs the sequential run without cache: {:.1f}x\n",
                     ratio(a.throughput(), b.throughput()));
  out += c.first_difference.empty()
             ? fmt::format("  runs agree: identical tokens, logits within {:.1e}\n",
                           c.max_logit_difference)
             : fmt::format("  RUNS DISAGREE: {}\n", c.first_difference);
  return out;
}

std::string format_parallel_json(const ParallelRun& parallel, const RunResult& uncached,
                                 const Comparison& c, const std::string& workload) {
  check_paired(parallel.run, uncached, "format_parallel_json");
  const Totals a = totals(parallel.run), b = totals(uncached);
  nlohmann::json requests = nlohmann::json::array();
  for (size_t i = 0; i < parallel.run.requests.size(); ++i) {
    const RequestResult& r = parallel.run.requests[i];
    requests.push_back({{"id", r.id},
                        {"prompt_tokens", r.prompt_tokens},
                        {"evaluated_cached", r.evaluated},
                        {"reused", r.reused},
                        {"evaluated_uncached", uncached.requests[i].evaluated},
                        {"ideal", r.ideal},
                        {"ttft_ms_cached", ttft_from_arrival(r) * 1e3},
                        {"ttft_ms_uncached", ttft_from_arrival(uncached.requests[i]) * 1e3},
                        {"reply_tokens", r.reply.size()}});
  }
  const nlohmann::json json = {
      {"workload", workload},
      {"parallel", parallel.parallel},
      {"requests", parallel.run.requests.size()},
      {"prompt_tokens", a.prompt_tokens},
      {"evaluated_cached", a.evaluated},
      {"evaluated_uncached", b.evaluated},
      {"ideal", a.ideal},
      {"gap", gap_json(a.seen_not_evaluated, a.restore_points, parallel.run.loaded_nodes >= 0)},
      {"loaded_nodes", parallel.run.loaded_nodes},
      {"load_evicted_nodes", parallel.run.load_evicted_nodes},
      {"reply_tokens", a.reply_tokens},
      {"throughput_tokens_per_s", a.throughput()},
      {"throughput_tokens_per_s_uncached", b.throughput()},
      {"ttft_counts_from", "when the request could start"},
      {"ttft_ms",
       {{"cached",
         {{"median", percentile(a.ttft, 0.5) * 1e3}, {"p90", percentile(a.ttft, 0.9) * 1e3}}},
        {"uncached",
         {{"median", percentile(b.ttft, 0.5) * 1e3}, {"p90", percentile(b.ttft, 0.9) * 1e3}}}}},
      {"seconds", {{"cached", a.seconds}, {"uncached", b.seconds}}},
      {"steps", parallel.steps},
      {"fused_steps", parallel.fused_steps},
      {"peak_kv_bytes", parallel.kv.peak_bytes},
      {"unshared_kv_bytes", parallel.kv.unshared_bytes},
      {"ideal_kv_bytes", parallel.kv.ideal_bytes},
      {"pool_kv_bytes", parallel.kv.pool_bytes},
      {"paged_out_bytes", parallel.run.paged_out_bytes},
      {"evicted_nodes", parallel.run.evicted_nodes},
      {"trie_nodes", parallel.run.trie_nodes},
      {"agree", c.first_difference.empty()},
      {"max_logit_difference", c.max_logit_difference},
      {"per_request", requests}};
  return json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace kvsnap::tools
