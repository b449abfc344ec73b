// kvsnap — the command line: `kvsnap replay` runs a multi-turn workload through the built-in
// hybrid model with the prefix cache and without, and reports what the cache saved.
#include <cblas.h>
#include <fmt/format.h>
#include <kvsnap/kvsnap.h>
#include <malloc.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <limits>
#include <new>
#include <optional>
#include <utility>

#include "figures.h"
#include "model/model.h"
#include "output.h"
#include "parallel.h"
#include "replay.h"
#include "speculate.h"
#include "workload.h"

namespace {

using namespace kvsnap;

// A line for the person watching, on stderr, best-effort: a stderr that cannot be written
// (2>/dev/full, a closed terminal) must not end the run (fmt::print throws there).
template <class... Args>
void note(fmt::format_string<Args...> format, Args&&... args) {
  const std::string text = fmt::format(format, std::forward<Args>(args)...);
  (void)std::fwrite(text.data(), 1, text.size(), stderr);
}

// Whether a progress bar's line on the terminal is left open (not yet ended by its last
// redraw): a message written then starts on a line of its own (end_progress_line).
std::atomic<bool> progress_line_open{false};

void end_progress_line() {
  if (progress_line_open.exchange(false)) note("\n");
}

// A progress bar on stderr: redrawn in place on a terminal, a line per quarter otherwise.
class Progress {
 public:
  Progress(std::string label, bool enabled)
      : label_(std::move(label)), enabled_(enabled), tty_(isatty(2) != 0) {}
  void operator()(size_t done, size_t total) {
    if (!enabled_) return;
    const size_t width = 30, filled = total == 0 ? width : done * width / total;
    if (tty_) {
      note("\r{:<22} [{}{}] {}/{}", label_, std::string(filled, '#'),
           std::string(width - filled, '.'), done, total);
      progress_line_open = true;
      if (done == total) end_progress_line();
    } else if (done == total || done * 4 / total != (done - 1) * 4 / total) {
      note("{}: {}/{} requests\n", label_, done, total);
    }
  }

 private:
  std::string label_;
  bool enabled_, tty_;
};

struct ReplayArguments {
  std::string workload;
  std::string embedded = "default";
  int64_t parallel = 0;  // 0: the sequential replay
  int64_t prefill_chunk = 512;
  int64_t block_tokens = 32;
  bool json = false;
  bool quiet = false;
  std::string chart = "replay.svg";
  int64_t budget = int64_t(8) << 30;
  std::string model_config, weights;
  std::string cache_dir;
  bool shared_cache_dir = false;
  std::optional<uint64_t> seed;  // of the generated weights: else the config's, else 42
  int threads = 1;
  std::string tier, tenant, tier_key_file;
  int64_t tier_timeout_ms = 50;
  // Drafts per round of greedy decoding with speculation; 0: plain greedy decoding.
  int64_t speculate = 0;
  double draft_noise = 0;
};

// A whole number in [lo, hi], in decimal digits only, rewritten without leading zeros: CLI11
// reads "010" as octal 8 and "0x10" as 16, converts "-1" to 2^64 - 1, and saturates a number past
// its type's range, all silently.
CLI::Validator whole_number(uint64_t lo, uint64_t hi) {
  return {[lo, hi](std::string& value) -> std::string {
            const bool digits =
                !value.empty() && value.find_first_not_of("0123456789") == std::string::npos;
            errno = 0;
            const uint64_t number = digits ? std::strtoull(value.c_str(), nullptr, 10) : 0;
            if (!digits || errno == ERANGE || number < lo || number > hi) {
              return fmt::format("{} is not a whole number from {} to {} (decimal digits)", value,
                                 lo, hi);
            }
            value = std::to_string(number);
            return {};
          },
          fmt::format("INT in [{} - {}]", lo, hi)};
}

// The tier's address: --tier's, or with --tier @PATH the one in PATH (a private file, like the
// key file: a Redis password stays off the command line, which other users can read).
std::string tier_address(const ReplayArguments& args) {
  if (!args.tier.starts_with('@')) return args.tier;
  return load_tier_address(args.tier.substr(1));
}

// The shared tier's options, checked before any model work: the address, the key file (like a
// private key: the user's own, no access for group or others).
TierOptions tier_options(const ReplayArguments& args, const std::string& address) {
  if (args.tier.empty()) {
    if (!args.tenant.empty() || !args.tier_key_file.empty()) {
      throw Error(fmt::format("replay: --{} needs --tier (the store it applies to)",
                              args.tenant.empty() ? "tier-key-file" : "tenant"));
    }
    return {};
  }
  if (args.parallel > 0 || args.speculate > 0) {
    throw Error(fmt::format(
        "replay: --tier works with the sequential replay only, not with --{} (its {} not "
        "stored in the tier yet)",
        args.parallel > 0 ? "parallel" : "speculate",
        args.parallel > 0 ? "slots' paged caches are" : "speculative sessions are"));
  }
  Tier::check_address(address);
  TierOptions options;
  options.tenant = args.tenant;
  if (!args.tier_key_file.empty()) options.key = load_tier_key(args.tier_key_file);
  options.lookup_timeout = std::chrono::milliseconds(args.tier_timeout_ms);
  return options;
}

// What makes state valid for a model: its config and its weights' values, whether loaded or
// generated from the seed (another standard library's normal distribution draws other ones).
std::string model_fingerprint(const Model& model) {
  return fmt::format("{} weights {}", model.config().to_json(), model.weights_digest());
}

void write_chart(const std::string& path, const tools::RunResult& cached,
                 const tools::RunResult& uncached, bool json) {
  if (path.empty()) return;
  tools::write_replacing(path, tools::format_chart(cached, uncached), "--chart");
  if (!json) std::cout << fmt::format("  chart: {}\n", path) << std::flush;
}

// After the results are printed: the chart, then the saved cache — only for runs that agree (a
// run that disagreed leaves the saved cache as it was). A failure is reported after the
// results (exit 3, or 1 for runs that disagree).
int finish(const ReplayArguments& args, int verdict, const tools::RunResult& cached,
           const tools::RunResult& uncached) {
  std::vector<std::function<void()>> steps{
      [&] { write_chart(args.chart, cached, uncached, args.json); }};
  if (cached.save_cache) {
    steps.emplace_back([&] {
      if (verdict == 0) return cached.save_cache();
      note("kvsnap: the runs disagree: the prefix cache is not saved to {}\n", args.cache_dir);
    });
  }
  return tools::finish_run(verdict, steps, std::cerr);
}

// --parallel N: the scheduler over N slots, compared with the sequential run without cache.
int run_parallel(const ReplayArguments& args, const tools::Workload& workload, const Model& model,
                 const std::string& model_id) {
  tools::ParallelOptions options;
  options.cache_dir = args.cache_dir;
  options.shared_cache_dir = args.shared_cache_dir;
  options.model_id = model_id;
  options.parallel = args.parallel;
  options.prefill_chunk = args.prefill_chunk;
  options.block_tokens = args.block_tokens;
  options.max_paged_out_bytes = args.budget;
  options.progress = Progress(fmt::format("{} slots, prefix cache", args.parallel), !args.quiet);
  tools::ReplayOptions uncached_options;
  uncached_options.with_cache = false;
  uncached_options.progress = Progress("sequential, no cache", !args.quiet);
  const tools::ParallelRun parallel = tools::replay_parallel(workload, model, options);
  const tools::RunResult uncached = tools::replay(workload, model, uncached_options);
  const tools::Comparison comparison = tools::compare(parallel.run, uncached, 1e-4);
  std::cout << (args.json
                    ? tools::format_parallel_json(parallel, uncached, comparison, workload.name)
                    : tools::format_parallel_table(parallel, uncached, comparison, workload.name));
  return finish(args, comparison.first_difference.empty() ? 0 : 1, parallel.run, uncached);
}

// The shared tier's options.
void add_tier_options(CLI::App& command, ReplayArguments& args) {
  command.add_option("--tier", args.tier,
                     "a snapshot store shared by processes, below the prefix cache: "
                     "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] or dir:PATH, or @FILE to read "
                     "it from a private file (mode 0600: a password stays off the command "
                     "line; README: the tier)");
  command.add_option("--tenant", args.tenant,
                     "with --tier: the isolation salt; processes of other tenants never see "
                     "these entries");
  command.add_option("--tier-key-file", args.tier_key_file,
                     "with --tier: a key (>= 16 bytes, mode 0600) authenticating every object; "
                     "without it the tier trusts the store");
  command
      .add_option("--tier-timeout-ms", args.tier_timeout_ms,
                  "with --tier: the most a lookup waits for the store")
      ->transform(whole_number(0, 60000))
      ->needs("--tier")
      ->capture_default_str();
}

// `runs_started` is set once everything that can be refused up front has been checked (see
// tools::failure_status).
// --chart: a path the output can replace, and none of the run's inputs (the tier's key and
// address files among them: secrets a chart would replace with a world-readable SVG), its saved
// cache or its cache directory's lock.
void check_chart(const ReplayArguments& args) {
  if (args.chart.empty()) return;
  tools::check_writable(args.chart, "--chart");
  const auto in_cache_dir = [&](const char* name) {
    return args.cache_dir.empty() ? std::string() : args.cache_dir + "/" + name;
  };
  tools::check_apart(
      args.chart, "--chart",
      {{"the workload", args.workload},
       {"the model config", args.model_config},
       {"the weights", args.weights},
       {"the tier key file", args.tier_key_file},
       {"the tier address file", args.tier.starts_with('@') ? args.tier.substr(1) : std::string()},
       {"the saved prefix cache", in_cache_dir(tools::kSavedCacheFile)},
       {"the cache directory's lock", in_cache_dir(tools::kCacheDirLockFile)}});
}

int run_replay(const ReplayArguments& args, bool& runs_started) {
  // Everything that can be refused is, before any model work: arguments, the workload, the
  // model's vocabulary, requests over the context length, the chart's path, then the cache
  // directory (last: checking may create it).
  const tools::Workload workload = args.workload.empty() ? tools::embedded_workload(args.embedded)
                                                         : tools::load_workload(args.workload);
  ModelConfig config;
  if (!args.model_config.empty()) config = ModelConfig::from_file(args.model_config);
  if (args.seed) config.seed = *args.seed;
  tools::check_vocabulary(config.vocab_size);
  tools::check_context_length(workload, config.context_length);
  const std::string address = tier_address(args);
  TierOptions tier = tier_options(args, address);
  check_chart(args);
  // Both runs' reply logits (three with --speculate) are kept on disk for the agreement check.
  tools::check_logits_room(workload, config.vocab_size, args.speculate > 0 ? 3 : 2);
  tools::CacheDirLock lock;  // held until the saved cache is written, after the runs
  if (!args.cache_dir.empty()) {
    tools::check_cache_dir(args.cache_dir, args.shared_cache_dir);
    lock = tools::lock_cache_dir(args.cache_dir, args.shared_cache_dir);
  }
  set_threads(args.threads);
  const Model model =
      args.weights.empty() ? Model(config) : Model::load(args.model_config, args.weights);
  if (!args.quiet) {
    const std::string weights = args.weights.empty()
                                    ? fmt::format("weights generated from seed {}", config.seed)
                                    : "weights " + args.weights;
    note("model: {} layers \"{}\", {:.1f}M parameters, {}; workload {}: {} requests\n",
         model.config().pattern.size(), model.config().pattern,
         static_cast<double>(model.config().parameter_count()) / 1e6, weights, workload.name,
         workload.requests.size());
  }
  // The saved trie and the tier's entries are only valid for this exact model: its config
  // (with the seed) and the weights' values (their digest), wherever they came from.
  const std::string model_id = model_fingerprint(model);
  runs_started = true;
  if (args.parallel > 0) return run_parallel(args, workload, model, model_id);
  if (args.speculate > 0) {
    const tools::SpeculateReport report = tools::speculate_report(
        workload, model,
        {.speculate = args.speculate,
         .draft_noise = args.draft_noise,
         .max_paged_out_bytes = args.budget,
         .progress = Progress("speculative, cache", !args.quiet)},
        Progress("plain, no cache", !args.quiet), Progress("plain, cache", !args.quiet));
    std::cout << (args.json ? report.json : report.table);
    return finish(args, report.agree() ? 0 : 1, report.speculative.run, report.uncached);
  }
  tools::ReplayOptions cached_options;
  cached_options.max_paged_out_bytes = args.budget;
  cached_options.cache_dir = args.cache_dir;
  cached_options.shared_cache_dir = args.shared_cache_dir;
  cached_options.model_id = model_id;
  cached_options.tier = address;
  cached_options.tier_options = std::move(tier);
  cached_options.tier_options.model_fingerprint = model_id;
  cached_options.progress = Progress("with prefix cache", !args.quiet);
  tools::ReplayOptions uncached_options;
  uncached_options.with_cache = false;
  uncached_options.progress = Progress("without prefix cache", !args.quiet);
  const tools::RunResult cached = tools::replay(workload, model, cached_options);
  const tools::RunResult uncached = tools::replay(workload, model, uncached_options);
  const tools::Comparison comparison = tools::compare(cached, uncached, 1e-4);
  const tools::Summary summary = tools::summarize(cached, uncached);
  if (args.json) {
    std::cout << tools::format_json(summary, comparison, cached, uncached, workload.name);
  } else {
    std::cout << tools::format_table(summary, comparison, workload.name);
  }
  return finish(args, comparison.first_difference.empty() ? 0 : 1, cached, uncached);
}

struct BenchArguments {
  bool json = false;
  bool quick = false;
  bool quiet = false;
  bool smoke = false;
  std::string chart = "bench.svg";
};

// Exit status: 0 when every figure with a target passes it, 1 when one fails (bench::
// figures_status), 3 when the chart cannot be written at the end.
int run_bench(const BenchArguments& args, bool& runs_started) {
  if (!args.chart.empty()) tools::check_writable(args.chart, "--chart");
  runs_started = true;
  bench::BenchOptions options;
  options.end_to_end = !args.quick;
  options.smoke = args.smoke;
  if (args.smoke && !args.quiet) {
    note(
        "bench: a smoke run: tiny sizes, one call per timing; the values and verdicts mean "
        "nothing\n");
  }
  if (!args.quiet) options.progress = [](const std::string& step) { note("bench: {}\n", step); };
  const std::vector<bench::Figure> figures = bench::run_figures(options);
  std::cout << (args.json ? bench::figures_json(figures) : bench::format_figures(figures))
            << std::flush;
  const auto chart = [&] {
    if (args.chart.empty()) return;
    tools::write_replacing(args.chart, bench::figures_chart(figures), "--chart");
    if (!args.json) std::cout << fmt::format("chart: {}\n", args.chart) << std::flush;
  };
  return tools::finish_run(bench::figures_status(figures), {chart}, std::cerr);
}

// The model: its weights and the threads its kernels use.
void add_model_options(CLI::App& command, ReplayArguments& args) {
  CLI::Option* config =
      command
          .add_option("--model-config", args.model_config,
                      "model config JSON (README: the built-in model): with --weights, the "
                      "weights' shapes; without, weights are generated for it")
          ->check(CLI::ExistingFile);
  CLI::Option* weights =
      command.add_option("--weights", args.weights, "model safetensors (needs --model-config)")
          ->check(CLI::ExistingFile)
          ->needs(config);
  command
      .add_option("--seed", args.seed,
                  "seed of the generated weights (default: the --model-config's \"seed\", "
                  "else 42)")
      ->transform(whole_number(0, std::numeric_limits<uint64_t>::max()))
      ->excludes(weights);
  command
      .add_option("--threads", args.threads,
                  "threads for the model's kernels (matrix products, attention), this one "
                  "included; every count gives bitwise the same results")
      ->transform(whole_number(1, 256))
      ->capture_default_str();
}

// --parallel and the options that go with it.
void add_parallel_options(CLI::App& replay_command, ReplayArguments& replay) {
  CLI::Option* parallel =
      replay_command
          .add_option("--parallel", replay.parallel,
                      "serve N sequences at once: continuous batching over one prefix cache "
                      "with paged attention, compared with the sequential run without cache")
          ->transform(whole_number(1, 1024));
  replay_command
      .add_option("--prefill-chunk", replay.prefill_chunk,
                  "with --parallel: prompt tokens per step, over all prefilling sequences, at "
                  "most 65536 (a step's activations grow with it)")
      ->transform(whole_number(1, uint64_t{1} << 16))
      ->needs(parallel)
      ->capture_default_str();
  // The pools grow 64 blocks at a time: at most 64 x 1024 = 65536 tokens per chunk (32 MiB per
  // attention layer of the default model). 2^20 made one chunk 32 GiB per layer.
  replay_command
      .add_option("--block-tokens", replay.block_tokens,
                  "with --parallel: tokens per block of the paged attention caches, at most "
                  "1024 (a pool grows by 64 blocks: a chunk then holds at most 65536 tokens, "
                  "32 MiB per attention layer of the default model; larger blocks only leave "
                  "more of the last block of every sequence unused)")
      ->transform(whole_number(1, 1024))
      ->needs(parallel)
      ->capture_default_str();
}

// --speculate and the option that goes with it.
void add_speculate_options(CLI::App& replay_command, ReplayArguments& replay) {
  replay_command
      .add_option("--speculate", replay.speculate,
                  "greedy decoding with speculation: prompt-lookup drafts of up to K tokens per "
                  "round, compared with plain greedy decoding")
      ->transform(whole_number(1, 64))
      ->excludes("--parallel")
      ->excludes("--cache-dir");
  replay_command
      .add_option("--draft-noise", replay.draft_noise,
                  "with --speculate: replace each draft by another token with probability P "
                  "(lowers acceptance, to measure speed and rollback below 1)")
      ->check(CLI::Validator(
                  [](std::string& value) -> std::string {
                    const double p = std::strtod(value.c_str(), nullptr);
                    return std::isnan(p) ? fmt::format("{} is not a number", value) : "";
                  },
                  "", "not NaN") &
              CLI::Range(0.0, 1.0))
      ->needs("--speculate");
}

// Process-wide settings of the CLI (an engine embedding kvsnap makes its own choices).
void tune_process() {
  // The model's matrices are small: one BLAS thread is as fast here and leaves the other core
  // idle (measured on the 2-core machine: same wall time, a third of the CPU time).
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) openblas_set_num_threads(1);
  // A forward's activations are a few MB per step: by default glibc maps and unmaps blocks that
  // large on every step, and each first touch of a page faults. Keep freed memory in the heap.
  (void)::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  (void)::mallopt(M_TRIM_THRESHOLD, 512 << 20);
  // A reader that closed the pipe (`kvsnap replay | head -1`) makes a write fail with EPIPE, which
  // check_stdout reports (exit 3) once the run's other finish steps (the chart, the cache dir's
  // save) have run, instead of a SIGPIPE ending the process in the middle of them.
  (void)std::signal(SIGPIPE, SIG_IGN);
}

// `kvsnap bench` and its options.
CLI::App* add_bench_command(CLI::App& app, BenchArguments& args) {
  CLI::App* bench_command = app.add_subcommand(
      "bench",
      "Measure the headline figures (decode append, chunked prefill, lazy capture, materialize "
      "and restore, merge/split, recurrent snapshots, trie lookups, the shared tier's store, "
      "end-to-end replay, many "
      "sequences at once), each as a "
      "ratio against a limit measured in the same run, with PASS/FAIL against its target (exit "
      "status 1 when one fails), as a table or --json, plus an SVG chart.");
  bench_command->add_flag("--json", args.json, "print the figures as JSON");
  bench_command->add_flag("--quick", args.quick,
                          "skip the end-to-end replays (the sequential and the parallel one)");
  bench_command->add_flag("--quiet", args.quiet, "no progress on stderr");
  bench_command->add_flag("--smoke", args.smoke,
                          "every figure's code at tiny sizes, one call per timing: checks that "
                          "it all runs, in seconds; the values mean nothing");
  bench_command
      ->add_option("--chart", args.chart,
                   "SVG chart of the figures' ratios and verdicts ('' for none): checked before "
                   "the run, replaced atomically")
      ->capture_default_str();
  return bench_command;
}

// Exit status: 0 the runs agree (or a help text), 1 they disagree, 2 bad arguments, a bad
// workload, a request over the context length, an unusable cache directory (one that is not
// private without --shared-cache-dir included) or a saved cache that cannot be loaded, 3
// anything else (out of memory, an internal failure, a failure after the results were printed):
// tools::failure_status and tools::finish_run. bench: 0 every figure passes, 1 one fails.
int run(int argc, char** argv) {
  tune_process();
  CLI::App app{"kvsnap: snapshot, rewind, branch and reuse LLM inference state"};
  app.require_subcommand(1);
  ReplayArguments replay;
  CLI::App* replay_command = app.add_subcommand(
      "replay",
      "Run a multi-turn workload through the built-in hybrid model with and without the prefix "
      "cache, check that both produce the same tokens and logits, and report tokens evaluated, "
      "time to first token and cache use (table or --json, plus an SVG chart).");
  CLI::Option* positional =
      replay_command
          ->add_option("workload", replay.workload,
                       "JSONL workload (default: the embedded one; format in README.md)")
          ->check(CLI::ExistingFile);
  CLI::Option* workload_option =
      replay_command->add_option("--workload", replay.workload, "same as the positional WORKLOAD")
          ->check(CLI::ExistingFile)
          ->excludes(positional);
  replay_command->add_flag("--json", replay.json, "print the figures as JSON instead of a table");
  replay_command->add_flag("--quiet", replay.quiet, "no progress on stderr");
  replay_command
      ->add_option("--chart", replay.chart,
                   "SVG chart file ('' for none): checked before the runs, replaced atomically")
      ->capture_default_str();
  replay_command->add_option("--budget", replay.budget, "prefix cache budget in bytes")
      ->transform(whole_number(1, std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  CLI::Option* cache_dir = replay_command->add_option(
      "--cache-dir", replay.cache_dir,
      "load the prefix cache from DIR when saved there, save it at the end (a second run over "
      "the same workload starts warm); folders it creates and the file are private (0700, "
      "0600), and a DIR or file another user owns or others can write is refused; a DIR "
      "another run is using (DIR/kvsnap.lock) is refused too");
  replay_command
      ->add_flag("--shared-cache-dir", replay.shared_cache_dir,
                 "trust a --cache-dir that another user owns or that group or others can write "
                 "(anyone who can write it can plant the state the model continues from)")
      ->needs(cache_dir);
  replay_command
      ->add_option("--embedded", replay.embedded,
                   "which embedded workload runs when no file is given: default, many-users "
                   "(16 users on one long system prompt) or code-edits (a coding agent quoting "
                   "files, diffs and test logs back: for --speculate)")
      ->check(CLI::IsMember(tools::embedded_workload_names()))
      ->excludes(positional)
      ->excludes(workload_option)
      ->capture_default_str();
  add_model_options(*replay_command, replay);
  add_tier_options(*replay_command, replay);
  add_parallel_options(*replay_command, replay);
  add_speculate_options(*replay_command, replay);

  BenchArguments bench_args;
  CLI::App* bench_command = add_bench_command(app, bench_args);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the help text or its message; its own codes (105, 109...) all mean "bad
    // arguments" here.
    return app.exit(e) == 0 ? 0 : 2;
  }
  bool runs_started = false;
  try {
    if (*replay_command) return run_replay(replay, runs_started);
    if (*bench_command) return run_bench(bench_args, runs_started);
  } catch (...) {
    end_progress_line();
    note("kvsnap: {}\n", tools::failure_message(std::current_exception()));
    return tools::failure_status(std::current_exception(), runs_started);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The last resort: whatever escapes is reported in one line, never as an abort.
  try {
    return run(argc, argv);
  } catch (...) {
    note("kvsnap: {}\n", tools::failure_message(std::current_exception()));
  }
  return 3;
}
