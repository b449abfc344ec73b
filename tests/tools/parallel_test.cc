// `kvsnap replay --parallel`: the continuous-batching scheduler over one prefix cache.
#include "parallel.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "model/model.h"
#include "support/private_support.h"
#include "support/test_support.h"
#include "support/tiny_model.h"
#include "workload.h"

namespace kvsnap::tools {
namespace {

using kvsnap::testing::tiny_model;

using kvsnap::testing::throws_error;

// Users on one system prompt: first turns, continuations, a regeneration and an edit, in the
// order a server would see them. Questions of different users share their first words.
Workload many_users(int users) {
  const std::string system =
      "You are Beacon. Answer in numbered steps, cite the runbook, never print secrets. "
      "Section 1: when latency rises, check the dashboard, then the last deploy, then page the "
      "owners. Section 2: when the disk fills, purge old artifacts, then grow the volume.";
  std::string text;
  const auto line = [&](const std::string& json) { text += json + "\n"; };
  for (int u = 0; u < users; ++u) {
    line(fmt::format(
        R"({{"id": "u{0}", "messages": [{{"role": "system", "content": "{1}"}}, {{"role": "user", "content": "The {2} service is slow since {0} minutes."}}], "max_tokens": 6}})",
        u, system, u % 2 == 0 ? "billing" : "search"));
  }
  for (int u = 0; u < users; ++u) {
    line(fmt::format(
        R"({{"id": "u{0}-2", "after": "u{0}", "messages": [{{"role": "user", "content": "What next?"}}], "max_tokens": 5}})",
        u));
  }
  line(R"({"id": "u0-2r", "regenerate": "u0-2", "max_tokens": 5})");
  line(
      R"({"id": "u1-2e", "edit": "u1-2", "messages": [{"role": "user", "content": "Which section?"}], "max_tokens": 5})");
  return parse_workload(text, "many users");
}

ParallelOptions slots(int64_t parallel, int64_t prefill_chunk = 64) {
  ParallelOptions options;
  options.parallel = parallel;
  options.prefill_chunk = prefill_chunk;
  options.block_tokens = 4;
  return options;
}

RunResult sequential_uncached(const Workload& workload, const Model& model) {
  ReplayOptions options;
  options.with_cache = false;
  return replay(workload, model, options);
}

int64_t sum(const RunResult& run, int64_t RequestResult::*field) {
  int64_t total = 0;
  for (const RequestResult& r : run.requests) total += r.*field;
  return total;
}

TEST(ParallelReplay, AgreesWithTheSequentialRunWithoutCacheForEverySlotCountAndChunk) {
  const Model model(tiny_model());
  const Workload workload = many_users(6);
  const RunResult uncached = sequential_uncached(workload, model);
  for (const int64_t parallel : {1, 2, 4, 8}) {
    for (const int64_t chunk : {7, 64, 4096}) {
      SCOPED_TRACE(fmt::format("--parallel {} --prefill-chunk {}", parallel, chunk));
      const ParallelRun run = replay_parallel(workload, model, slots(parallel, chunk));
      const Comparison c = compare(run.run, uncached, 1e-4);
      EXPECT_TRUE(c.same_tokens) << c.first_difference;
      EXPECT_LE(c.max_logit_difference, 1e-4);
      ASSERT_EQ(run.run.requests.size(), workload.requests.size());
      for (size_t i = 0; i < workload.requests.size(); ++i) {
        const RequestResult& r = run.run.requests[i];
        EXPECT_EQ(r.id, workload.requests[i].id);  // workload order, whatever the finish order
        EXPECT_EQ(r.prompt_tokens, uncached.requests[i].prompt_tokens);
        EXPECT_EQ(r.evaluated + r.reused, r.prompt_tokens);
        // Restore points where queued prompts leave this one: every request evaluates only
        // what was never evaluated before — but an edit, which arrives after the request it
        // edits has finished, resumes at the message end before it ("<user>Wh" is shared).
        EXPECT_EQ(r.evaluated, r.floor + (r.id == "u1-2e" ? 3 : 0)) << r.id;
        EXPECT_GT(r.ttft_seconds, 0.0);
      }
      EXPECT_EQ(run.reply_tokens, [&] {
        int64_t n = 0;
        for (const RequestResult& r : run.run.requests) n += static_cast<int64_t>(r.reply.size());
        return n;
      }());
      EXPECT_GT(run.throughput(), 0.0);
      EXPECT_EQ(run.parallel, parallel);
    }
  }
}

// A request that finishes in the step its prefill ends (max_tokens 1) frees its slot, and the
// next request is admitted there at once: the slot is queued for prefill once, not twice (the
// same tokens fed twice in one forward: Model::forward refused the step).
TEST(ParallelReplay, ARequestFinishingInItsPrefillStepFreesItsSlotOnce) {
  const Model model(tiny_model());
  const Workload workload = parse_workload(
      R"({"id": "a", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
{"id": "b", "messages": [{"role": "user", "content": "world"}], "max_tokens": 2}
{"id": "c", "after": "a", "messages": [{"role": "user", "content": "again"}], "max_tokens": 1}
{"id": "d", "regenerate": "c", "max_tokens": 1})",
      "one-token replies");
  const RunResult uncached = sequential_uncached(workload, model);
  for (const int64_t parallel : {1, 4}) {
    SCOPED_TRACE(fmt::format("--parallel {}", parallel));
    ParallelRun run;
    ASSERT_NO_THROW(run = replay_parallel(workload, model, slots(parallel)));
    const Comparison c = compare(run.run, uncached, 1e-4);
    EXPECT_TRUE(c.first_difference.empty()) << c.first_difference;
    ASSERT_EQ(run.run.requests.size(), workload.requests.size());
    EXPECT_EQ(run.run.requests[0].reply.size(), 1u);
  }
}

TEST(ParallelReplay, SequencesShareTheirPrefixInsteadOfHoldingCopies) {
  const Model model(tiny_model());
  const Workload workload = many_users(8);
  const ParallelRun run = replay_parallel(workload, model, slots(8, 64));
  const ModelConfig& c = model.config();
  const int64_t block_bytes = 4 * c.kv_heads * c.head_dim * 2 * 4;  // one 'A' layer
  // The peak holds what the sequences share once, plus at most a partly used block and a
  // block joined at restore per sequence.
  EXPECT_GE(run.kv.peak_bytes, run.kv.ideal_bytes);
  EXPECT_LE(run.kv.peak_bytes, run.kv.ideal_bytes + 8 * 2 * block_bytes);
  // Copies would hold the system prompt once per sequence.
  EXPECT_GT(run.kv.unshared_bytes, 3 * run.kv.peak_bytes);
  // The pools also keep the blocks only the trie holds: finished conversations' replies.
  EXPECT_GT(run.kv.pool_bytes, run.kv.peak_bytes);
}

// Each forward carries a token of every decoding sequence and the prompt chunks of those still
// prefilling: one slot runs a forward per prompt chunk and per reply token after the first;
// eight run far fewer, many of them prefill and decode together.
TEST(ParallelReplay, PromptChunksAndDecodeTokensOfAllSequencesShareForwards) {
  const Model model(tiny_model());
  const Workload workload = many_users(8);
  const ParallelRun one = replay_parallel(workload, model, slots(1, 16));
  int64_t forwards = 0;
  for (const RequestResult& r : one.run.requests) {
    forwards += (r.evaluated + 15) / 16 + static_cast<int64_t>(r.reply.size()) - 1;
  }
  EXPECT_EQ(one.steps, forwards);
  EXPECT_EQ(one.fused_steps, 0);
  const ParallelRun eight = replay_parallel(workload, model, slots(8, 16));
  EXPECT_LT(eight.steps, one.steps / 2);
  EXPECT_GT(eight.fused_steps, 0);
  EXPECT_EQ(eight.reply_tokens, one.reply_tokens);
}

// The table and the JSON report what the scheduler measured.
TEST(ParallelReplay, TheReportCarriesThroughputLatencyAndMemory) {
  const Model model(tiny_model());
  const Workload workload = many_users(4);
  const ParallelRun run = replay_parallel(workload, model, slots(4));
  const RunResult uncached = sequential_uncached(workload, model);
  const Comparison c = compare(run.run, uncached, 1e-4);
  const nlohmann::json json =
      nlohmann::json::parse(format_parallel_json(run, uncached, c, "many users"));
  EXPECT_EQ(json.at("parallel"), 4);
  EXPECT_DOUBLE_EQ(json.at("throughput_tokens_per_s").get<double>(), run.throughput());
  EXPECT_EQ(json.at("peak_kv_bytes"), run.kv.peak_bytes);
  EXPECT_EQ(json.at("unshared_kv_bytes"), run.kv.unshared_bytes);
  EXPECT_EQ(json.at("pool_kv_bytes"), run.kv.pool_bytes);
  EXPECT_EQ(json.at("steps"), run.steps);
  EXPECT_EQ(json.at("fused_steps"), run.fused_steps);
  EXPECT_TRUE(json.at("agree").get<bool>());
  EXPECT_GT(json.at("ttft_ms").at("cached").at("p90").get<double>(), 0.0);
  EXPECT_EQ(json.at("per_request").size(), workload.requests.size());
  // Bytes that are not UTF-8 (a workload's path) are replaced, never thrown on.
  EXPECT_NE(format_parallel_json(run, uncached, c, "bad\xffname").find("bad\xEF\xBF\xBDname"),
            std::string::npos);
  const std::string table = format_parallel_table(run, uncached, c, "many users");
  for (const char* row :
       {"reply tokens per second", "time to first token, median ms", "time to first token, p90 ms",
        "full-attention memory at its peak", "runs agree"}) {
    EXPECT_NE(table.find(row), std::string::npos) << row;
  }
}

// The --parallel report's time to first token counts the same thing in both columns: from when a
// request could start (the run's start, or the end of the request it follows), the time it
// queued included — for a slot, or in the sequential run behind the requests before it. (The
// scheduled run counted from the run's start, the sequential one from each request's own start,
// so --parallel 1 looked slower than the sequential run it equals.)
TEST(ParallelReplay, TimeToFirstTokenCountsFromWhenARequestCouldStartInBothColumns) {
  const Model model(tiny_model());
  const Workload workload = many_users(2);  // u0, u1, then u0-2 after u0, u1-2 after u1, ...
  const RunResult uncached = sequential_uncached(workload, model);
  const auto& r = uncached.requests;
  EXPECT_LT(r[0].waited_seconds, r[0].ttft_seconds);  // the first starts at once
  // u1 could start with the run: it waited for all of u0; u0-2 for u1, after u0 ended.
  EXPECT_GE(r[1].waited_seconds, r[0].ttft_seconds);
  EXPECT_GE(r[2].waited_seconds, r[1].ttft_seconds);
  const ParallelRun run = replay_parallel(workload, model, slots(1));
  for (const RequestResult& p : run.run.requests) {
    EXPECT_GE(p.waited_seconds, 0.0) << p.id;
    EXPECT_GT(p.ttft_seconds, 0.0) << p.id;
  }
  EXPECT_GE(run.run.requests[1].waited_seconds, run.run.requests[0].ttft_seconds);
  const Comparison c = compare(run.run, uncached, 1e-4);
  const nlohmann::json json =
      nlohmann::json::parse(format_parallel_json(run, uncached, c, "many users"));
  const auto from_arrival = [](const RunResult& run, double q) {
    std::vector<double> values;
    for (const RequestResult& x : run.requests) values.push_back(x.waited_seconds + x.ttft_seconds);
    return percentile(values, q) * 1e3;
  };
  EXPECT_DOUBLE_EQ(json.at("ttft_ms").at("uncached").at("median").get<double>(),
                   from_arrival(uncached, 0.5));
  EXPECT_DOUBLE_EQ(json.at("ttft_ms").at("cached").at("p90").get<double>(),
                   from_arrival(run.run, 0.9));
  EXPECT_EQ(json.at("ttft_counts_from"), "when the request could start");
  EXPECT_NE(format_parallel_table(run, uncached, c, "many users")
                .find("time to first token counts from when a request could start"),
            std::string::npos);
}

TEST(ParallelReplay, ARequestWaitsForThePrefillOfItsPrefixInsteadOfRecomputingIt) {
  const Model model(tiny_model());
  const Workload workload = many_users(2);
  const ParallelRun run = replay_parallel(workload, model, slots(2, 16));
  const RequestResult& first = run.run.requests[0];
  const RequestResult& second = run.run.requests[1];
  EXPECT_EQ(first.evaluated, first.prompt_tokens);
  EXPECT_EQ(second.evaluated, second.ideal);  // its own question only
  EXPECT_GT(second.reused, 200);              // the system prompt
  EXPECT_LT(second.evaluated, 50);
  // Serving both one after the other on one slot evaluates the same.
  const ParallelRun one = replay_parallel(workload, model, slots(1, 16));
  EXPECT_EQ(sum(one.run, &RequestResult::evaluated), sum(run.run, &RequestResult::evaluated));
}

TEST(ParallelReplay, BadOptionsAreRefusedNamingThem) {
  const Model model(tiny_model());
  const Workload workload = many_users(2);
  EXPECT_TRUE(throws_error([&] { (void)replay_parallel(workload, model, slots(0)); },
                           {"--parallel 0", ">= 1"}));
  EXPECT_TRUE(throws_error([&] { (void)replay_parallel(workload, model, slots(2, 0)); },
                           {"--prefill-chunk 0", ">= 1"}));
}

// --parallel with --cache-dir checks the folder and the saved cache as the sequential replay
// does, and --shared-cache-dir opts in the same way.
TEST(ParallelReplay, ACacheDirectoryOthersCanWriteIsRefusedUnlessShared) {
  const Model model(tiny_model());
  const Workload workload = many_users(2);
  const auto dir = kvsnap::testing::private_scratch("parallel_shared");
  kvsnap::testing::set_mode(dir, 0777);
  ParallelOptions options = slots(2);
  options.cache_dir = dir.string();
  options.model_id = "tiny";
  const std::string named = "replay --cache-dir: refusing the folder " + dir.string() + " (owner " +
                            kvsnap::testing::user_phrase(::geteuid()) +
                            ", mode 0777): group and others can write it";
  EXPECT_TRUE(throws_error([&] { (void)replay_parallel(workload, model, options); },
                           {named.c_str(), "pass --shared-cache-dir to trust it anyway"}));
  EXPECT_FALSE(std::filesystem::exists(dir / kSavedCacheFile));
  options.shared_cache_dir = true;
  const ParallelRun first = replay_parallel(workload, model, options);
  EXPECT_FALSE(std::filesystem::exists(dir / kSavedCacheFile));  // saved by its caller
  first.run.save_cache();
  // Readable by the folder's other users, whose runs load it too.
  EXPECT_EQ(kvsnap::testing::mode_of(dir / kSavedCacheFile), 0644u);
  EXPECT_EQ(replay_parallel(workload, model, options).run.loaded_nodes, first.run.trie_nodes);
  options.shared_cache_dir = false;
  EXPECT_TRUE(
      throws_error([&] { (void)replay_parallel(workload, model, options); }, {named.c_str()}));
  std::filesystem::remove_all(dir);
}

// --parallel --json reports a warm start and the gap over the ideal as the sequential run does,
// and its table explains a warm start's ideal the same way.
TEST(ParallelReplay, AWarmStartIsReportedLikeTheSequentialRuns) {
  const Model model(tiny_model());
  const Workload workload = many_users(2);
  const auto dir = kvsnap::testing::private_scratch("parallel_warm");
  ParallelOptions options = slots(2);
  options.cache_dir = dir.string();
  options.model_id = "tiny";
  const ParallelRun cold = replay_parallel(workload, model, options);
  const RunResult uncached = sequential_uncached(workload, model);
  const Comparison c = compare(cold.run, uncached, 1e-4);
  nlohmann::json json = nlohmann::json::parse(format_parallel_json(cold, uncached, c, "w"));
  EXPECT_EQ(json.at("loaded_nodes"), -1);
  EXPECT_EQ(json.at("gap").at("seen_not_evaluated").get<int64_t>() +
                json.at("gap").at("restore_points").get<int64_t>(),
            json.at("evaluated_cached").get<int64_t>() - json.at("ideal").get<int64_t>());
  EXPECT_NE(format_parallel_table(cold, uncached, c, "w").find("sampled but never evaluated"),
            std::string::npos);
  cold.run.save_cache();
  const ParallelRun warm = replay_parallel(workload, model, options);
  json = nlohmann::json::parse(format_parallel_json(warm, uncached, c, "w"));
  EXPECT_EQ(json.at("loaded_nodes"), cold.run.trie_nodes);
  EXPECT_EQ(json.at("load_evicted_nodes"), 0);
  // Below the ideal: no parts of a gap over it (they read negative).
  EXPECT_LT(json.at("evaluated_cached").get<int64_t>(), json.at("ideal").get<int64_t>());
  EXPECT_TRUE(json.at("gap").is_null());
  const std::string table = format_parallel_table(warm, uncached, c, "w");
  EXPECT_NE(table.find("warm start: " + std::to_string(cold.run.trie_nodes) + " trie nodes"),
            std::string::npos);
  EXPECT_NE(table.find("the ideal counts tokens new to this run"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(ParallelReplay, ACacheFileOfAnotherUserIsRefusedUnlessShared) {
  std::string why;
  const std::optional<uid_t> nobody = kvsnap::testing::nobody_uid(why);
  if (!nobody) GTEST_SKIP() << why;
  const Model model(tiny_model());
  const Workload workload = many_users(2);
  const auto dir = kvsnap::testing::private_scratch("parallel_foreign");
  ParallelOptions options = slots(2);
  options.cache_dir = dir.string();
  options.model_id = "tiny";
  const ParallelRun first = replay_parallel(workload, model, options);
  first.run.save_cache();
  kvsnap::testing::give_to(dir / kSavedCacheFile, *nobody);
  EXPECT_TRUE(throws_error([&] { (void)replay_parallel(workload, model, options); },
                           {"refusing the file", "another user owns it", "--shared-cache-dir"}));
  options.shared_cache_dir = true;
  EXPECT_EQ(replay_parallel(workload, model, options).run.loaded_nodes, first.run.trie_nodes);
  std::filesystem::remove_all(dir);
}

TEST(ParallelReplay, TheManyUsersWorkloadHasSixteenUsersOnOneLongSystemPrompt) {
  const Workload w = embedded_workload("many-users");
  std::set<std::string> users;
  int regenerations = 0, edits = 0, continuations = 0;
  for (const Request& r : w.requests) {
    users.insert(r.id.substr(0, r.id.find('-')));
    regenerations += r.kind == Request::Kind::regenerate;
    edits += r.kind == Request::Kind::edit;
    continuations += r.kind == Request::Kind::after;
    if (r.kind == Request::Kind::fresh) {
      ASSERT_FALSE(r.messages.empty());
      EXPECT_GE(r.messages.front().content.size(), 4000u);  // ~4k tokens of bytes
      EXPECT_EQ(r.messages.front().content, w.requests.front().messages.front().content);
    }
  }
  EXPECT_GE(users.size(), 16u);
  EXPECT_GE(continuations, 32);  // turns 2 and 3 of every user
  EXPECT_GT(regenerations, 0);
  EXPECT_GT(edits, 0);
  EXPECT_TRUE(throws_error([] { (void)embedded_workload("nope"); }, {"\"nope\"", "many-users"}));
}

// data/model-16m.json, embedded for the parallel figures: the default layers, wider.
TEST(ParallelReplay, TheEmbeddedSixteenMillionParameterConfigIsTheDataFile) {
  const ModelConfig wide = embedded_model_16m();
  EXPECT_EQ(wide.hidden, 512);
  EXPECT_EQ(wide.mlp_hidden, 1536);
  EXPECT_EQ(wide.pattern, ModelConfig{}.pattern);
  EXPECT_NEAR(static_cast<double>(wide.parameter_count()) / 1e6, 16.1, 0.05);
}

}  // namespace
}  // namespace kvsnap::tools
