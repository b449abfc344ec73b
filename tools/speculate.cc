#include "speculate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

namespace kvsnap::tools {

PromptLookup::PromptLookup(int64_t max_ngram, int64_t min_ngram)
    : max_ngram_(max_ngram), min_ngram_(min_ngram) {
  if (min_ngram < 1 || max_ngram < min_ngram) {
    throw Error(fmt::format("PromptLookup: n-gram lengths {}..{} must satisfy 1 <= min <= max",
                            min_ngram, max_ngram));
  }
}

void PromptLookup::draft(std::span<const int32_t> context, int64_t k,
                         std::vector<int32_t>& drafts) const {
  drafts.clear();
  const auto n = static_cast<int64_t>(context.size());
  if (k <= 0) return;
  const auto at = [&](int64_t i) { return context[static_cast<size_t>(i)]; };
  for (int64_t g = std::min(max_ngram_, n - 1); g >= min_ngram_; --g) {
    // The most recent earlier occurrence of the last g tokens: context[e - g, e), e < n.
    for (int64_t e = n - 1; e >= g; --e) {
      int64_t same = 0;
      while (same < g && at(e - 1 - same) == at(n - 1 - same)) ++same;
      if (same < g) continue;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t from = e + j;  // past the end: the drafts already made (e < n)
        drafts.push_back(from < n ? at(from) : drafts[static_cast<size_t>(from - n)]);
      }
      return;
    }
  }
}

SettledDrafts settle_drafts(std::span<const int32_t> drafts,
                            const std::function<int32_t(int64_t)>& choose,
                            const std::function<bool(int32_t)>& done) {
  const auto k = static_cast<int64_t>(drafts.size());
  SettledDrafts s;
  for (;;) {
    s.last = choose(s.kept);
    if (s.kept == k || s.last != drafts[static_cast<size_t>(s.kept)]) break;
    if (done(s.last)) {  // a right draft that ends the reply: accepted, never evaluated
      s.accepted = s.kept + 1;
      return s;
    }
    ++s.kept;
  }
  s.accepted = s.kept;
  return s;
}

SpeculativeDecoder::SpeculativeDecoder(const Model& model, std::vector<Cache*> layers,
                                       int64_t speculate, double draft_noise)
    : model_(model),
      layers_(layers),
      speculate_(speculate),
      draft_noise_(draft_noise),
      round_(std::move(layers)) {
  if (!(draft_noise >= 0 && draft_noise <= 1)) {
    throw Error(fmt::format("SpeculativeDecoder: draft_noise {} must be in [0, 1]", draft_noise));
  }
  if (speculate < 0) {
    throw Error(fmt::format("SpeculativeDecoder: speculate {} must be >= 0", speculate));
  }
}

void SpeculativeDecoder::decode(PrefixCache::Session* session, std::vector<int32_t> context,
                                Array logits, int64_t max_tokens, RequestResult& result,
                                DecodeStats& stats) {
  const int64_t vocab = model_.config().vocab_size;
  const auto start = Clock::now();
  const auto choose = [&](const float* row) {
    result.logits.push_back({row, static_cast<size_t>(vocab)});
    const int32_t token = argmax(row, vocab);
    result.reply.push_back(token);
    context.push_back(token);
    return token;
  };
  const auto done = [&](int32_t token) {
    return token == kEnd || static_cast<int64_t>(result.reply.size()) >= max_tokens;
  };
  int32_t token = choose(logits.data<float>());
  if (session != nullptr) session->append_output(token);
  std::vector<int32_t> drafts;
  while (!done(token)) {
    // Every round emits at most drafts + 1 tokens: never past max_tokens.
    const int64_t budget = max_tokens - static_cast<int64_t>(result.reply.size());
    lookup_.draft(context, std::min(speculate_, budget - 1), drafts);
    for (int32_t& d : drafts) {
      if (draft_noise_ > 0 && std::uniform_real_distribution<double>(0, 1)(noise_) < draft_noise_) {
        d = static_cast<int32_t>((d + 1) % vocab);
      }
    }
    ++stats.forwards;
    if (drafts.empty()) {
      logits = model_.forward(std::span<const int32_t>(&token, 1), layers_);
      token = choose(logits.data<float>());
      if (session != nullptr) session->append_output(token);
      continue;
    }
    const auto k = static_cast<int64_t>(drafts.size());
    verify_.assign(1, token);
    verify_.insert(verify_.end(), drafts.begin(), drafts.end());
    auto timer = Clock::now();
    round_.begin(k);
    stats.round_seconds += since(timer);
    logits = model_.forward(verify_, layers_, /*all_positions=*/true);
    // Row j predicts the token after verify_[j]: drafts hold while they equal the prediction.
    const size_t first = result.reply.size();
    const SettledDrafts settled = settle_drafts(
        drafts, [&](int64_t row) { return choose(logits.data<float>() + row * vocab); }, done);
    token = settled.last;
    timer = Clock::now();
    round_.accept(settled.kept);  // every layer holds exactly the tokens before `token`
    stats.round_seconds += since(timer);
    // The session learns the tokens once the layers hold what it will page out.
    if (session != nullptr) {
      for (size_t i = first; i < result.reply.size(); ++i) session->append_output(result.reply[i]);
    }
    ++stats.rounds;
    stats.drafted += k;
    stats.accepted += settled.accepted;
  }
  stats.tokens += static_cast<int64_t>(result.reply.size()) - 1;
  stats.seconds += since(start);
}

SpeculativeRun replay_speculative(const Workload& workload, const Model& model,
                                  const SpeculateOptions& options) {
  check_vocabulary(model.config().vocab_size);
  const int64_t context_length = model.config().context_length;
  check_context_length(workload, context_length);
  SpeculativeRun out;
  out.run.with_cache = true;
  auto caches = model.make_caches();
  const std::vector<Cache*> layers = cache_pointers(caches);
  PrefixCache prefix(layers, {.max_paged_out_bytes = options.max_paged_out_bytes});
  SpeculativeDecoder decoder(model, layers, options.speculate, options.draft_noise);
  PromptBuilder builder;
  std::vector<std::vector<int32_t>> prompts;
  const auto tape = std::make_shared<LogitsTape>();  // the run's reply logits, on disk
  const auto start = Clock::now();
  for (size_t index = 0; index < workload.requests.size(); ++index) {
    const Request& request = workload.requests[index];
    std::vector<int64_t> boundaries;
    const std::vector<int32_t> prompt = builder.prompt(request, &boundaries);
    RequestResult result;
    result.id = request.id;
    result.logits = LogitRows(tape);
    result.prompt_tokens = static_cast<int64_t>(prompt.size());
    check_prompt_fits(workload, request, result.prompt_tokens, context_length);
    const auto request_start = Clock::now();
    PrefixCache::Session session = prefix.begin(prompt);
    std::vector<int64_t> restore_points;
    for (int64_t b : boundaries) {
      if (b >= session.cached() && b <= result.prompt_tokens) restore_points.push_back(b);
    }
    session.schedule_snapshots(restore_points);
    result.evaluated = static_cast<int64_t>(session.remaining().size());
    result.reused = result.prompt_tokens - result.evaluated;
    Array logits = model.forward(session.remaining(), layers);
    result.ttft_seconds = since(request_start);
    session.prefill_done();
    decoder.decode(&session, prompt, logits, request.max_tokens, result, out.decode);
    session.close();
    builder.record(request, prompt, result.reply);
    prompts.push_back(prompt);
    out.run.requests.push_back(std::move(result));
    options.progress(index + 1, workload.requests.size());
  }
  out.run.seconds = since(start);
  measure_ideals(prompts, out.run.requests);
  out.run.paged_out_bytes = prefix.paged_out_bytes();
  out.run.evicted_nodes = prefix.stats().evicted_nodes;
  out.run.trie_nodes = prefix.node_count();
  return out;
}

namespace {

std::string speculation_table(const SpeculateReport& r, int64_t k) {
  const DecodeStats& s = r.speculative.decode;
  const DecodeStats& p = r.plain.decode;
  const double speedup =
      p.tokens_per_second() > 0 ? s.tokens_per_second() / p.tokens_per_second() : 0.0;
  std::string out = fmt::format(
      "\n  speculation: prompt-lookup drafts of up to {} tokens, verified in one forward\n", k);
  out += fmt::format("    acceptance rate                {:.3f} ({} of {} drafts, {} rounds)\n",
                     s.acceptance_rate(), s.accepted, s.drafted, s.rounds);
  out +=
      fmt::format("    decode tokens/s                {:.1f} speculative, {:.1f} plain ({:.2f}x)\n",
                  s.tokens_per_second(), p.tokens_per_second(), speedup);
  out += fmt::format("    decode forwards                {} speculative, {} plain ({} tokens)\n",
                     s.forwards, p.forwards, s.tokens);
  out += fmt::format("    capture + rollback share       {:.3f}% of decode time\n",
                     s.seconds > 0 ? 100.0 * s.round_seconds / s.seconds : 0.0);
  const Comparison& c = r.plain_comparison;
  out += c.first_difference.empty()
             ? fmt::format(
                   "    plain decoding with the cache  agrees too: identical tokens, "
                   "logits within {:.1e}\n",
                   c.max_logit_difference)
             : fmt::format("    PLAIN DECODING WITH THE CACHE DISAGREES: {}\n", c.first_difference);
  return out;
}

}  // namespace

SpeculateReport speculate_report(const Workload& workload, const Model& model,
                                 const SpeculateOptions& options,
                                 const std::function<void(size_t, size_t)>& uncached_progress,
                                 const std::function<void(size_t, size_t)>& plain_progress) {
  SpeculateReport r;
  r.speculative = replay_speculative(workload, model, options);
  SpeculateOptions plain = options;
  plain.speculate = 0;
  plain.progress = plain_progress;
  r.plain = replay_speculative(workload, model, plain);
  ReplayOptions reference;
  reference.with_cache = false;
  reference.progress = uncached_progress;
  r.uncached = replay(workload, model, reference);
  finish_report(r, workload.name, options);
  return r;
}

void finish_report(SpeculateReport& r, const std::string& workload,
                   const SpeculateOptions& options) {
  r.comparison = compare(r.speculative.run, r.uncached, 1e-4);
  r.plain_comparison = compare(r.plain.run, r.uncached, 1e-4);
  const Summary summary = summarize(r.speculative.run, r.uncached);
  r.table = format_table(summary, r.comparison, workload) + speculation_table(r, options.speculate);
  nlohmann::json json = nlohmann::json::parse(
      format_json(summary, r.comparison, r.speculative.run, r.uncached, workload));
  const DecodeStats& s = r.speculative.decode;
  json["agree"] = r.agree();
  json["plain_agree"] = r.plain_comparison.first_difference.empty();
  json["plain_max_logit_difference"] = r.plain_comparison.max_logit_difference;
  json["speculate"] = options.speculate;
  json["draft_noise"] = options.draft_noise;
  json["acceptance_rate"] = s.acceptance_rate();
  json["decode_tokens_per_s"] = s.tokens_per_second();
  json["decode_tokens_per_s_plain"] = r.plain.decode.tokens_per_second();
  json["rollback_share"] = s.seconds > 0 ? s.round_seconds / s.seconds : 0.0;
  json["speculation"] = {{"rounds", s.rounds},
                         {"drafted", s.drafted},
                         {"accepted", s.accepted},
                         {"decode_tokens", s.tokens},
                         {"decode_forwards", s.forwards},
                         {"decode_forwards_plain", r.plain.decode.forwards},
                         {"decode_seconds", s.seconds},
                         {"decode_seconds_plain", r.plain.decode.seconds}};
  r.json = json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace kvsnap::tools
