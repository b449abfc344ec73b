#include "replay.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <kvsnap/prefix_cache.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "output.h"
#include "persist/files.h"

namespace kvsnap::tools {
int32_t argmax(const float* logits, int64_t n) {
  return static_cast<int32_t>(std::max_element(logits, logits + n) - logits);
}

double percentile(std::vector<double> values, double q) {
  if (!(q >= 0 && q <= 1)) throw Error(fmt::format("percentile: q = {}: need 0 <= q <= 1", q));
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = q * static_cast<double>(values.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (values[hi] - values[lo]) * (rank - static_cast<double>(lo));
}

namespace {

// The error of check_context_length and of replay's check before each request.
InputError over_context_length(const Workload& workload, const Request& request,
                               int64_t prompt_tokens, bool minimum, int64_t context_length) {
  return InputError(fmt::format(
      "{} line {}: request \"{}\": prompt of {}{} tokens + max_tokens {} = {} exceeds the "
      "model's context length of {}",
      workload.name, request.line, request.id, minimum ? "at least " : "", prompt_tokens,
      request.max_tokens, prompt_tokens + request.max_tokens, context_length));
}

}  // namespace

void check_prompt_fits(const Workload& workload, const Request& request, int64_t prompt_tokens,
                       int64_t context_length) {
  if (prompt_tokens + request.max_tokens > context_length) {
    throw over_context_length(workload, request, prompt_tokens, false, context_length);
  }
}

void check_context_length(const Workload& workload, int64_t context_length) {
  const std::vector<int64_t> lengths = minimum_prompt_lengths(workload);
  for (size_t i = 0; i < lengths.size(); ++i) {
    const Request& request = workload.requests[i];
    if (lengths[i] + request.max_tokens > context_length) {
      throw over_context_length(workload, request, lengths[i], true, context_length);
    }
  }
}

void check_cache_dir(const std::string& dir, bool shared) {
  const std::filesystem::path path(dir);
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::status(path, error);
  if (std::filesystem::exists(status) && !std::filesystem::is_directory(status)) {
    throw Error(fmt::format("cache directory {}: exists and is not a folder", dir));
  }
  if (!std::filesystem::exists(status)) {
    error = detail::make_private_folders(dir);  // 0700, whatever the umask
    if (error)
      throw Error(fmt::format("cache directory {}: cannot create it ({})", dir, error.message()));
  }
  // Another user's folder or file, or one others can write, could hold a planted cache.
  const detail::PrivacyRule rule{.call = "replay --cache-dir",
                                 .override_with = "pass --shared-cache-dir",
                                 .allow_shared = shared};
  detail::check_private_folder(dir, rule);
  const std::string saved = (path / kSavedCacheFile).string();
  if (!shared && std::filesystem::exists(saved, error)) {
    (void)detail::open_private_file(saved, rule);
  }
  // Permission bits do not tell (root, read-only mounts, ACLs): try what saving does.
  const std::string probe = (path / fmt::format(".kvsnap-probe-{}", ::getpid())).string();
  const auto create = [&] {
    return ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  };
  int descriptor = create();
  if (descriptor < 0 && errno == EEXIST && ::unlink(probe.c_str()) == 0) {
    descriptor = create();  // a probe left by a process of the same pid, killed mid-check
  }
  if (descriptor < 0) {
    throw Error(
        fmt::format("cache directory {}: cannot write in it ({})", dir, std::strerror(errno)));
  }
  (void)::fchmod(descriptor, 0600);
  ::close(descriptor);
  ::unlink(probe.c_str());
}

namespace {

// Serves one request: through a prefix cache session when `prefix` is given (message ends as
// restore points), else from empty caches; greedy decoding of the reply.
void run_request(const Request& request, const std::vector<int32_t>& prompt,
                 const std::vector<int64_t>& boundaries, const Model& model,
                 const std::vector<Cache*>& layers, PrefixCache* prefix, RequestResult& result) {
  const int64_t vocab = model.config().vocab_size;
  const auto request_start = Clock::now();
  std::optional<PrefixCache::Session> session;
  std::span<const int32_t> remaining = prompt;
  if (prefix != nullptr) {
    session.emplace(prefix->begin(prompt));
    std::vector<int64_t> restore_points;
    for (int64_t b : boundaries) {
      if (b >= session->cached() && b <= result.prompt_tokens) restore_points.push_back(b);
    }
    session->schedule_snapshots(restore_points);
    remaining = session->remaining();
  } else {
    for (Cache* layer : layers) layer->reset();
  }
  result.evaluated = static_cast<int64_t>(remaining.size());
  result.reused = result.prompt_tokens - result.evaluated;
  Array logits = model.forward(remaining, layers);
  result.ttft_seconds = since(request_start);
  if (session) session->prefill_done();
  for (int64_t step = 0; step < request.max_tokens; ++step) {
    const float* row = logits.data<float>();
    result.logits.push_back({row, static_cast<size_t>(vocab)});
    const int32_t token = argmax(row, vocab);
    result.reply.push_back(token);
    if (session) session->append_output(token);
    if (token == kEnd || step + 1 == request.max_tokens) break;
    logits = model.forward(std::span<const int32_t>(&token, 1), layers);
  }
  if (session) session->close();
}

}  // namespace

namespace {

// What a run with the cache keeps alive for RunResult::save_cache: the layers' caches (the
// trie's lazy snapshots are read from them), the tier and the prefix cache over them.
struct CachedState {
  std::vector<std::unique_ptr<Cache>> caches;
  std::shared_ptr<Tier> tier;
  std::unique_ptr<PrefixCache> prefix;
};

// Every request in workload order, through `prefix` when given; fills run.requests (with
// their ideals) and run.seconds.
void run_requests(const Workload& workload, const Model& model, const std::vector<Cache*>& layers,
                  PrefixCache* prefix, const ReplayOptions& options, RunResult& run) {
  PromptBuilder builder;
  const auto tape = std::make_shared<LogitsTape>();  // the run's reply logits, on disk
  std::vector<std::vector<int32_t>> prompts;
  std::map<std::string, double> finished;  // by id: seconds into the run
  const auto start = Clock::now();
  const auto now = [&] { return since(start); };
  for (size_t index = 0; index < workload.requests.size(); ++index) {
    const Request& request = workload.requests[index];
    const double could_start =
        request.kind == Request::Kind::fresh ? 0.0 : finished.at(request.reference);
    std::vector<int64_t> boundaries;
    const std::vector<int32_t> prompt = builder.prompt(request, &boundaries);
    const auto prompt_tokens = static_cast<int64_t>(prompt.size());
    check_prompt_fits(workload, request, prompt_tokens, model.config().context_length);
    RequestResult result;
    result.id = request.id;
    result.logits = LogitRows(tape);
    result.prompt_tokens = prompt_tokens;
    result.waited_seconds = now() - could_start;
    run_request(request, prompt, boundaries, model, layers, prefix, result);
    finished[request.id] = now();
    builder.record(request, prompt, result.reply);
    prompts.push_back(prompt);
    run.requests.push_back(std::move(result));
    options.progress(index + 1, workload.requests.size());
  }
  run.seconds = since(start);
  measure_ideals(prompts, run.requests);
}

}  // namespace

void load_saved_cache(PrefixCache& prefix, const std::string& dir, const std::string& model_id,
                      bool shared, RunResult& run) {
  const int64_t evicted_before = prefix.stats().evicted_nodes;
  try {
    const LoadOptions load_options{.allow_shared = shared};
    if (!PrefixCache::saved_in(dir, load_options)) return;
    prefix.load(dir, model_id, load_options);
  } catch (const Error& e) {
    throw InputError(e.what());  // another model's, damaged or refused: the input is at fault
  }
  run.loaded_nodes = prefix.stats().loaded_nodes;
  run.load_evicted_nodes = prefix.stats().evicted_nodes - evicted_before;
}

RunResult replay(const Workload& workload, const Model& model, const ReplayOptions& options) {
  check_vocabulary(model.config().vocab_size);
  check_context_length(workload, model.config().context_length);
  const bool saved = options.with_cache && !options.cache_dir.empty();
  if (saved) check_cache_dir(options.cache_dir, options.shared_cache_dir);
  RunResult run;
  run.with_cache = options.with_cache;
  auto state = std::make_shared<CachedState>();
  state->caches = model.make_caches();
  const std::vector<Cache*> layers = cache_pointers(state->caches);
  if (options.with_cache && !options.tier.empty()) {
    state->tier = Tier::open(options.tier, layers, options.tier_options);
  }
  state->prefix = std::make_unique<PrefixCache>(
      layers, PrefixCache::Options{.max_paged_out_bytes = options.max_paged_out_bytes,
                                   .tier = state->tier});
  PrefixCache& prefix = *state->prefix;
  if (saved) {
    load_saved_cache(prefix, options.cache_dir, options.model_id, options.shared_cache_dir, run);
  }
  run_requests(workload, model, layers, options.with_cache ? &prefix : nullptr, options, run);
  run.paged_out_bytes = prefix.paged_out_bytes();
  run.evicted_nodes = prefix.stats().evicted_nodes;
  run.trie_nodes = prefix.node_count();
  if (state->tier != nullptr) {
    (void)state->tier->flush(std::chrono::seconds(10));  // what the next process will find
    run.with_tier = true;
    run.tier = state->tier->stats();
  }
  if (saved) {
    run.save_cache = [state, options] {
      state->prefix->save(options.cache_dir, options.model_id, {options.shared_cache_dir});
    };
  }
  return run;
}

Comparison compare(const RunResult& cached, const RunResult& uncached, double tolerance) {
  Comparison c;
  if (cached.requests.size() != uncached.requests.size()) {
    c.same_tokens = false;
    c.first_difference =
        fmt::format("{} requests against {}", cached.requests.size(), uncached.requests.size());
  }
  for (size_t i = 0; i < cached.requests.size() && i < uncached.requests.size(); ++i) {
    const RequestResult& a = cached.requests[i];
    const RequestResult& b = uncached.requests[i];
    const auto differ = [&](const std::string& what) {
      if (c.first_difference.empty()) c.first_difference = fmt::format("request {} ", i + 1) + what;
    };
    if (a.id != b.id) {
      c.same_tokens = false;
      differ(fmt::format("is {} in one run and {} in the other", a.id, b.id));
    }
    if (a.reply != b.reply) {
      c.same_tokens = false;
      differ(fmt::format("({}): the replies differ", a.id));
    }
    // A row of logits for every reply token, as wide in both runs: a run that kept fewer (or
    // none) is not checked, so it does not agree.
    if (a.logits.size() != a.reply.size() || b.logits.size() != b.reply.size() ||
        a.logits.width() != b.logits.width()) {
      differ(fmt::format(
          "({}): {} and {} logits rows of {} and {} values for replies of {} and {} tokens", a.id,
          a.logits.size(), b.logits.size(), a.logits.width(), b.logits.width(), a.reply.size(),
          b.reply.size()));
    }
    std::vector<float> row_a, row_b;  // one row of each at a time, read back from the tapes
    for (size_t t = 0; t < a.logits.size() && t < b.logits.size(); ++t) {
      a.logits.read(t, row_a);
      b.logits.read(t, row_b);
      for (size_t k = 0; k < row_a.size() && k < row_b.size(); ++k) {
        const double diff = std::fabs(row_a[k] - row_b[k]) /
                            std::max(1.0, std::fabs(static_cast<double>(row_b[k])));
        // A NaN on either side is kept as the difference (std::max would drop it).
        if (std::isnan(diff) || diff > c.max_logit_difference) c.max_logit_difference = diff;
      }
    }
  }
  if (c.first_difference.empty() && !(c.max_logit_difference <= tolerance)) {
    c.first_difference = fmt::format("logits differ by {:.2g} (tolerance {:.0e})",
                                     c.max_logit_difference, tolerance);
  }
  return c;
}

Summary summarize(const RunResult& cached, const RunResult& uncached) {
  Summary s;
  std::vector<double> ttft_cached, ttft_uncached;
  for (const RequestResult& r : cached.requests) {
    ++s.requests;
    s.prompt_tokens += r.prompt_tokens;
    s.evaluated_cached += r.evaluated;
    s.ideal += r.ideal;
    s.gap_seen_not_evaluated += r.floor - r.ideal;
    s.gap_restore_points += r.evaluated - r.floor;
    ttft_cached.push_back(r.ttft_seconds);
  }
  for (const RequestResult& r : uncached.requests) {
    s.evaluated_uncached += r.evaluated;
    ttft_uncached.push_back(r.ttft_seconds);
  }
  s.ttft_median_cached = percentile(ttft_cached, 0.5);
  s.ttft_p90_cached = percentile(ttft_cached, 0.9);
  s.ttft_median_uncached = percentile(ttft_uncached, 0.5);
  s.ttft_p90_uncached = percentile(ttft_uncached, 0.9);
  s.paged_out_bytes = cached.paged_out_bytes;
  s.evicted_nodes = cached.evicted_nodes;
  s.trie_nodes = cached.trie_nodes;
  s.loaded_nodes = cached.loaded_nodes;
  s.load_evicted_nodes = cached.load_evicted_nodes;
  s.seconds_cached = cached.seconds;
  s.seconds_uncached = uncached.seconds;
  s.with_tier = cached.with_tier;
  s.tier = cached.tier;
  return s;
}

namespace {

// The shared tier's rows of the table.
std::string tier_rows(const TierStats& t) {
  const auto row = [](const std::string& name, const std::string& value) {
    return fmt::format("  {:<30} {:>14}\n", name, value);
  };
  std::string out = row("tier hits / lookups", fmt::format("{} / {}", t.hits, t.lookups));
  out += row("tokens restored from the tier", std::to_string(t.restored_tokens));
  out += row("tier bytes read", std::to_string(t.bytes_read));
  out += row("tier bytes written", std::to_string(t.bytes_written));
  out += row("tier lookups timed out", std::to_string(t.timeouts));
  out += row("tier objects rejected", std::to_string(t.rejected));
  out += row("tier time in requests s",
             fmt::format("{:.3f}", 1e-6 * static_cast<double>(t.caller_microseconds)));
  if (t.store_errors + t.dropped_batches > 0) {
    out += row("tier errors / dropped writes",
               fmt::format("{} / {}", t.store_errors, t.dropped_batches));
  }
  return out;
}

nlohmann::json tier_json(const Summary& s) {
  if (!s.with_tier) return nullptr;
  const TierStats& t = s.tier;
  return {{"lookups", t.lookups},
          {"hits", t.hits},
          {"restored_tokens", t.restored_tokens},
          {"bytes_read", t.bytes_read},
          {"bytes_written", t.bytes_written},
          {"timeouts", t.timeouts},
          {"rejected", t.rejected},
          {"unauthenticated", t.unauthenticated},
          {"objects_written", t.objects_written},
          {"dropped_batches", t.dropped_batches},
          {"store_errors", t.store_errors},
          {"caller_seconds", 1e-6 * static_cast<double>(t.caller_microseconds)}};
}

}  // namespace

std::string warm_start_lines(int64_t loaded, int64_t load_evicted) {
  if (loaded < 0) return "";
  if (load_evicted == 0) {
    return fmt::format("  warm start: {} trie nodes loaded from the cache directory\n\n", loaded);
  }
  return fmt::format(
      "  warm start: {} trie nodes loaded from the cache directory; the budget evicted {} of "
      "them at once\n    (it is smaller than the saving run's: the cache saved at the end holds "
      "what fits)\n\n",
      loaded, load_evicted);
}

std::string ideal_gap_lines(int64_t evaluated, int64_t ideal, int64_t seen_not_evaluated,
                            int64_t restore_points, bool warm) {
  const double gap =
      ideal > 0 ? 100.0 * static_cast<double>(evaluated - ideal) / static_cast<double>(ideal) : 0.0;
  if (warm) {
    return fmt::format(
        "\n  evaluated with the cache vs ideal: {:+.2f}% (the ideal counts tokens new to this "
        "run; a warm start\n    or the tier restores even those, from the state earlier runs "
        "saved)\n",
        gap);
  }
  std::string out = fmt::format(
      "\n  evaluated with the cache vs ideal: {:+.2f}% ({} tokens over)\n", gap, evaluated - ideal);
  out += fmt::format(
      "    {} of them were sampled but never evaluated (a decoder does not feed its "
      "last token back),\n",
      seen_not_evaluated);
  out += fmt::format(
      "    {} lie between a divergence and the restore point before it (recurrent and "
      "window layers\n    resume only where a snapshot was captured: message ends, "
      "branch points).\n",
      restore_points);
  return out;
}

nlohmann::json gap_json(int64_t seen_not_evaluated, int64_t restore_points, bool warm) {
  if (warm) return nullptr;
  return {{"seen_not_evaluated", seen_not_evaluated}, {"restore_points", restore_points}};
}

bool restored_from_before(const Summary& s) {
  return s.loaded_nodes >= 0 || (s.with_tier && s.tier.hits > 0);
}

std::string format_table(const Summary& s, const Comparison& c, const std::string& workload) {
  const auto row = [](const std::string& name, const std::string& a, const std::string& b) {
    return fmt::format("  {:<30} {:>14} {:>14}\n", name, a, b);
  };
  const auto ms = [](double seconds) { return fmt::format("{:.1f}", seconds * 1e3); };
  std::string out = fmt::format("kvsnap replay: {} ({} requests, {} prompt tokens)\n\n", workload,
                                s.requests, s.prompt_tokens);
  out += warm_start_lines(s.loaded_nodes, s.load_evicted_nodes);
  out += row("", "with cache", "without cache");
  out += row("tokens evaluated", std::to_string(s.evaluated_cached),
             std::to_string(s.evaluated_uncached));
  out += row("tokens reused", std::to_string(s.prompt_tokens - s.evaluated_cached), "0");
  out += row("ideal (never seen before)", std::to_string(s.ideal), "");
  out +=
      row("time to first token, median ms", ms(s.ttft_median_cached), ms(s.ttft_median_uncached));
  out += row("time to first token, p90 ms", ms(s.ttft_p90_cached), ms(s.ttft_p90_uncached));
  out += row("total time s", fmt::format("{:.2f}", s.seconds_cached),
             fmt::format("{:.2f}", s.seconds_uncached));
  out += row("paged-out bytes", std::to_string(s.paged_out_bytes), "");
  out += row("evicted trie nodes", std::to_string(s.evicted_nodes), "");
  out += row("trie nodes", std::to_string(s.trie_nodes), "");
  if (s.with_tier) out += tier_rows(s.tier);
  out += ideal_gap_lines(s.evaluated_cached, s.ideal, s.gap_seen_not_evaluated,
                         s.gap_restore_points, restored_from_before(s));
  out +=
      fmt::format("  speed-up of time to first token (median): {:.1f}x\n",
                  s.ttft_median_cached > 0 ? s.ttft_median_uncached / s.ttft_median_cached : 0.0);
  out += c.first_difference.empty()
             ? fmt::format("  runs agree: identical tokens, logits within {:.1e}\n",
                           c.max_logit_difference)
             : fmt::format("  RUNS DISAGREE: {}\n", c.first_difference);
  return out;
}

void check_paired(const RunResult& a, const RunResult& b, const char* call) {
  if (a.requests.size() == b.requests.size()) return;
  throw Error(fmt::format("{}: runs of {} and {} requests: only runs of one workload pair up", call,
                          a.requests.size(), b.requests.size()));
}

std::string format_json(const Summary& s, const Comparison& c, const RunResult& cached,
                        const RunResult& uncached, const std::string& workload) {
  check_paired(cached, uncached, "format_json");
  nlohmann::json requests = nlohmann::json::array();
  for (size_t i = 0; i < cached.requests.size(); ++i) {
    const RequestResult& a = cached.requests[i];
    const RequestResult& b = uncached.requests[i];
    requests.push_back({{"id", a.id},
                        {"prompt_tokens", a.prompt_tokens},
                        {"evaluated_cached", a.evaluated},
                        {"reused", a.reused},
                        {"evaluated_uncached", b.evaluated},
                        {"ideal", a.ideal},
                        {"ttft_ms_cached", a.ttft_seconds * 1e3},
                        {"ttft_ms_uncached", b.ttft_seconds * 1e3},
                        {"reply_tokens", a.reply.size()}});
  }
  const nlohmann::json json = {
      {"workload", workload},
      {"requests", s.requests},
      {"prompt_tokens", s.prompt_tokens},
      {"evaluated_cached", s.evaluated_cached},
      {"evaluated_uncached", s.evaluated_uncached},
      {"ideal", s.ideal},
      {"gap", gap_json(s.gap_seen_not_evaluated, s.gap_restore_points, restored_from_before(s))},
      {"ttft_ms",
       {{"cached", {{"median", s.ttft_median_cached * 1e3}, {"p90", s.ttft_p90_cached * 1e3}}},
        {"uncached",
         {{"median", s.ttft_median_uncached * 1e3}, {"p90", s.ttft_p90_uncached * 1e3}}}}},
      {"seconds", {{"cached", s.seconds_cached}, {"uncached", s.seconds_uncached}}},
      {"paged_out_bytes", s.paged_out_bytes},
      {"evicted_nodes", s.evicted_nodes},
      {"trie_nodes", s.trie_nodes},
      {"loaded_nodes", s.loaded_nodes},
      {"load_evicted_nodes", s.load_evicted_nodes},
      {"tier", tier_json(s)},
      {"agree", c.first_difference.empty()},
      {"max_logit_difference", c.max_logit_difference},
      {"per_request", requests}};
  // Invalid UTF-8 (a workload path's bytes) is replaced, never thrown on after the runs.
  return json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string format_chart(const RunResult& cached, const RunResult& uncached) {
  check_paired(cached, uncached, "format_chart");
  const size_t n = cached.requests.size();
  const double width = 900, height = 460, left = 70, right = 20, top = 50, bottom = 100;
  const double plot_w = width - left - right, plot_h = height - top - bottom;
  int64_t most = 1;
  for (const auto& r : uncached.requests) most = std::max(most, r.evaluated);
  const double decades = std::ceil(std::log10(static_cast<double>(most) + 1));
  const auto y = [&](double tokens) {
    return top + plot_h * (1 - std::log10(std::max(tokens, 1.0)) / std::max(decades, 1.0));
  };
  const double slot = plot_w / static_cast<double>(std::max<size_t>(n, 1));
  const double bar = std::max(1.0, slot * 0.38);
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} "
      "{1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
      "fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" font-size=\"16\">Prompt tokens evaluated per request (log "
      "scale)</text>\n",
      width, height, left);
  for (int d = 0; d <= static_cast<int>(decades); ++d) {
    const double yy = y(std::pow(10.0, d));
    svg += fmt::format(
        "<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n"
        "<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n",
        left, width - right, yy, yy, left - 6, yy + 4, static_cast<int64_t>(std::pow(10.0, d)));
  }
  std::string ideal_path;
  for (size_t i = 0; i < n; ++i) {
    const double x = left + slot * static_cast<double>(i) + slot * 0.1;
    const auto a = static_cast<double>(cached.requests[i].evaluated);
    const auto b = static_cast<double>(uncached.requests[i].evaluated);
    const std::string id = xml_escape(cached.requests[i].id);  // any text a JSON string holds
    // Bars are at least 2px tall so a single evaluated token still shows.
    const auto bar_top = [&](double tokens) { return std::min(y(tokens), top + plot_h - 2); };
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
        "fill=\"#c44\"><title>{}: {} without cache</title></rect>\n",
        x, bar_top(b), bar, top + plot_h - bar_top(b), id, b);
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
        "fill=\"#3a7\"><title>{}: {} with cache</title></rect>\n",
        x + bar, bar_top(a), bar, top + plot_h - bar_top(a), id, a);
    svg += fmt::format(
        "<text transform=\"translate({:.1f},{:.1f}) rotate(-60)\" text-anchor=\"end\" "
        "font-size=\"10\">{}</text>\n",
        x + bar, top + plot_h + 12, id);
    ideal_path += fmt::format("{}{:.1f},{:.1f}", i == 0 ? "M" : " L", x + bar,
                              y(static_cast<double>(cached.requests[i].ideal)));
  }
  svg += fmt::format(
      "<path d=\"{}\" fill=\"none\" stroke=\"#225\" stroke-width=\"1.5\" stroke-dasharray=\"4 "
      "3\"/>\n",
      ideal_path);
  svg += fmt::format(
      "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">request (workload order)</text>\n",
      left + plot_w / 2, height - 8);
  const double lx = width - right - 330;
  svg += fmt::format(
      "<rect x=\"{0}\" y=\"34\" width=\"12\" height=\"12\" fill=\"#c44\"/><text x=\"{1}\" "
      "y=\"44\">without cache</text>\n"
      "<rect x=\"{2}\" y=\"34\" width=\"12\" height=\"12\" fill=\"#3a7\"/><text x=\"{3}\" "
      "y=\"44\">with cache</text>\n"
      "<line x1=\"{4}\" x2=\"{5}\" y1=\"40\" y2=\"40\" stroke=\"#225\" stroke-dasharray=\"4 "
      "3\"/><text x=\"{6}\" y=\"44\">ideal</text>\n",
      lx, lx + 16, lx + 120, lx + 136, lx + 230, lx + 255, lx + 260);
  svg += "</svg>\n";
  return svg;
}

}  // namespace kvsnap::tools
