// Two engine processes share a tier on a real redis-server: `replay` of half a workload's
// conversations in one, then the whole workload in a fresh one. The second restores what the
// first evaluated — over both runs, tokens evaluated stay within 2% of the ideal (tokens never
// seen before by either) — and agrees with the uncached run (identical tokens, logits within
// 1e-4). Each run is a forked child process: nothing but the store carries over.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "replay.h"
#include "support/redis_server.h"
#include "support/tiny_model.h"
#include "workload.h"

namespace kvsnap::tools {
namespace {

using kvsnap::testing::tiny_model;

using Json = nlohmann::json;

// Six conversations of three turns on one system prompt, a regeneration in the third.
std::string conversations() {
  const std::string system =
      "You are the assistant of a platform team. Answer concisely, cite the runbook section you "
      "rely on, never print secrets, and escalate anything that touches production data.";
  std::string out;
  for (int c = 1; c <= 6; ++c) {
    const std::string id = "c" + std::to_string(c);
    out += Json{{"id", id},
                {"messages",
                 {{{"role", "system"}, {"content", system}},
                  {{"role", "user"},
                   {"content", "Question " + id + ": how do I rotate the keys of cluster " +
                                   std::to_string(c * 7) + " without downtime?"}}}},
                {"max_tokens", 8}}
               .dump() +
           "\n";
    for (int turn = 2; turn <= 3; ++turn) {
      const std::string previous = turn == 2 ? id : id + "-2";
      out += Json{{"id", id + "-" + std::to_string(turn)},
                  {"after", previous},
                  {"messages",
                   {{{"role", "user"},
                     {"content", "Follow-up " + std::to_string(turn) + " of " + id +
                                     ": and what if the rollout fails half way through?"}}}},
                  {"max_tokens", 8}}
                 .dump() +
             "\n";
    }
    if (c == 3)
      out += Json{{"id", "c3-r"}, {"regenerate", "c3-3"}, {"max_tokens", 8}}.dump() + "\n";
  }
  return out;
}

// The requests of the first `count` conversations (a request joins the one it refers to).
Workload first_conversations(const Workload& whole, size_t count) {
  Workload out{whole.name + " (first half)", {}};
  std::set<std::string> kept;
  size_t roots = 0;
  for (const Request& request : whole.requests) {
    const bool keep =
        request.kind == Request::Kind::fresh ? roots++ < count : kept.count(request.reference) > 0;
    if (!keep) continue;
    kept.insert(request.id);
    out.requests.push_back(request);
  }
  return out;
}

Json to_json(const RunResult& run) {
  Json requests = Json::array();
  for (const RequestResult& r : run.requests) {
    requests.push_back({{"id", r.id},
                        {"prompt_tokens", r.prompt_tokens},
                        {"evaluated", r.evaluated},
                        {"reply", r.reply},
                        {"logits", r.logits.all()}});
  }
  return {{"requests", requests},
          {"hits", run.tier.hits},
          {"restored", run.tier.restored_tokens},
          {"written", run.tier.bytes_written},
          {"rejected", run.tier.rejected}};
}

RunResult from_json(const Json& json) {
  RunResult run;
  for (const Json& r : json.at("requests")) {
    RequestResult result;
    result.id = r.at("id");
    result.prompt_tokens = r.at("prompt_tokens");
    result.evaluated = r.at("evaluated");
    result.reply = r.at("reply").get<std::vector<int32_t>>();
    result.logits = LogitRows::of(r.at("logits").get<std::vector<std::vector<float>>>());
    run.requests.push_back(std::move(result));
  }
  run.with_tier = true;
  run.tier.hits = json.at("hits");
  run.tier.restored_tokens = json.at("restored");
  run.tier.bytes_written = json.at("written");
  run.tier.rejected = json.at("rejected");
  return run;
}

// Runs `replay` of `workload` with the tier in a forked child, its own process.
RunResult in_fresh_process(const Workload& workload, const std::string& tier) {
  const std::filesystem::path out = std::filesystem::temp_directory_path() /
                                    ("kvsnap_tier_replay_" + std::to_string(::getpid()) + ".json");
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {
    int status = 1;
    try {
      ReplayOptions options;
      options.tier = tier;
      options.tier_options.model_fingerprint = tiny_model().to_json();
      options.tier_options.tenant = "tests";
      options.tier_options.chunk_tokens = 16;
      options.tier_options.lookup_timeout = std::chrono::milliseconds(2000);
      options.tier_options.log = [](const std::string&) {};
      const RunResult run = replay(workload, Model(tiny_model()), options);
      std::ofstream(out) << to_json(run).dump();
      status = 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(status);
  }
  int status = -1;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child replay failed";
  std::ifstream in(out);
  const Json json = Json::parse(in, nullptr, false);
  std::filesystem::remove(out);
  if (json.is_discarded()) return {};
  return from_json(json);
}

// The ideal over both runs: per request, its prompt tokens that no earlier request of either run
// had seen (at least one); prompts rebuilt from the replies.
int64_t ideal_over(const std::vector<std::pair<const Workload*, const RunResult*>>& runs) {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<RequestResult> requests;
  for (const auto& run : runs) {
    PromptBuilder builder;
    for (size_t i = 0; i < run.first->requests.size(); ++i) {
      const Request& request = run.first->requests[i];
      std::vector<int32_t> prompt = builder.prompt(request, nullptr);
      RequestResult result;
      result.prompt_tokens = static_cast<int64_t>(prompt.size());
      result.reply = run.second->requests.at(i).reply;
      builder.record(request, prompt, result.reply);
      prompts.push_back(std::move(prompt));
      requests.push_back(std::move(result));
    }
  }
  measure_ideals(prompts, requests);
  int64_t ideal = 0;
  for (const RequestResult& r : requests) ideal += r.ideal;
  return ideal;
}

int64_t evaluated(const RunResult& run) {
  int64_t total = 0;
  for (const RequestResult& r : run.requests) total += r.evaluated;
  return total;
}

TEST(TierReplay, AFreshProcessRestoresWhatAnotherEvaluatedAndAgreesWithRecomputation) {
  testing::RedisServer server;
  const Workload whole = parse_workload(conversations(), "conversations");
  const Workload half = first_conversations(whole, 3);
  ASSERT_EQ(half.requests.size(), 10u);
  const RunResult first = in_fresh_process(half, server.address());
  const RunResult second = in_fresh_process(whole, server.address());
  ASSERT_EQ(first.requests.size(), half.requests.size());
  ASSERT_EQ(second.requests.size(), whole.requests.size());
  EXPECT_GT(first.tier.bytes_written, 0);
  EXPECT_GT(second.tier.hits, 0);
  EXPECT_EQ(second.tier.rejected, 0);

  const int64_t ideal = ideal_over({{&half, &first}, {&whole, &second}});
  const int64_t both = evaluated(first) + evaluated(second);
  EXPECT_LE(static_cast<double>(both), 1.02 * static_cast<double>(ideal))
      << both << " tokens evaluated over both runs, ideal " << ideal;

  ReplayOptions uncached;
  uncached.with_cache = false;
  const RunResult recomputed = replay(whole, Model(tiny_model()), uncached);
  const Comparison comparison = compare(second, recomputed, 1e-4);
  EXPECT_TRUE(comparison.same_tokens) << comparison.first_difference;
  EXPECT_LE(comparison.max_logit_difference, 1e-4);
}

}  // namespace
}  // namespace kvsnap::tools
