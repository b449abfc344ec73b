// `kvsnap bench`: the figures of serving — the prefix trie, the built-in model, the prefix
// cache's own cost per request, the end-to-end replay, and many sequences at once.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <limits>
#include <random>

#include "figure_parts.h"
#include "model/model.h"
#include "parallel.h"
#include "replay.h"
#include "workload.h"

namespace kvsnap::bench {

// Needs model_figures' prefill rate in `out` (begin's cost against recomputing what it matched).
void trie_figures(std::vector<Figure>& out) {
  // 10k sessions on a random tree of 100-token edges: ~1M cached tokens (stateless layers, so
  // this is the trie alone).
  PrefixCache cache({nullptr});
  std::mt19937 rng(1);
  std::vector<std::vector<int32_t>> paths{{}};
  int32_t next = 1;
  for (int64_t i = 0; i < sized(10000); ++i) {
    std::vector<int32_t> prompt = paths[rng() % paths.size()];
    for (int t = 0; t < 100; ++t) prompt.push_back(next++);
    auto session = cache.begin(prompt);
    session.prefill_done();
    session.close();
    paths.push_back(std::move(prompt));
  }
  int64_t matched = 0;
  double seconds = 0;
  int lookups = 0;
  for (int64_t i = 0; i < sized(2000); ++i) {
    std::vector<int32_t> prompt = paths[1 + rng() % (paths.size() - 1)];
    prompt.push_back(next++);
    const auto start = Clock::now();
    auto session = cache.begin(prompt);
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
    matched += session.cached();
    ++lookups;
  }
  const double ns = seconds * 1e9 / lookups;
  const int64_t average = matched / lookups;
  // Recomputing the matched tokens instead: the built-in model's prefill rate (2048 tokens).
  double recompute_ns = 0;
  for (const Figure& f : out) {
    if (f.group == "built-in model prefill" && f.value > 0) {
      recompute_ns = static_cast<double>(average) / f.value * 1e9;
    }
  }
  out.push_back({"prefix trie", fmt::format("begin, {} nodes", cache.node_count()), ns / 1e3, "us",
                 recompute_ns > 0 ? ns / recompute_ns : 0,
                 "x recomputing the matched tokens (built-in model)", "", true,
                 fmt::format("avg match {} tokens", average)});
  // The limit of a walk: comparing as many tokens, a prompt against a copy of it (std::equal).
  const std::vector<int32_t> prompt(static_cast<size_t>(std::max<int64_t>(average, 1)), 7);
  const std::vector<int32_t> copy = prompt;
  const double equal_ns = time_ns([&] {
    keep(prompt.data());  // both escape: the comparison cannot be hoisted out of the loop
    keep(copy.data());
    keep(std::equal(prompt.begin(), prompt.end(), copy.begin()));
  });
  const double per_token = seconds * 1e9 / static_cast<double>(std::max<int64_t>(matched, 1));
  out.push_back({"prefix trie", "match throughput", static_cast<double>(matched) / seconds / 1e6,
                 "M tokens/s", per_token / (equal_ns / static_cast<double>(prompt.size())),
                 "x the time of comparing the tokens (std::equal)", "", true,
                 "begin() including the walk"});
}

namespace {

constexpr const char* kOfPeak = "x the fma peak (model flops / time)";

// `full`, or in a smoke run a model of ~20k parameters with every kind of layer.
ModelConfig sized_model(const ModelConfig& full) {
  if (!smoke()) return full;
  ModelConfig tiny;
  tiny.hidden = 16;
  tiny.mlp_hidden = 32;
  tiny.query_heads = 2;
  tiny.kv_heads = 1;
  tiny.head_dim = 8;
  tiny.window = 16;
  tiny.delta_key_heads = 1;
  tiny.delta_value_heads = 1;
  tiny.delta_head_dim = 8;
  return tiny;
}

// `workload`, or in a smoke run its first requests (those referring only to earlier ones kept),
// their messages cut to 48 bytes and their replies to 4 tokens.
tools::Workload sized_workload(tools::Workload workload) {
  if (!smoke()) return workload;
  std::vector<tools::Request> kept;
  for (tools::Request& request : workload.requests) {
    const bool known = request.kind == tools::Request::Kind::fresh ||
                       std::any_of(kept.begin(), kept.end(), [&](const tools::Request& r) {
                         return r.id == request.reference;
                       });
    if (!known || kept.size() == 6) continue;
    for (tools::Message& message : request.messages)
      message.content.resize(std::min<size_t>(message.content.size(), 48));
    request.max_tokens = std::min<int64_t>(request.max_tokens, 4);
    kept.push_back(std::move(request));
  }
  workload.requests = std::move(kept);
  return workload;
}

// The model's work in a replay (ModelConfig::forward_flops): each request's evaluated prompt
// tokens (the prompt's last ones: the rest came from the cache) as one forward, then each reply
// token but the last (whose logits end the request) as one. A prefill split into chunks
// computes the head once more per chunk: not counted.
double run_flops(const ModelConfig& config, const tools::RunResult& run) {
  double flops = 0;
  for (const tools::RequestResult& r : run.requests) {
    flops += config.forward_flops(r.prompt_tokens - r.evaluated, r.evaluated);
    for (int64_t i = 0; i + 1 < static_cast<int64_t>(r.reply.size()); ++i) {
      flops += config.forward_flops(r.prompt_tokens + i, 1);
    }
  }
  return flops;
}

}  // namespace

void model_figures(std::vector<Figure>& out) {
  const Model model{sized_model(ModelConfig{})};
  for (int64_t length : {sized(512), sized(2048)}) {
    std::vector<int32_t> prompt(static_cast<size_t>(length));
    for (int64_t i = 0; i < length; ++i)
      prompt[static_cast<size_t>(i)] = static_cast<int32_t>(i * 7 % 256);
    const double ns = time_ns(
        [&] {
          auto caches = model.make_caches();
          keep(model.forward(prompt, cache_pointers(caches)));
        },
        0.2, 2);
    const double flops = model.config().forward_flops(0, length);
    out.push_back(
        {"built-in model prefill", fmt::format("{}-token prompt", length),
         static_cast<double>(length) / (ns * 1e-9), "tokens/s",
         flops / ns / fma_peak_flops_per_ns(), kOfPeak, ">= 2000 (a few thousand)",
         static_cast<double>(length) / (ns * 1e-9) >= 2000,
         fmt::format("default size, {:.1f}M parameters, one forward: {:.1f} GFLOP/s",
                     static_cast<double>(model.config().parameter_count()) / 1e6, flops / ns)});
  }
}

// What the prefix cache itself costs a request at 8k context — begin (matching and paging the
// branch back in), prefill_done and close, the model excluded — as a share of the time to first
// token. Each measured request follows one that diverged early, so begin has to switch paths.
void prefix_overhead_figures(std::vector<Figure>& out, const BenchOptions& options) {
  options.progress("prefix cache overhead at 8k context");
  const Model model{sized_model(ModelConfig{})};
  auto caches = model.make_caches();
  const std::vector<Cache*> layers = cache_pointers(caches);
  PrefixCache prefix(layers);
  std::vector<int32_t> context(static_cast<size_t>(sized(8192, 128)));
  for (size_t i = 0; i < context.size(); ++i) context[i] = static_cast<int32_t>((i * 7 + 3) % 256);
  const auto request = [&](const std::vector<int32_t>& prompt, double* overhead, double* ttft,
                           double* whole) {
    const auto start = Clock::now();
    PrefixCache::Session session = prefix.begin(prompt);
    const auto begun = Clock::now();
    keep(model.forward(session.remaining(), layers));
    const auto first_token = Clock::now();
    session.prefill_done();
    session.close();
    const auto done = Clock::now();
    const auto seconds = [](auto a, auto b) {
      return std::chrono::duration<double>(b - a).count();
    };
    if (overhead != nullptr) *overhead = seconds(start, begun) + seconds(first_token, done);
    if (ttft != nullptr) *ttft = seconds(start, first_token);
    if (whole != nullptr) *whole = seconds(start, done);
  };
  request(context, nullptr, nullptr, nullptr);  // the 8k context, evaluated once
  std::vector<double> overheads, ttfts, shares;
  for (int32_t i = 0; i < 5; ++i) {
    std::vector<int32_t> other(context.begin(), context.begin() + 64);
    for (int32_t t = 0; t < 32; ++t) other.push_back(300 + (i * 32 + t) % 200);
    request(other, nullptr, nullptr, nullptr);  // another branch: the live caches leave it
    std::vector<int32_t> prompt = context;
    for (int32_t t = 0; t < 64; ++t) prompt.push_back((i * 64 + t) % 256);
    double overhead = 0, ttft = 0, whole = 0;
    request(prompt, &overhead, &ttft, &whole);
    overheads.push_back(overhead);
    ttfts.push_back(ttft);
    shares.push_back(overhead / whole);
  }
  const auto median = [](std::vector<double>& values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
  };
  const double overhead = median(overheads), ttft = median(ttfts), share = median(shares);
  out.push_back({"prefix cache per request", "8k context + 64 new tokens, after a branch",
                 overhead * 1e3, "ms", share, "of the request's time", "", true,
                 fmt::format("begin + page-in + prefill_done + close: {:.2f}% of the request; "
                             "TTFT {:.1f} ms (medians)",
                             100 * share, ttft * 1e3)});
}

namespace {

// A figure that fails unless two runs agree (identical tokens, logits within 1e-4): a speed-up
// of runs that disagree is no speed-up.
Figure agreement(const std::string& group, const std::string& name, const tools::Comparison& c) {
  return {group,
          name,
          c.max_logit_difference,
          "max logit diff",
          0,
          "",
          "identical tokens, logits within 1e-4",
          c.first_difference.empty(),
          c.first_difference.empty() ? "the runs agree" : c.first_difference};
}

}  // namespace

void end_to_end_figures(std::vector<Figure>& out, const BenchOptions& options) {
  const Model model{sized_model(ModelConfig{})};
  const tools::Workload workload = sized_workload(tools::embedded_workload());
  options.progress("end to end: replay with the prefix cache");
  tools::ReplayOptions with_cache;
  with_cache.with_cache = true;
  tools::ReplayOptions without_cache;
  without_cache.with_cache = false;
  const tools::RunResult cached = tools::replay(workload, model, with_cache);
  options.progress("end to end: replay without the prefix cache");
  const tools::RunResult uncached = tools::replay(workload, model, without_cache);
  const tools::Summary s = tools::summarize(cached, uncached);
  out.push_back(agreement("end to end (kvsnap replay)", "with cache vs recomputing",
                          tools::compare(cached, uncached, 1e-4)));
  out.push_back({"end to end (kvsnap replay)", "time to first token, median",
                 s.ttft_median_cached * 1e3, "ms", s.ttft_median_uncached / s.ttft_median_cached,
                 "x faster than recomputing", "", true,
                 fmt::format("without cache {:.1f} ms", s.ttft_median_uncached * 1e3)});
  out.push_back({"end to end (kvsnap replay)", "time to first token, p90", s.ttft_p90_cached * 1e3,
                 "ms", s.ttft_p90_uncached / s.ttft_p90_cached, "x faster than recomputing", "",
                 true, fmt::format("without cache {:.1f} ms", s.ttft_p90_uncached * 1e3)});
  // Every token a forward evaluated: the prompts' and each reply token but the last (whose
  // logits end the request), over the whole run's time.
  int64_t decoded = 0;
  for (const tools::RequestResult& r : uncached.requests) {
    decoded += std::max<int64_t>(static_cast<int64_t>(r.reply.size()) - 1, 0);
  }
  const double rate = static_cast<double>(s.evaluated_uncached + decoded) / s.seconds_uncached;
  const double gflops = run_flops(model.config(), uncached) / s.seconds_uncached / 1e9;
  out.push_back({"end to end (kvsnap replay)", "model throughput without cache", rate, "tokens/s",
                 gflops / fma_peak_flops_per_ns(), kOfPeak, "", true,
                 fmt::format("{} prompt and {} reply tokens evaluated: {:.1f} GFLOP/s",
                             s.evaluated_uncached, decoded, gflops)});
}

namespace {

// Eight slots against one on one model (`runs`: the eight-slot and one-slot runs, `seconds` the
// faster time of each), and how near each comes to the compute limit: model flops over its
// time, against the fma peak. Eight slots can beat one by at most how much nearer they come.
void speed_up_figures(std::vector<Figure>& out, const std::string& name, const ModelConfig& config,
                      const std::array<const tools::ParallelRun*, 2>& runs,
                      const double (&seconds)[2], int64_t reply_tokens) {
  const double peak = fma_peak_flops_per_ns();
  const double gflops[2] = {run_flops(config, runs[0]->run) / seconds[0] / 1e9,
                            run_flops(config, runs[1]->run) / seconds[1] / 1e9};
  const double ratio = seconds[1] / seconds[0];
  out.push_back(
      {"many sequences (many-users)", fmt::format("8 slots vs 1, {}", name),
       static_cast<double>(reply_tokens) / seconds[0], "tokens/s", ratio, "x one slot", ">= 2.5",
       ratio >= 2.5,
       fmt::format("one slot {:.0f} tokens/s; faster of 2 runs each; 2.5x needs 8 slots at "
                   "{:.2f}x the fma peak",
                   static_cast<double>(reply_tokens) / seconds[1], 2.5 * gflops[1] / peak)});
  for (int slots : {8, 1}) {
    const double rate = gflops[slots == 1 ? 1 : 0];
    out.push_back({"many sequences (many-users)",
                   fmt::format("compute, {} slot{}, {}", slots, slots == 1 ? "" : "s", name), rate,
                   "GFLOP/s", rate / peak, kOfPeak, "", true,
                   "model flops over the faster run's time"});
  }
}

}  // namespace

// Many sequences at once (`kvsnap replay --parallel`): the many-users workload served by eight
// slots against the same scheduler with one, on the default model (18 MB of weights, about what
// this class of machine caches) and on data/model-16m.json's config (64 MB, beyond any cache, as
// real models' weights are): the faster of two alternating runs of each. Then the eight-slot
// run's peak full-attention memory (the paged layers'; windows are per sequence) and prompt
// tokens evaluated against the ideal.
void parallel_figures(std::vector<Figure>& out, const BenchOptions& options) {
  const tools::Workload workload = sized_workload(tools::embedded_workload("many-users"));
  const std::pair<std::string, ModelConfig> models[] = {
      {"default model, 4.5M", sized_model(ModelConfig{})},
      {"data/model-16m.json", sized_model(tools::embedded_model_16m())}};
  tools::ParallelRun eight;  // the default model's, for memory and tokens
  for (const auto& [name, config] : models) {
    const Model model{config};
    // Every run is compared with the first one-slot run: a speed-up of runs that disagree is
    // no speed-up, whichever round's time counts.
    tools::ParallelRun model_eight, model_one;
    std::vector<tools::ParallelRun> others;
    double seconds[2] = {std::numeric_limits<double>::infinity(),
                         std::numeric_limits<double>::infinity()};
    int64_t reply_tokens = 0;
    for (int round = 1; round <= 2; ++round) {
      for (const int64_t slots : {int64_t{8}, int64_t{1}}) {
        options.progress(fmt::format("parallel serving, {}: {} slot{}, run {} of 2", name, slots,
                                     slots == 1 ? "" : "s", round));
        tools::ParallelOptions parallel;
        parallel.parallel = slots;
        tools::ParallelRun run = tools::replay_parallel(workload, model, parallel);
        double& best = seconds[slots == 1 ? 1 : 0];
        best = std::min(best, run.run.seconds);
        reply_tokens = run.reply_tokens;  // greedy: the same replies in every run
        if (slots == 8 && model_eight.steps == 0) {
          model_eight = std::move(run);
        } else if (slots == 1 && model_one.steps == 0) {
          model_one = std::move(run);
        } else {
          others.push_back(std::move(run));
        }
      }
    }
    tools::Comparison agree = tools::compare(model_eight.run, model_one.run, 1e-4);
    for (const tools::ParallelRun& other : others) {
      if (!agree.first_difference.empty()) break;
      const tools::Comparison next = tools::compare(other.run, model_one.run, 1e-4);
      agree.max_logit_difference = std::max(agree.max_logit_difference, next.max_logit_difference);
      agree.first_difference = next.first_difference;
    }
    others.clear();
    out.push_back(agreement("many sequences (many-users)",
                            fmt::format("agreement of every run with one slot's, {}", name),
                            agree));
    speed_up_figures(out, name, config, {&model_eight, &model_one}, seconds, reply_tokens);
    if (eight.steps == 0) eight = std::move(model_eight);  // the first model's: the default one
  }
  const double peak = static_cast<double>(eight.kv.peak_bytes);
  out.push_back({"many sequences (many-users)", "peak full-attention memory, 8 slots", peak / kMiB,
                 "MiB", peak / static_cast<double>(eight.kv.ideal_bytes), "x shared prefixes once",
                 "<= 1.1", peak <= 1.1 * eight.kv.ideal_bytes,
                 fmt::format("{:.1f} MiB if each sequence held its own copy",
                             static_cast<double>(eight.kv.unshared_bytes) / kMiB)});
  int64_t evaluated = 0, ideal = 0;
  for (const tools::RequestResult& r : eight.run.requests) {
    evaluated += r.evaluated;
    ideal += r.ideal;
  }
  const double over = static_cast<double>(evaluated) / static_cast<double>(ideal);
  out.push_back({"many sequences (many-users)", "prompt tokens evaluated, 8 slots",
                 static_cast<double>(evaluated), "tokens", over, "x the ideal", "<= 1.02",
                 over <= 1.02, fmt::format("ideal {}: tokens never seen before", ideal)});
}

}  // namespace kvsnap::bench
