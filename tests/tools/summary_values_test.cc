// The numbers the replay tools report, from hand-made runs with known values: percentiles, and
// each ratio pointing the right way (time to first token, throughput, memory, speculation).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "parallel.h"
#include "replay.h"
#include "speculate.h"

namespace kvsnap::summary_values_test {
namespace {

using tools::Comparison;
using tools::DecodeStats;
using tools::ParallelRun;
using tools::percentile;
using tools::RequestResult;
using tools::RunResult;
using tools::SpeculateReport;
using tools::Summary;

// A request of a hand-made run; `reply` tokens of value 1 (no logits: compare needs none).
RequestResult request(const std::string& id, int64_t prompt, int64_t evaluated, int64_t ideal,
                      int64_t floor, double ttft, double waited = 0, size_t reply = 0) {
  RequestResult r;
  r.id = id;
  r.prompt_tokens = prompt;
  r.evaluated = evaluated;
  r.reused = prompt - evaluated;
  r.ideal = ideal;
  r.floor = floor;
  r.ttft_seconds = ttft;
  r.waited_seconds = waited;
  r.reply.assign(reply, 1);
  return r;
}

// Ideal and floor from the longest prefix shared with any earlier request: what it held (prompt
// and reply) for the ideal, what it evaluated (all but its last reply token) for the floor.
TEST(Ideals, AreMeasuredFromTheLongestPrefixAnyEarlierRequestHeld) {
  const std::vector<std::vector<int32_t>> prompts{
      {1, 2, 3, 4}, {1, 2, 3, 9, 8, 7}, {1, 2, 3, 4, 9, 8, 5}, {-1, 7}, {1, 2, 3, 9, 8, 7}};
  std::vector<RequestResult> requests(prompts.size());
  const std::vector<std::vector<int32_t>> replies{{9, 8}, {6}, {2}, {3}, {6}};
  for (size_t i = 0; i < prompts.size(); ++i) {
    requests[i].prompt_tokens = static_cast<int64_t>(prompts[i].size());
    requests[i].reply = replies[i];
  }
  tools::measure_ideals(prompts, requests);
  const std::vector<std::pair<int64_t, int64_t>> expected{
      {4, 4},   // nothing before it
      {3, 3},   // 1 2 3 of the first
      {1, 2},   // the first held 1 2 3 4 9 8, and evaluated 1 2 3 4 9
      {2, 2},   // nothing in common
      {1, 1}};  // the second again (a prompt wholly seen leaves one token to evaluate)
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(requests[i].ideal, expected[i].first) << i;
    EXPECT_EQ(requests[i].floor, expected[i].second) << i;
  }
}

// The cells after `label` on the table's line that starts with it (after its indent), split on
// blanks; empty when no line does.
std::vector<std::string> cells(const std::string& table, const std::string& label) {
  std::istringstream lines(table);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t start = line.find_first_not_of(' ');
    if (start == std::string::npos || line.compare(start, label.size(), label) != 0) continue;
    std::istringstream rest(line.substr(start + label.size()));
    std::vector<std::string> out;
    for (std::string cell; rest >> cell;) out.push_back(cell);
    return out;
  }
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// percentile: sorted values v[0..n-1], rank = q * (n - 1), v[floor(rank)] plus the fraction of
// rank above floor(rank) times the step to the next value (the last value past the end).
TEST(SummaryPercentile, InterpolatesLinearlyBetweenTheSortedValues) {
  const std::vector<double> v = {4, 1, 3, 2};   // sorted: 1 2 3 4, n - 1 = 3
  EXPECT_DOUBLE_EQ(percentile(v, 0.5), 2.5);    // rank 1.5: 2 + 0.5 * (3 - 2)
  EXPECT_DOUBLE_EQ(percentile(v, 0.9), 3.7);    // rank 2.7: 3 + 0.7 * (4 - 3)
  EXPECT_DOUBLE_EQ(percentile(v, 0.25), 1.75);  // rank 0.75: 1 + 0.75 * (2 - 1)
  EXPECT_DOUBLE_EQ(percentile(v, 0.0), 1.0);    // the least
  EXPECT_DOUBLE_EQ(percentile(v, 1.0), 4.0);    // the most: rank 3, no value after it
  // Unevenly spaced, unsorted, a duplicate and a negative: sorted -5 0 0 10 30, n - 1 = 4.
  const std::vector<double> w = {30, 0, -5, 10, 0};
  EXPECT_DOUBLE_EQ(percentile(w, 0.5), 0.0);   // rank 2: exactly the middle value
  EXPECT_DOUBLE_EQ(percentile(w, 0.9), 22.0);  // rank 3.6: 10 + 0.6 * (30 - 10)
  EXPECT_DOUBLE_EQ(percentile(w, 0.1), -3.0);  // rank 0.4: -5 + 0.4 * (0 - -5)
  // Two values: the p90 lies 90% of the way from the smaller to the larger, whatever the order.
  EXPECT_DOUBLE_EQ(percentile({10, 0}, 0.9), 9.0);
  EXPECT_DOUBLE_EQ(percentile({0, 10}, 0.9), 9.0);
}

TEST(SummaryPercentile, NoValuesGiveZeroAndOneValueIsEveryQuantile) {
  for (double q : {0.0, 0.5, 0.9, 1.0}) {
    EXPECT_EQ(percentile({}, q), 0.0) << q;
    EXPECT_EQ(percentile({7.25}, q), 7.25) << q;
    EXPECT_EQ(percentile({3, 3, 3}, q), 3.0) << q;
  }
  // A quantile outside [0, 1] (or NaN) is refused, not read outside the values.
  for (double q : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_THROW((void)percentile({1, 2}, q), Error) << q;
  }
}

// Three requests; the cached run is faster. By hand:
//   prompt 10 + 14 + 20 = 44 tokens; evaluated with the cache 10 + 4 + 6 = 20, without 44;
//   reused 44 - 20 = 24; ideal 9 + 2 + 5 = 16; floor - ideal: 1 + 1 + 0 = 2 sampled but never
//   evaluated; evaluated - floor: 0 + 1 + 1 = 2 at restore points; gap 100 * 4 / 16 = +25.00%.
//   TTFT cached 2, 1, 3 ms: sorted 1 2 3, median (rank 1) 2 ms, p90 (rank 1.8) 2 + 0.8 = 2.8 ms.
//   TTFT uncached 10, 30, 20 ms: median 20 ms, p90 20 + 0.8 * 10 = 28 ms. Speed-up 20 / 2 = 10x.
RunResult cached_run() {
  RunResult run;
  run.with_cache = true;
  run.requests = {request("a", 10, 10, 9, 10, 0.002), request("b", 14, 4, 2, 3, 0.001),
                  request("c", 20, 6, 5, 5, 0.003)};
  run.seconds = 1.5;
  run.paged_out_bytes = 4096;
  run.evicted_nodes = 3;
  run.trie_nodes = 7;
  return run;
}

RunResult uncached_run() {
  RunResult run;
  run.requests = {request("a", 10, 10, 9, 10, 0.010), request("b", 14, 14, 2, 3, 0.030),
                  request("c", 20, 20, 5, 5, 0.020)};
  run.seconds = 6.25;
  return run;
}

TEST(SummaryValues, SummarizeTotalsTokensAndTakesEachRunsPercentiles) {
  const Summary s = tools::summarize(cached_run(), uncached_run());
  EXPECT_EQ(s.requests, 3);
  EXPECT_EQ(s.prompt_tokens, 44);
  EXPECT_EQ(s.evaluated_cached, 20);
  EXPECT_EQ(s.evaluated_uncached, 44);
  EXPECT_EQ(s.ideal, 16);
  EXPECT_EQ(s.gap_seen_not_evaluated, 2);
  EXPECT_EQ(s.gap_restore_points, 2);
  EXPECT_DOUBLE_EQ(s.ttft_median_cached, 0.002);
  EXPECT_DOUBLE_EQ(s.ttft_p90_cached, 0.0028);
  EXPECT_DOUBLE_EQ(s.ttft_median_uncached, 0.020);
  EXPECT_DOUBLE_EQ(s.ttft_p90_uncached, 0.028);
  EXPECT_LT(s.ttft_median_cached, s.ttft_median_uncached);  // the cache made it faster
  EXPECT_EQ(s.seconds_cached, 1.5);
  EXPECT_EQ(s.seconds_uncached, 6.25);
  EXPECT_EQ(s.paged_out_bytes, 4096);
  EXPECT_EQ(s.evicted_nodes, 3);
  EXPECT_EQ(s.trie_nodes, 7);
  EXPECT_EQ(s.loaded_nodes, -1);
  EXPECT_FALSE(tools::restored_from_before(s));
}

TEST(SummaryValues, TheTablePrintsEachColumnsFiguresAndTheSpeedUpOfTheCachedRun) {
  const Summary s = tools::summarize(cached_run(), uncached_run());
  const std::string table = tools::format_table(s, Comparison{}, "w");
  using Cells = std::vector<std::string>;
  EXPECT_EQ(cells(table, "kvsnap replay:"),
            (Cells{"w", "(3", "requests,", "44", "prompt", "tokens)"}));
  EXPECT_EQ(cells(table, "tokens evaluated"), (Cells{"20", "44"})) << table;
  EXPECT_EQ(cells(table, "tokens reused"), (Cells{"24", "0"}));
  EXPECT_EQ(cells(table, "ideal (never seen before)"), (Cells{"16"}));
  EXPECT_EQ(cells(table, "time to first token, median ms"), (Cells{"2.0", "20.0"}));
  EXPECT_EQ(cells(table, "time to first token, p90 ms"), (Cells{"2.8", "28.0"}));
  EXPECT_EQ(cells(table, "total time s"), (Cells{"1.50", "6.25"}));
  EXPECT_EQ(cells(table, "paged-out bytes"), (Cells{"4096"}));
  EXPECT_EQ(cells(table, "evicted trie nodes"), (Cells{"3"}));
  EXPECT_EQ(cells(table, "trie nodes"), (Cells{"7"}));
  EXPECT_TRUE(contains(table, "evaluated with the cache vs ideal: +25.00% (4 tokens over)"))
      << table;
  EXPECT_TRUE(contains(table, "    2 of them were sampled but never evaluated")) << table;
  EXPECT_TRUE(contains(table, "    2 lie between a divergence")) << table;
  EXPECT_EQ(cells(table, "speed-up of time to first token (median):"), (Cells{"10.0x"}));
}

// Swapped, the cache is the slower run: the speed-up reads below 1 (2 / 20 ms = 0.1x), and a
// cached median of 0 prints 0.0x rather than dividing by it.
TEST(SummaryValues, ASlowerCachedRunReadsAsASpeedUpBelowOne) {
  const Summary slow = tools::summarize(uncached_run(), cached_run());
  EXPECT_GT(slow.ttft_median_cached, slow.ttft_median_uncached);
  const std::string table = tools::format_table(slow, Comparison{}, "w");
  EXPECT_EQ(cells(table, "speed-up of time to first token (median):"),
            (std::vector<std::string>{"0.1x"}))
      << table;
  Summary zero = slow;
  zero.ttft_median_cached = 0;
  EXPECT_EQ(cells(tools::format_table(zero, Comparison{}, "w"),
                  "speed-up of time to first token (median):"),
            (std::vector<std::string>{"0.0x"}));
}

TEST(SummaryValues, TheJsonCarriesTheSameFiguresInMilliseconds) {
  const RunResult cached = cached_run(), uncached = uncached_run();
  const Summary s = tools::summarize(cached, uncached);
  const nlohmann::json json =
      nlohmann::json::parse(tools::format_json(s, Comparison{}, cached, uncached, "w"));
  EXPECT_EQ(json.at("requests"), 3);
  EXPECT_EQ(json.at("prompt_tokens"), 44);
  EXPECT_EQ(json.at("evaluated_cached"), 20);
  EXPECT_EQ(json.at("evaluated_uncached"), 44);
  EXPECT_EQ(json.at("ideal"), 16);
  EXPECT_EQ(json.at("gap").at("seen_not_evaluated"), 2);
  EXPECT_EQ(json.at("gap").at("restore_points"), 2);
  const nlohmann::json& ttft = json.at("ttft_ms");
  EXPECT_DOUBLE_EQ(ttft.at("cached").at("median").get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(ttft.at("cached").at("p90").get<double>(), 2.8);
  EXPECT_DOUBLE_EQ(ttft.at("uncached").at("median").get<double>(), 20.0);
  EXPECT_DOUBLE_EQ(ttft.at("uncached").at("p90").get<double>(), 28.0);
  EXPECT_EQ(json.at("seconds").at("cached").get<double>(), 1.5);
  EXPECT_EQ(json.at("seconds").at("uncached").get<double>(), 6.25);
  EXPECT_TRUE(json.at("agree").get<bool>());
  const nlohmann::json& b = json.at("per_request").at(1);
  EXPECT_EQ(b.at("id"), "b");
  EXPECT_EQ(b.at("evaluated_cached"), 4);
  EXPECT_EQ(b.at("reused"), 10);
  EXPECT_EQ(b.at("evaluated_uncached"), 14);
  EXPECT_DOUBLE_EQ(b.at("ttft_ms_cached").get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(b.at("ttft_ms_uncached").get<double>(), 30.0);
}

// Tier hits restore state earlier runs saved, as a warm start does: the gap over the ideal
// (which counts tokens new to this run) has no parts then.
TEST(SummaryValues, TierHitsCountAsRestoredFromBefore) {
  RunResult cached = cached_run();
  cached.with_tier = true;
  cached.tier.lookups = 3;
  Summary s = tools::summarize(cached, uncached_run());
  EXPECT_FALSE(tools::restored_from_before(s));  // lookups without hits
  cached.tier.hits = 1;
  s = tools::summarize(cached, uncached_run());
  EXPECT_TRUE(tools::restored_from_before(s));
  EXPECT_TRUE(
      nlohmann::json::parse(tools::format_json(s, Comparison{}, cached, uncached_run(), "w"))
          .at("gap")
          .is_null());
  EXPECT_FALSE(contains(tools::format_table(s, Comparison{}, "w"), "sampled but never evaluated"));
}

// Two slots; by hand: reply tokens 3 + 5 = 8 in both runs; 8 / 0.5 s = 16 tokens/s scheduled,
// 8 / 4 s = 2 tokens/s sequential: 8.0x. TTFT from when a request could start (waited + ttft):
// scheduled 1 + 2 = 3 and 0 + 1 = 1 ms: median 2 ms, p90 1 + 0.9 * 2 = 2.8 ms; sequential
// 0 + 10 = 10 and 10 + 30 = 40 ms: median 25 ms, p90 10 + 0.9 * 30 = 37 ms. Memory: peak 2 MiB,
// unshared 8 MiB (4.0x the peak), ideal 1 MiB (the peak is 2.000x of it), pools 3 MiB.
// Tokens: prompt 10 + 12 = 22; evaluated 10 + 3 = 13 (sequential 22), ideal 9 + 2 = 11; gap
// 100 * 2 / 11 = +18.18%, floor - ideal 1 + 1 = 2, evaluated - floor 0.
ParallelRun parallel_run() {
  ParallelRun p;
  p.parallel = 2;
  p.steps = 9;
  p.fused_steps = 4;
  p.reply_tokens = 8;
  p.run.with_cache = true;
  p.run.requests = {request("a", 10, 10, 9, 10, 0.002, 0.001, 3),
                    request("b", 12, 3, 2, 3, 0.001, 0.0, 5)};
  p.run.seconds = 0.5;
  p.kv = {.peak_bytes = 2 << 20,
          .unshared_bytes = 8 << 20,
          .ideal_bytes = 1 << 20,
          .pool_bytes = 3 << 20};
  return p;
}

RunResult sequential_run() {
  RunResult run;
  run.requests = {request("a", 10, 10, 9, 10, 0.010, 0.0, 3),
                  request("b", 12, 12, 2, 3, 0.030, 0.010, 5)};
  run.seconds = 4.0;
  return run;
}

TEST(SummaryParallel, TheTablePrintsThroughputLatencyAndMemoryRatios) {
  const ParallelRun p = parallel_run();
  EXPECT_DOUBLE_EQ(p.throughput(), 16.0);
  const std::string table = tools::format_parallel_table(p, sequential_run(), Comparison{}, "w");
  using Cells = std::vector<std::string>;
  EXPECT_TRUE(contains(table, "kvsnap replay --parallel 2: w (2 requests, 22 prompt tokens)"));
  EXPECT_EQ(cells(table, "tokens evaluated"), (Cells{"13", "22"})) << table;
  EXPECT_EQ(cells(table, "ideal (never seen before)"), (Cells{"11"}));
  EXPECT_EQ(cells(table, "time to first token, median ms"), (Cells{"2.0", "25.0"}));
  EXPECT_EQ(cells(table, "time to first token, p90 ms"), (Cells{"2.8", "37.0"}));
  EXPECT_EQ(cells(table, "reply tokens per second"), (Cells{"16.0", "2.0"}));
  EXPECT_EQ(cells(table, "total time s"), (Cells{"0.50", "4.00"}));
  EXPECT_EQ(cells(table, "forward steps"), (Cells{"9"}));
  EXPECT_TRUE(contains(table,
                       "at its peak: 2.0 MiB in blocks the live sequences use; 8.0 MiB if "
                       "each held its own copy\n    (4.0x)"))
      << table;
  EXPECT_TRUE(contains(table, "own tokens: 1.0 MiB (2.000x of that)")) << table;
  EXPECT_TRUE(contains(table, "the pools at their peak: 3.0 MiB")) << table;
  EXPECT_TRUE(contains(table, "evaluated with the cache vs ideal: +18.18% (2 tokens over)"));
  EXPECT_EQ(cells(table, "throughput vs the sequential run without cache:"), (Cells{"8.0x"}));
}

TEST(SummaryParallel, TheJsonCarriesTheSameFigures) {
  const nlohmann::json json = nlohmann::json::parse(
      tools::format_parallel_json(parallel_run(), sequential_run(), Comparison{}, "w"));
  EXPECT_EQ(json.at("parallel"), 2);
  EXPECT_EQ(json.at("prompt_tokens"), 22);
  EXPECT_EQ(json.at("evaluated_cached"), 13);
  EXPECT_EQ(json.at("evaluated_uncached"), 22);
  EXPECT_EQ(json.at("ideal"), 11);
  EXPECT_EQ(json.at("gap").at("seen_not_evaluated"), 2);
  EXPECT_EQ(json.at("gap").at("restore_points"), 0);
  EXPECT_EQ(json.at("reply_tokens"), 8);
  EXPECT_DOUBLE_EQ(json.at("throughput_tokens_per_s").get<double>(), 16.0);
  EXPECT_DOUBLE_EQ(json.at("throughput_tokens_per_s_uncached").get<double>(), 2.0);
  const nlohmann::json& ttft = json.at("ttft_ms");
  EXPECT_DOUBLE_EQ(ttft.at("cached").at("median").get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(ttft.at("cached").at("p90").get<double>(), 2.8);
  EXPECT_DOUBLE_EQ(ttft.at("uncached").at("median").get<double>(), 25.0);
  EXPECT_DOUBLE_EQ(ttft.at("uncached").at("p90").get<double>(), 37.0);
  EXPECT_EQ(json.at("peak_kv_bytes"), 2 << 20);
  EXPECT_EQ(json.at("unshared_kv_bytes"), 8 << 20);
  EXPECT_EQ(json.at("ideal_kv_bytes"), 1 << 20);
  EXPECT_EQ(json.at("pool_kv_bytes"), 3 << 20);
  EXPECT_EQ(json.at("steps"), 9);
  EXPECT_EQ(json.at("fused_steps"), 4);
  const nlohmann::json& b = json.at("per_request").at(1);
  EXPECT_DOUBLE_EQ(b.at("ttft_ms_cached").get<double>(), 1.0);     // 0 + 1 ms
  EXPECT_DOUBLE_EQ(b.at("ttft_ms_uncached").get<double>(), 40.0);  // 10 + 30 ms
  EXPECT_EQ(b.at("reply_tokens"), 5);
}

// Slower than the sequential run (8 tokens in 8 s: 1/s against its 2/s) the ratio reads 0.5x;
// a sequential run of no time prints 0.0x rather than dividing by zero.
TEST(SummaryParallel, ASlowerScheduledRunReadsBelowOneAndNoTimeReadsZero) {
  ParallelRun p = parallel_run();
  p.run.seconds = 8.0;
  const std::string label = "throughput vs the sequential run without cache:";
  EXPECT_EQ(cells(tools::format_parallel_table(p, sequential_run(), Comparison{}, "w"), label),
            (std::vector<std::string>{"0.5x"}));
  RunResult instant = sequential_run();
  instant.seconds = 0;
  EXPECT_EQ(cells(tools::format_parallel_table(p, instant, Comparison{}, "w"), label),
            (std::vector<std::string>{"0.0x"}));
}

// Speculative decoding: 60 tokens in 0.5 s (120/s) against plain decoding's 60 in 1.5 s
// (40/s): 3.00x. 30 of 40 drafts accepted: 0.750. 0.025 s of the 0.5 s in capture and
// rollback: 5.000% (rollback_share 0.05).
SpeculateReport speculate_inputs() {
  SpeculateReport r;
  r.speculative.run = cached_run();
  r.plain.run = cached_run();
  r.uncached = uncached_run();
  r.speculative.decode = {.tokens = 60,
                          .seconds = 0.5,
                          .round_seconds = 0.025,
                          .rounds = 10,
                          .drafted = 40,
                          .accepted = 30,
                          .forwards = 20};
  r.plain.decode = {.tokens = 60, .seconds = 1.5, .forwards = 60};
  return r;
}

TEST(SummarySpeculation, TheTableAndJsonPrintAcceptanceSpeedUpAndRollbackShare) {
  SpeculateReport r = speculate_inputs();
  tools::finish_report(r, "w", {.speculate = 4, .draft_noise = 0.125});
  EXPECT_TRUE(r.agree()) << r.comparison.first_difference;
  EXPECT_TRUE(contains(r.table, "prompt-lookup drafts of up to 4 tokens")) << r.table;
  using Cells = std::vector<std::string>;
  EXPECT_EQ(cells(r.table, "acceptance rate"),
            (Cells{"0.750", "(30", "of", "40", "drafts,", "10", "rounds)"}))
      << r.table;
  EXPECT_EQ(cells(r.table, "decode tokens/s"),
            (Cells{"120.0", "speculative,", "40.0", "plain", "(3.00x)"}));
  EXPECT_EQ(cells(r.table, "decode forwards"),
            (Cells{"20", "speculative,", "60", "plain", "(60", "tokens)"}));
  EXPECT_EQ(cells(r.table, "capture + rollback share"), (Cells{"5.000%", "of", "decode", "time"}));
  // The replay table before it compares the speculative run with the reference.
  EXPECT_EQ(cells(r.table, "speed-up of time to first token (median):"), (Cells{"10.0x"}));
  const nlohmann::json json = nlohmann::json::parse(r.json);
  EXPECT_EQ(json.at("speculate"), 4);
  EXPECT_DOUBLE_EQ(json.at("draft_noise").get<double>(), 0.125);
  EXPECT_DOUBLE_EQ(json.at("acceptance_rate").get<double>(), 0.75);
  EXPECT_DOUBLE_EQ(json.at("decode_tokens_per_s").get<double>(), 120.0);
  EXPECT_DOUBLE_EQ(json.at("decode_tokens_per_s_plain").get<double>(), 40.0);
  EXPECT_DOUBLE_EQ(json.at("rollback_share").get<double>(), 0.05);
  const nlohmann::json& s = json.at("speculation");
  EXPECT_EQ(s.at("rounds"), 10);
  EXPECT_EQ(s.at("drafted"), 40);
  EXPECT_EQ(s.at("accepted"), 30);
  EXPECT_EQ(s.at("decode_tokens"), 60);
  EXPECT_EQ(s.at("decode_forwards"), 20);
  EXPECT_EQ(s.at("decode_forwards_plain"), 60);
  EXPECT_DOUBLE_EQ(s.at("decode_seconds").get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(s.at("decode_seconds_plain").get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(json.at("ttft_ms").at("cached").at("median").get<double>(), 2.0);
}

// Slower speculation (60 tokens in 3 s: 20/s against 40/s) reads 0.50x; no drafts, no plain
// decode time and no speculative decode time read 0 rather than dividing by zero.
TEST(SummarySpeculation, ASlowerOrEmptyRunReadsBelowOneOrZero) {
  SpeculateReport r = speculate_inputs();
  r.speculative.decode.seconds = 3.0;
  tools::finish_report(r, "w", {.speculate = 4});
  EXPECT_EQ(cells(r.table, "decode tokens/s"),
            (std::vector<std::string>{"20.0", "speculative,", "40.0", "plain", "(0.50x)"}))
      << r.table;
  r.speculative.decode = DecodeStats{};
  r.plain.decode = DecodeStats{};
  tools::finish_report(r, "w", {.speculate = 4});
  EXPECT_TRUE(contains(r.table, "acceptance rate                0.000 (0 of 0 drafts, 0 rounds)"))
      << r.table;
  EXPECT_TRUE(contains(r.table, "0.0 speculative, 0.0 plain (0.00x)")) << r.table;
  EXPECT_TRUE(contains(r.table, "0.000% of decode time")) << r.table;
  const nlohmann::json json = nlohmann::json::parse(r.json);
  EXPECT_EQ(json.at("acceptance_rate").get<double>(), 0.0);
  EXPECT_EQ(json.at("decode_tokens_per_s").get<double>(), 0.0);
  EXPECT_EQ(json.at("rollback_share").get<double>(), 0.0);
}

}  // namespace
}  // namespace kvsnap::summary_values_test
