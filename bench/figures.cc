#include "figures.h"

#include <fmt/format.h>
#include <kvsnap/model.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>

#include "common.h"
#include "replay.h"
#include "workload.h"

namespace kvsnap::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// memcpy of `bytes` into a warm destination (the bandwidth limit for copies into live buffers).
double memcpy_ns(int64_t bytes) {
  CopyBuffers buffers(bytes);
  return time_ns([&] { buffers.copy(); });
}

// memcpy of `bytes` into a freshly allocated buffer (the limit for copies that must allocate:
// first touch of new pages is part of the job).
double memcpy_fresh_ns(int64_t bytes) {
  std::vector<char> source(static_cast<size_t>(bytes), 1);
  return time_ns(
      [&] {
        Array fresh = Array::uninitialized(DType::f32, {bytes / 4});
        std::memcpy(fresh.mutable_bytes(), source.data(), source.size());
        keep(fresh);
      },
      0.05, 3);
}

void memcpy_figures(std::vector<Figure>& out) {
  for (int64_t mib : {1, 4, 16, 64, 256}) {
    const int64_t bytes = mib << 20;
    const double ns = memcpy_ns(bytes);
    const double gbps = static_cast<double>(bytes) / ns;
    out.push_back({"memcpy bandwidth", fmt::format("{} MiB", mib), gbps, "GB/s", 1.0, "the limit",
                   "", true, ""});
  }
}

void decode_figures(std::vector<Figure>& out, const Shape& shape) {
  const Chunk token(shape, 1);
  const double limit = memcpy_ns(shape.token_bytes());
  const auto add = [&](const char* name, double ns) {
    const bool pass = ns <= 3 * limit + 200;
    out.push_back({"decode append", name, ns, "ns/token", ns / limit, "x memcpy of the token",
                   "<= 3x memcpy + 200 ns", pass,
                   fmt::format("memcpy of {} B: {:.0f} ns", shape.token_bytes(), limit)});
  };
  {
    KVCache cache;
    cache.reserve(1 << 15);
    Writer writer(1);
    // Touch the whole buffer once: the figure is the steady state of a warm cache, not the
    // first-touch page faults of fresh memory (the prefill figure covers growth).
    const Chunk fill(shape, 1 << 12);
    Writer fill_writer(1 << 12);
    for (int i = 0; i < 8; ++i) fill_writer.write(cache, fill);
    (void)cache.restore(nullptr, 0);
    add("KVCache, 32k-token buffer", time_ns([&] {
          if (cache.offset() == (1 << 15)) (void)cache.restore(nullptr, 0);
          keep(writer.write(cache, token));
        }));
  }
  {
    // The same over a 256-token buffer that stays in the CPU caches: the fixed cost alone.
    KVCache cache;
    cache.reserve(256);
    Writer writer(1);
    add("KVCache, 256-token buffer (cache-hot)", time_ns([&] {
          if (cache.offset() == 256) (void)cache.restore(nullptr, 0);
          keep(writer.write(cache, token));
        }));
  }
  {
    RotatingKVCache cache(4096);
    Writer writer(1);
    for (int i = 0; i < 5000; ++i) writer.write(cache, token);  // a wrapped ring
    add("RotatingKVCache (4096)", time_ns([&] { keep(writer.write(cache, token)); }));
  }
}

void prefill_figures(std::vector<Figure>& out, const Shape& shape) {
  constexpr int64_t kTokens = 128 * 1024, kChunk = 512;
  const Chunk chunk(shape, kChunk);
  const int64_t final_bytes = kTokens * shape.token_bytes();
  CopyStats stats;
  const double ns = time_ns(
      [&] {
        KVCache cache;
        Writer writer(kChunk);
        for (int64_t i = 0; i < kTokens / kChunk; ++i) writer.write(cache, chunk);
        stats = cache.copy_stats();
      },
      0.0, 2);
  const double copied = static_cast<double>(stats.appended_bytes + stats.growth_bytes) /
                        static_cast<double>(stats.appended_bytes);
  out.push_back({"prefill 128k in 512-token chunks", "bytes copied / written", copied, "ratio",
                 copied, "bytes moved per byte written", "<= 2.0", copied <= 2.0,
                 fmt::format("{:.0f} MiB written", static_cast<double>(final_bytes) / kMiB)});
  const double limit = memcpy_fresh_ns(final_bytes);
  out.push_back({"prefill 128k in 512-token chunks", "time", ns / 1e6, "ms", ns / limit,
                 "x one memcpy of the final size", "<= 2.5", ns / limit <= 2.5,
                 fmt::format("memcpy of {:.0f} MiB into new memory: {:.1f} ms",
                             static_cast<double>(final_bytes) / kMiB, limit / 1e6)});
}

void capture_figures(std::vector<Figure>& out, const Shape& shape) {
  KVCache cache;
  const Chunk chunk(shape, 1024);
  Writer writer(1024);
  for (int i = 0; i < 101; ++i) writer.write(cache, chunk);
  for (int64_t range : {int64_t(1), int64_t(1000), int64_t(100000)}) {
    const int64_t bytes = live_bytes();
    const double ns = time_ns([&] { keep(cache.snapshot(cache.offset() - range)); });
    const bool allocated_nothing = live_bytes() == bytes;
    out.push_back({"lazy capture", fmt::format("snapshot of {} tokens", range), ns, "ns",
                   ns / 1000.0, "x 1 us", "< 1 us, 0 bytes", ns < 1000 && allocated_nothing,
                   allocated_nothing ? "0 array bytes allocated" : "ALLOCATED ARRAY BYTES"});
  }
  // Scheduled captures inside one batched write: the write with 64 captures minus without, on
  // a one-head, one-dim layout so the copy does not drown the captures' cost.
  const Shape tiny{.heads = 1, .depth = 1};
  KVCache small;
  small.reserve(4096);
  const Chunk prefill(tiny, 512);
  Writer prefill_writer(512);
  prefill_writer.write(small, prefill);
  std::vector<int64_t> offsets;
  for (int64_t i = 1; i <= 64; ++i) offsets.push_back(512 + 8 * i);
  const double plain = time_ns(
      [&] {
        (void)small.restore(nullptr, 512);
        keep(prefill_writer.write(small, prefill));
      },
      0.1, 5);
  const int64_t bytes = live_bytes();
  const double scheduled = time_ns(
      [&] {
        (void)small.restore(nullptr, 512);
        small.prepare_snapshots(offsets);
        keep(prefill_writer.write(small, prefill));
        keep(small.take_snapshots());
      },
      0.1, 5);
  const bool allocated_nothing = live_bytes() == bytes;
  const double per_capture = std::max(0.0, scheduled - plain) / 64;
  out.push_back({"lazy capture", "scheduled, 64 inside one 512-token write", per_capture,
                 "ns/capture", per_capture / 1000.0, "x 1 us", "< 1 us, 0 bytes",
                 per_capture < 1000 && allocated_nothing,
                 "prepare + write + take, minus the write"});
}

void copy_figures(std::vector<Figure>& out, const Shape& shape) {
  for (int64_t tokens : {int64_t(1024), int64_t(32 * 1024), int64_t(128 * 1024)}) {
    const int64_t bytes = tokens * shape.token_bytes();
    KVCache cache;
    cache.reserve(tokens);
    const Chunk chunk(shape, 1024);
    Writer writer(1024);
    for (int64_t i = 0; i < tokens / 1024; ++i) writer.write(cache, chunk);
    const Chunk one(shape, 1);
    Writer one_writer(1);
    // Materialize: a lazy snapshot of every token, then a write over slot 0 copies it out. A
    // second lazy snapshot of [1, tokens) does not overlap slot 0, so restoring it afterwards is
    // an offset move and each round costs one materialization.
    const double materialize = time_ns(
        [&] {
          SnapshotPtr all = cache.snapshot(0);
          SnapshotPtr rest = cache.snapshot(1);
          (void)cache.restore(nullptr, 0);
          one_writer.write(cache, one);
          (void)cache.restore(rest.get(), tokens);
          keep(all);
        },
        0.1, 3);
    SnapshotPtr owned = cache.snapshot(0);
    (void)cache.restore(nullptr, 0);
    one_writer.write(cache, one);  // materializes `owned`
    (void)cache.restore(owned.get(), tokens);
    // Restore of an owned snapshot into a live cache whose buffer exists.
    const double restore = time_ns(
        [&] {
          (void)cache.restore(nullptr, 0);
          (void)cache.restore(owned.get(), tokens);
        },
        0.1, 3);
    const double materialize_only = materialize;
    const double fresh_limit = memcpy_fresh_ns(bytes), warm_limit = memcpy_ns(bytes);
    const auto gbps = [&](double ns) { return static_cast<double>(bytes) / ns; };
    out.push_back({"materialize owned snapshot", fmt::format("{}k tokens", tokens / 1024),
                   gbps(materialize_only), "GB/s", fresh_limit / materialize_only,
                   "x memcpy speed (into new memory)", ">= 0.8",
                   fresh_limit / materialize_only >= 0.8,
                   fmt::format("{:.0f} MiB", static_cast<double>(bytes) / kMiB)});
    out.push_back({"restore owned snapshot", fmt::format("{}k tokens", tokens / 1024),
                   gbps(restore), "GB/s", warm_limit / restore, "x memcpy speed", ">= 0.8",
                   warm_limit / restore >= 0.8,
                   fmt::format("{:.0f} MiB", static_cast<double>(bytes) / kMiB)});
  }
}

void merge_split_figures(std::vector<Figure>& out, const Shape& shape) {
  KVCache cache;
  const Chunk chunk(shape, 1024);
  Writer writer(1024);
  for (int i = 0; i < 101; ++i) writer.write(cache, chunk);
  for (int64_t range : {int64_t(1000), int64_t(100000)}) {
    const int64_t bytes = live_bytes();
    const double ns = time_ns([&] {
      auto [a, b] = cache.split(cache.snapshot(cache.offset() - range), cache.offset() - range / 2);
      keep(cache.merge(std::move(a), std::move(b)));
    });
    const bool nothing = live_bytes() == bytes;
    out.push_back({"merge + split of lazy snapshots", fmt::format("{} tokens", range), ns, "ns",
                   ns / 1000.0, "x 1 us", "flat in size, < 1 us", ns < 1000 && nothing,
                   "includes creating the snapshot"});
  }
}

void recurrent_figures(std::vector<Figure>& out) {
  // Qwen3-Next-sized gated delta layer: 32 value heads, 128 x 128 f32 state, conv over 8192.
  RecurrentCache cache(3, 8192, 32, 128, 128);
  const Batch batch = Batch::uniform(1, 1, 0);
  (void)cache.get(batch, DType::f32);
  const std::vector<Array> conv{Array::zeros(DType::f32, {1, 3, 8192})};
  const std::vector<Array> delta{Array::zeros(DType::f32, {1, 32, 128, 128})};
  cache.put(batch, conv, delta);
  const int64_t bytes = conv[0].nbytes() + delta[0].nbytes();
  const double ns = time_ns([&] {
    SnapshotPtr s = cache.snapshot(0);
    keep(cache.restore(s.get(), 1));
  });
  const double limit = memcpy_ns(bytes);
  out.push_back({"recurrent snapshot + restore", "32 heads x 128x128 f32", ns, "ns", limit / ns,
                 "x memcpy speed of the state", "", true,
                 fmt::format("{:.1f} MiB state shared, not copied (memcpy: {:.0f} us)",
                             static_cast<double>(bytes) / kMiB, limit / 1e3)});
}

void trie_figures(std::vector<Figure>& out) {
  // 10k sessions on a random tree of 100-token edges: ~1M cached tokens (stateless layers, so
  // this is the trie alone).
  PrefixCache cache({nullptr});
  std::mt19937 rng(1);
  std::vector<std::vector<int32_t>> paths{{}};
  int32_t next = 1;
  for (int i = 0; i < 10000; ++i) {
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
  for (int i = 0; i < 2000; ++i) {
    std::vector<int32_t> prompt = paths[1 + rng() % (paths.size() - 1)];
    prompt.push_back(next++);
    const auto start = Clock::now();
    auto session = cache.begin(prompt);
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
    matched += session.cached();
    ++lookups;
  }
  const double ns = seconds * 1e9 / lookups;
  out.push_back({"prefix trie", fmt::format("begin, {} nodes", cache.node_count()), ns / 1e3, "us",
                 0, "", "", true, fmt::format("avg match {} tokens", matched / lookups)});
  out.push_back({"prefix trie", "match throughput", static_cast<double>(matched) / seconds / 1e6,
                 "M tokens/s", 0, "", "", true, "begin() including the walk"});
}

void model_figures(std::vector<Figure>& out) {
  const Model model{ModelConfig{}};
  for (int64_t length : {int64_t(512), int64_t(2048)}) {
    std::vector<int32_t> prompt(static_cast<size_t>(length));
    for (int64_t i = 0; i < length; ++i)
      prompt[static_cast<size_t>(i)] = static_cast<int32_t>(i * 7 % 256);
    const double ns = time_ns(
        [&] {
          auto caches = model.make_caches();
          keep(model.forward(prompt, cache_pointers(caches)));
        },
        0.2, 2);
    out.push_back({"built-in model prefill", fmt::format("{}-token prompt", length),
                   static_cast<double>(length) / (ns * 1e-9), "tokens/s", 0, "",
                   ">= 2000 (a few thousand)", static_cast<double>(length) / (ns * 1e-9) >= 2000,
                   fmt::format("default size, {:.1f}M parameters, one forward",
                               static_cast<double>(model.config().parameter_count()) / 1e6)});
  }
}

void end_to_end_figures(std::vector<Figure>& out, const BenchOptions& options) {
  const Model model{ModelConfig{}};
  const tools::Workload workload = tools::embedded_workload();
  options.progress("end to end: replay with the prefix cache");
  tools::ReplayOptions with_cache;
  with_cache.with_cache = true;
  tools::ReplayOptions without_cache;
  without_cache.with_cache = false;
  const tools::RunResult cached = tools::replay(workload, model, with_cache);
  options.progress("end to end: replay without the prefix cache");
  const tools::RunResult uncached = tools::replay(workload, model, without_cache);
  const tools::Summary s = tools::summarize(cached, uncached);
  out.push_back({"end to end (kvsnap replay)", "time to first token, median",
                 s.ttft_median_cached * 1e3, "ms", s.ttft_median_uncached / s.ttft_median_cached,
                 "x faster than recomputing", "", true,
                 fmt::format("without cache {:.1f} ms", s.ttft_median_uncached * 1e3)});
  out.push_back({"end to end (kvsnap replay)", "time to first token, p90", s.ttft_p90_cached * 1e3,
                 "ms", s.ttft_p90_uncached / s.ttft_p90_cached, "x faster than recomputing", "",
                 true, fmt::format("without cache {:.1f} ms", s.ttft_p90_uncached * 1e3)});
  const double prefill_rate = static_cast<double>(s.evaluated_uncached) / s.seconds_uncached;
  out.push_back({"end to end (kvsnap replay)", "model throughput without cache", prefill_rate,
                 "tokens/s", 0, "", "", true, "prefill and decode of the whole workload"});
}

}  // namespace

std::vector<Figure> run_figures(const BenchOptions& options) {
  std::vector<Figure> out;
  const Shape shape;
  options.progress("memcpy bandwidth");
  memcpy_figures(out);
  options.progress("decode append");
  decode_figures(out, shape);
  options.progress("prefill");
  prefill_figures(out, shape);
  options.progress("lazy capture");
  capture_figures(out, shape);
  options.progress("materialize / restore");
  copy_figures(out, shape);
  options.progress("merge / split");
  merge_split_figures(out, shape);
  options.progress("recurrent snapshot");
  recurrent_figures(out);
  options.progress("prefix trie");
  trie_figures(out);
  options.progress("built-in model");
  model_figures(out);
  if (options.end_to_end) end_to_end_figures(out, options);
  return out;
}

std::string format_figures(const std::vector<Figure>& figures) {
  std::string out = fmt::format("{:<34} {:<40} {:>12} {:<11} {:>9}  {:<30} {}\n", "figure", "case",
                                "value", "unit", "ratio", "target", "");
  std::string group;
  for (const Figure& f : figures) {
    const std::string ratio = f.ratio == 0 ? "" : fmt::format("{:.2f}", f.ratio);
    const std::string mark = f.target.empty() ? "" : f.pass ? "PASS" : "FAIL";
    out += fmt::format("{:<34} {:<40} {:>12.4g} {:<11} {:>9}  {:<30} {}{}\n",
                       f.group == group ? "" : f.group, f.name, f.value, f.unit, ratio, f.target,
                       mark, f.note.empty() ? "" : "  (" + f.note + ")");
    group = f.group;
  }
  out +=
      "\nratio: as named per figure (\"x memcpy\" of the same bytes measured in this run, or "
      "\"x faster than recomputing\").\n";
  return out;
}

std::string figures_json(const std::vector<Figure>& figures) {
  nlohmann::json array = nlohmann::json::array();
  for (const Figure& f : figures) {
    array.push_back({{"group", f.group},
                     {"case", f.name},
                     {"value", f.value},
                     {"unit", f.unit},
                     {"ratio", f.ratio},
                     {"ratio_meaning", f.ratio_meaning},
                     {"target", f.target},
                     {"pass", f.pass},
                     {"note", f.note}});
  }
  return array.dump(2) + "\n";
}

}  // namespace kvsnap::bench
