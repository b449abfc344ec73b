#include "replay.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/model.h"
#include "output.h"
#include "parallel.h"
#include "support/private_support.h"
#include "support/test_support.h"
#include "support/tiny_model.h"
#include "workload.h"

namespace kvsnap::tools {
namespace {

using kvsnap::testing::tiny_model;

using kvsnap::testing::throws_error;

ReplayOptions uncached_options() {
  ReplayOptions options;
  options.with_cache = false;
  return options;
}

const char* kWorkload = R"(# a comment, then every kind of request
{"id": "a", "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}], "max_tokens": 5}
{"id": "b", "after": "a", "messages": [{"role": "user", "content": "And then?"}], "max_tokens": 4}

{"id": "c", "regenerate": "b", "max_tokens": 3}
{"id": "d", "edit": "b", "messages": [{"role": "tool", "content": "output of a long tool call, long enough to wrap the window"}]}
{"id": "e", "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Goodbye"}]}
)";

TEST(Workload, ParsesEveryKindOfRequest) {
  const Workload w = parse_workload(kWorkload, "test");
  ASSERT_EQ(w.requests.size(), 5u);
  EXPECT_EQ(w.requests[1].kind, Request::Kind::after);
  EXPECT_EQ(w.requests[2].kind, Request::Kind::regenerate);
  EXPECT_EQ(w.requests[3].kind, Request::Kind::edit);
  EXPECT_EQ(w.requests[3].max_tokens, 16);
  EXPECT_EQ(w.requests[3].line, 6);
}

// A byte order mark at the start of the file is skipped before a comment as before a request.
TEST(Workload, AByteOrderMarkBeforeTheFirstLineIsSkipped) {
  const std::string bom = "\xEF\xBB\xBF";
  const std::string request = R"({"id": "a", "messages": [{"role": "user", "content": "hi"}]})";
  EXPECT_EQ(parse_workload(bom + "# a comment\n" + request + "\n", "test").requests.at(0).line, 2);
  EXPECT_EQ(parse_workload(bom + request + "\n", "test").requests.at(0).id, "a");
  EXPECT_TRUE(throws_error([&] { (void)parse_workload(request + "\n" + bom + request, "test"); },
                           {"test line 2"}));  // only at the start of the file
}

// The values an error names are cut: a deeply nested max_tokens (dumping it recursed once per
// level: 200000 levels overflowed the stack) is named by its type, a long id by its first bytes.
TEST(Workload, ErrorsNameLongOrNestedValuesShortly) {
  const std::string message = R"({"id": "a", "messages": [{"role": "user", "content": "x"}], )";
  const std::string nested = std::string(200000, '[') + "1" + std::string(200000, ']');
  EXPECT_TRUE(throws_error(
      [&] { (void)parse_workload(message + R"("max_tokens": )" + nested + "}\n", "w"); },
      {"w line 1", "\"max_tokens\" is an array; need an integer"}));
  const std::string id(1000, 'x');
  const std::string twice =
      R"({"id": ")" + id + R"(", "messages": [{"role": "user", "content": "x"}]})";
  try {
    (void)parse_workload(twice + "\n" + twice + "\n", "w");
    ADD_FAILURE() << "a repeated id was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("id \"" + id.substr(0, 64) + "...\" (1000 bytes) is used twice"),
              std::string::npos)
        << what;
    EXPECT_LT(what.size(), 200U);
  }
}

TEST(Workload, TheEmbeddedWorkloadParses) {
  const Workload w = embedded_workload();
  EXPECT_GE(w.requests.size(), 20u);
}

TEST(Workload, MalformedLinesAreReportedWithTheirNumber) {
  const std::string good = R"({"id": "a", "messages": [{"role": "user", "content": "hi"}]})";
  const auto bad = [&](const std::string& line, const char* what) {
    return throws_error([&] { (void)parse_workload(good + "\n\n" + line + "\n", "w.jsonl"); },
                        {"w.jsonl line 3", what});
  };
  EXPECT_TRUE(bad("{not json", "not valid JSON"));
  EXPECT_TRUE(bad(R"({"messages": []})", "\"id\""));
  EXPECT_TRUE(bad(R"({"id": "a", "messages": [{"role": "user", "content": "x"}]})", "used twice"));
  EXPECT_TRUE(bad(R"({"id": "b", "after": "zz", "messages": [{"role": "user", "content": "x"}]})",
                  "\"zz\""));
  EXPECT_TRUE(
      bad(R"({"id": "b", "messages": [{"role": "robot", "content": "x"}]})", "role \"robot\""));
  EXPECT_TRUE(
      bad(R"({"id": "b", "regenerate": "a", "messages": [{"role": "user", "content": "x"}]})",
          "takes no"));
  EXPECT_TRUE(bad(R"({"id": "b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0})",
                  "max_tokens"));
  EXPECT_TRUE(bad(
      R"({"id": "b", "after": "a", "edit": "a", "messages": [{"role": "user", "content": "x"}]})",
      "at most one"));
  EXPECT_TRUE(bad(R"({"id": "b", "colour": 1, "messages": [{"role": "user", "content": "x"}]})",
                  "unknown field \"colour\""));
  EXPECT_TRUE(bad(R"({"id": "b"})", "\"messages\" is required"));
  // A key twice in one object (the last one silently won), at the top or in a message; an
  // unknown field in a message (a typo such as "contents" was ignored).
  EXPECT_TRUE(bad(R"({"id": "b", "id": "c", "messages": [{"role": "user", "content": "x"}]})",
                  "key \"id\" appears twice in one object"));
  EXPECT_TRUE(bad(
      R"({"id": "b", "after": "zz", "after": "a", "messages": [{"role": "user", "content": "x"}]})",
      "key \"after\" appears twice"));
  EXPECT_TRUE(bad(R"({"id": "b", "messages": [{"role": "user", "content": "x", "content": "y"}]})",
                  "key \"content\" appears twice"));
  EXPECT_TRUE(
      bad(R"({"id": "b", "messages": [{"role": "user", "content": "x", "contents": "typo"}]})",
          "message 0 has unknown field \"contents\" (known: role, content)"));
  // The same key in two objects is fine.
  EXPECT_NO_THROW((void)parse_workload(
      good + "\n" +
          R"({"id": "b", "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]})",
      "w.jsonl"));
  EXPECT_TRUE(
      throws_error([] { (void)parse_workload("# nothing\n", "w.jsonl"); }, {"no requests"}));
}

TEST(Workload, PromptsFollowTheirReferences) {
  const Workload w = parse_workload(kWorkload, "test");
  PromptBuilder builder;
  std::vector<int64_t> marks;
  const auto a = builder.prompt(w.requests[0], &marks);
  EXPECT_EQ(a.front(), kSystem);
  EXPECT_EQ(a.back(), kAssistant);
  EXPECT_EQ(marks.size(), 2u);
  builder.record(w.requests[0], a, {65, 66});  // a reply without an end token
  const auto b = builder.prompt(w.requests[1], &marks);
  std::vector<int32_t> expected = a;
  expected.insert(expected.end(), {65, 66, kEnd});
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), b.begin()));
  builder.record(w.requests[1], b, {kEnd});
  EXPECT_EQ(builder.prompt(w.requests[2], nullptr), b);   // regenerate: the same prompt
  const auto d = builder.prompt(w.requests[3], nullptr);  // edit: b's context, new messages
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), d.begin()));
  EXPECT_EQ(d[expected.size()], kTool);
}

TEST(Workload, LoadReadsAFileAndNamesOneItCannotRead) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("kvsnap_workload_" + std::to_string(::getpid()) + ".jsonl");
  { std::ofstream(path) << kWorkload; }
  EXPECT_EQ(load_workload(path.string()).requests.size(), 5u);
  std::filesystem::remove(path);
  const std::string message = "cannot read " + path.string() + ": No such file or directory";
  EXPECT_TRUE(throws_error([&] { (void)load_workload(path.string()); }, {message.c_str()}));
}

TEST(Workload, MinimumPromptLengthsCountWhatIsKnownBeforeAnyReply) {
  const Workload w = parse_workload(kWorkload, "test");
  // a: system (14 bytes) and user (11) messages, each with its role and end tokens, then the
  // assistant token. b continues a: at least a's prompt, one reply token, b's message (9).
  // c regenerates b. d edits b: a's prompt and reply, then its tool message. e: fresh.
  const auto tool = static_cast<int64_t>(w.requests[3].messages[0].content.size());
  const std::vector<int64_t> expected = {30, 30 + 1 + 11 + 1, 43, 30 + 1 + tool + 2 + 1,
                                         16 + 9 + 1};
  EXPECT_EQ(minimum_prompt_lengths(w), expected);
  const Model model(tiny_model());
  const RunResult run = replay(w, model, uncached_options());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_LE(expected[i], run.requests[i].prompt_tokens) << w.requests[i].id;
  }
  EXPECT_EQ(expected[0], run.requests[0].prompt_tokens);  // exact without references
  EXPECT_EQ(expected[4], run.requests[4].prompt_tokens);
}

TEST(Replay, ARequestOverTheContextLengthIsRefusedBeforeAnyModelWork) {
  ModelConfig config = tiny_model();
  config.context_length = 46;  // a fits (30 + 5), b cannot (at least 43 + 4)
  const Model model(config);
  const Workload w = parse_workload(kWorkload, "test");
  EXPECT_TRUE(throws_error([&] { check_context_length(w, config.context_length); },
                           {"test line 3: request \"b\": prompt of at least 43 tokens + "
                            "max_tokens 4 = 47 exceeds the model's context length of 46"}));
  ReplayOptions options;
  int requests_run = 0;
  options.progress = [&](size_t, size_t) { ++requests_run; };
  EXPECT_TRUE(throws_error([&] { (void)replay(w, model, options); }, {"request \"b\""}));
  EXPECT_EQ(requests_run, 0);
  const int64_t d_needs = minimum_prompt_lengths(w)[3] + 16;  // the largest
  EXPECT_NO_THROW(check_context_length(w, d_needs));
  EXPECT_TRUE(throws_error([&] { check_context_length(w, d_needs - 1); }, {"request \"d\""}));
}

TEST(Replay, AContinuationThatRepliesMadeTooLongIsRefusedBeforeItIsEvaluated) {
  // a and b only: b continues a, so its exact length depends on a's reply.
  const Workload w =
      parse_workload(std::string(kWorkload).substr(0, std::string(kWorkload).find("\n\n")), "test");
  ASSERT_EQ(w.requests.size(), 2u);
  const RunResult unlimited = replay(w, Model(tiny_model()), uncached_options());
  const int64_t b_prompt = unlimited.requests[1].prompt_tokens;
  ASSERT_GT(b_prompt, minimum_prompt_lengths(w)[1]);  // a's reply is longer than one token
  ModelConfig config = tiny_model();
  config.context_length = b_prompt + 4 - 1;
  const Model model(config);
  EXPECT_NO_THROW(check_context_length(w, config.context_length));
  ReplayOptions options = uncached_options();
  int requests_run = 0;
  options.progress = [&](size_t, size_t) { ++requests_run; };
  const std::string message = "test line 3: request \"b\": prompt of " + std::to_string(b_prompt) +
                              " tokens + max_tokens 4 = " + std::to_string(b_prompt + 4) +
                              " exceeds the model's context length of " +
                              std::to_string(b_prompt + 3);
  EXPECT_TRUE(throws_error([&] { (void)replay(w, model, options); }, {message.c_str()}));
  EXPECT_EQ(requests_run, 1);
}

TEST(Replay, AnUnusableCacheDirectoryIsRefusedNamingWhy) {
  const auto base =
      std::filesystem::temp_directory_path() / ("kvsnap_cache_dir_" + std::to_string(::getpid()));
  std::filesystem::remove_all(base);
  check_cache_dir((base / "new").string());  // created when missing
  EXPECT_TRUE(std::filesystem::is_directory(base / "new"));
  EXPECT_TRUE(std::filesystem::is_empty(base / "new"));  // the probe is gone
  { std::ofstream(base / "file") << "x"; }
  const std::string named = "cache directory " + (base / "file").string();
  EXPECT_TRUE(throws_error([&] { check_cache_dir((base / "file").string()); },
                           {named.c_str(), "exists and is not a folder"}));
  EXPECT_TRUE(throws_error([&] { check_cache_dir((base / "file" / "sub").string()); },
                           {"cannot create it"}));
  std::filesystem::remove_all(base);
}

TEST(Replay, CacheDirectoriesItCreatesArePrivateWhateverTheUmask) {
  // 0277 masks even the owner's write bit: only the explicit fchmod after creating gives 0600 /
  // 0700.
  for (const mode_t mask : {mode_t{000}, mode_t{077}, mode_t{0277}}) {
    SCOPED_TRACE(mask);
    const kvsnap::testing::ScopedUmask umask(mask);
    const auto base = kvsnap::testing::private_scratch("cache_dir_umask");
    check_cache_dir((base / "a" / "b").string());
    EXPECT_EQ(kvsnap::testing::mode_of(base / "a"), 0700u);
    EXPECT_EQ(kvsnap::testing::mode_of(base / "a" / "b"), 0700u);
    kvsnap::testing::set_mode(base / "a" / "b", 0750);  // one that exists keeps its mode
    check_cache_dir((base / "a" / "b").string());
    EXPECT_EQ(kvsnap::testing::mode_of(base / "a" / "b"), 0750u);
    std::filesystem::remove_all(base);
  }
}

TEST(Replay, ACacheDirectoryOthersCanWriteIsRefusedUnlessShared) {
  const auto dir = kvsnap::testing::private_scratch("cache_dir_shared");
  kvsnap::testing::set_mode(dir, 0777);
  const std::string named = "replay --cache-dir: refusing the folder " + dir.string() + " (owner " +
                            kvsnap::testing::user_phrase(::geteuid()) +
                            ", mode 0777): group and others can write it";
  EXPECT_TRUE(throws_error([&] { check_cache_dir(dir.string()); },
                           {named.c_str(), "; pass --shared-cache-dir to trust it anyway"}));
  check_cache_dir(dir.string(), true);
  // A run saves there with the flag, and a second one loads it only with the flag again.
  const Model model(tiny_model());
  const Workload w = parse_workload(kWorkload, "test");
  ReplayOptions options;
  options.cache_dir = dir.string();
  options.model_id = "tiny";
  options.shared_cache_dir = true;
  const RunResult first = replay(w, model, options);
  first.save_cache();
  // Readable by the folder's other users, whose runs load it too.
  EXPECT_EQ(kvsnap::testing::mode_of(dir / kSavedCacheFile), 0644u);
  EXPECT_EQ(replay(w, model, options).loaded_nodes, first.trie_nodes);
  options.shared_cache_dir = false;
  EXPECT_TRUE(throws_error([&] { (void)replay(w, model, options); }, {named.c_str()}));
  std::filesystem::remove_all(dir);
}

TEST(Replay, ACacheFileOfAnotherUserIsRefusedUnlessShared) {
  std::string why;
  const std::optional<uid_t> nobody = kvsnap::testing::nobody_uid(why);
  if (!nobody) GTEST_SKIP() << why;
  const auto dir = kvsnap::testing::private_scratch("cache_dir_foreign");
  { std::ofstream(dir / kSavedCacheFile) << "planted"; }
  kvsnap::testing::give_to(dir / kSavedCacheFile, *nobody);
  const std::string named = "replay --cache-dir: refusing the file " +
                            (dir / kSavedCacheFile).string() + " (owner " +
                            kvsnap::testing::user_phrase(*nobody) + ", mode ";
  EXPECT_TRUE(throws_error([&] { check_cache_dir(dir.string()); },
                           {named.c_str(), "another user owns it", "pass --shared-cache-dir"}));
  check_cache_dir(dir.string(), true);
  kvsnap::testing::give_to(dir / kSavedCacheFile, ::geteuid());
  kvsnap::testing::give_to(dir, *nobody);
  EXPECT_TRUE(throws_error([&] { check_cache_dir(dir.string()); },
                           {"refusing the folder", "another user owns it"}));
  check_cache_dir(dir.string(), true);
  std::filesystem::remove_all(dir);
}

TEST(Replay, FiguresAreConsistentAndTheRunsAgree) {
  const Model model(tiny_model());
  const Workload w = parse_workload(kWorkload, "test");
  const RunResult cached = replay(w, model, ReplayOptions{});
  const RunResult uncached = replay(w, model, uncached_options());
  ASSERT_EQ(cached.requests.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const RequestResult& r = cached.requests[i];
    EXPECT_EQ(r.evaluated + r.reused, r.prompt_tokens) << r.id;
    EXPECT_GE(r.evaluated, r.floor) << r.id;
    EXPECT_GE(r.floor, r.ideal) << r.id;
    EXPECT_GE(r.ideal, 1) << r.id;
    EXPECT_EQ(uncached.requests[i].evaluated, r.prompt_tokens) << r.id;
  }
  EXPECT_EQ(cached.requests[0].reused, 0);
  EXPECT_GT(cached.requests[1].reused, 0);     // continuation
  EXPECT_EQ(cached.requests[2].evaluated, 1);  // regeneration
  EXPECT_GT(cached.requests[4].reused, 0);     // shared system prompt
  const Comparison c = compare(cached, uncached, 1e-4);
  EXPECT_TRUE(c.same_tokens) << c.first_difference;
  EXPECT_EQ(c.first_difference, "");
  const Summary s = summarize(cached, uncached);
  EXPECT_EQ(s.evaluated_cached, s.ideal + s.gap_seen_not_evaluated + s.gap_restore_points);
  EXPECT_NE(format_table(s, c, "test").find("runs agree"), std::string::npos);
  EXPECT_NE(format_chart(cached, uncached).find("<svg"), std::string::npos);
  EXPECT_NE(format_json(s, c, cached, uncached, "test").find("\"evaluated_cached\""),
            std::string::npos);
}

// Request ids are any JSON string: the chart escapes XML's special characters and replaces what
// XML cannot hold at all (a control character, bytes that are not UTF-8).
TEST(Replay, TheChartEscapesRequestIds) {
  const Model model(tiny_model());
  const Workload w = parse_workload(
      R"({"id": "a<b&c\u0001\"'>", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})",
      "test");
  const RunResult cached = replay(w, model, ReplayOptions{});
  const RunResult uncached = replay(w, model, uncached_options());
  const std::string chart = format_chart(cached, uncached);
  EXPECT_EQ(chart.find("a<b"), std::string::npos);
  EXPECT_NE(chart.find("<title>a&lt;b&amp;c\xEF\xBF\xBD&quot;&apos;&gt;: "), std::string::npos)
      << chart;
  EXPECT_EQ(xml_escape("x\xff\xc0\x80y\x1b\t\xe2\x82\xac"),
            "x\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBDy\xEF\xBF\xBD\t\xe2\x82\xac");
}

TEST(Replay, ASecondRunWithTheCacheDirectoryStartsWarm) {
  const Model model(tiny_model());
  const Workload w = parse_workload(kWorkload, "test");
  const auto dir =
      std::filesystem::temp_directory_path() / ("kvsnap_replay_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  ReplayOptions options;
  options.cache_dir = dir.string();
  options.model_id = "tiny";
  const RunResult first = replay(w, model, options);
  EXPECT_EQ(first.loaded_nodes, -1);
  // The run saves nothing by itself: its caller saves once it has checked the run.
  EXPECT_FALSE(std::filesystem::exists(dir / kSavedCacheFile));
  EXPECT_FALSE(replay(w, model, uncached_options()).save_cache);  // nothing to save
  first.save_cache();
  const RunResult second = replay(w, model, options);
  EXPECT_EQ(second.loaded_nodes, first.trie_nodes);
  int64_t evaluated = 0;
  for (const RequestResult& r : second.requests) evaluated += r.evaluated;
  EXPECT_EQ(evaluated, static_cast<int64_t>(w.requests.size()));  // one token per request
  EXPECT_TRUE(compare(second, replay(w, model, uncached_options()), 1e-4).first_difference.empty());
  options.model_id = "another model";  // a trie saved for another model: the input's fault
  EXPECT_THROW((void)replay(w, model, options), InputError);
  std::filesystem::remove_all(dir);
}

// A smaller --budget than the saving run's evicts loaded nodes at once: the table and the JSON
// say how many were loaded and how many of them the budget evicted (they said "0 loaded").
TEST(Replay, AWarmStartUnderASmallerBudgetSaysWhatItLoadedAndEvicted) {
  const Model model(tiny_model());
  const Workload w = parse_workload(kWorkload, "test");
  const auto dir = kvsnap::testing::private_scratch("replay_budget");
  ReplayOptions options;
  options.cache_dir = dir.string();
  options.model_id = "tiny";
  const RunResult first = replay(w, model, options);
  first.save_cache();
  options.max_paged_out_bytes = 1;
  const RunResult second = replay(w, model, options);
  EXPECT_EQ(second.loaded_nodes, first.trie_nodes);
  EXPECT_GT(second.load_evicted_nodes, 0);
  EXPECT_GE(second.evicted_nodes, second.load_evicted_nodes);
  const RunResult uncached = replay(w, model, uncached_options());
  const Comparison c = compare(second, uncached, 1e-4);
  const Summary s = summarize(second, uncached);
  const std::string loaded = "warm start: " + std::to_string(first.trie_nodes) +
                             " trie nodes loaded from the cache directory; the budget evicted " +
                             std::to_string(second.load_evicted_nodes) + " of them at once";
  EXPECT_NE(format_table(s, c, "test").find(loaded), std::string::npos) << format_table(s, c, "t");
  const nlohmann::json json = nlohmann::json::parse(format_json(s, c, second, uncached, "test"));
  EXPECT_EQ(json.at("loaded_nodes"), first.trie_nodes);
  EXPECT_TRUE(json.at("gap").is_null());  // its parts would read negative
  EXPECT_TRUE(
      nlohmann::json::parse(format_json(summarize(first, uncached), c, first, uncached, "test"))
          .at("gap")
          .is_object());
  EXPECT_EQ(json.at("load_evicted_nodes"), second.load_evicted_nodes);
  std::filesystem::remove_all(dir);
}

TEST(Replay, ARunThatDisagreesIsReported) {
  const Model model(tiny_model());
  const Workload w = parse_workload(kWorkload, "test");
  RunResult cached = replay(w, model, ReplayOptions{});
  const RunResult uncached = replay(w, model, uncached_options());
  cached.requests[1].reply[0] += 1;
  const Comparison c = compare(cached, uncached, 1e-4);
  EXPECT_FALSE(c.same_tokens);
  EXPECT_NE(c.first_difference.find("request 2 (b)"), std::string::npos);
}

// JSON encoding never throws after the runs: bytes that are not UTF-8 (a workload's path need
// not be) are replaced by U+FFFD.
TEST(Replay, TheJsonReplacesBytesThatAreNotUtf8) {
  const Model model(tiny_model());
  const Workload w = parse_workload(kWorkload, "test");
  const RunResult cached = replay(w, model, ReplayOptions{});
  const RunResult uncached = replay(w, model, uncached_options());
  const Comparison c = compare(cached, uncached, 1e-4);
  std::string json;
  ASSERT_NO_THROW(
      json = format_json(summarize(cached, uncached), c, cached, uncached, "bad\xffname.jsonl"));
  EXPECT_NE(json.find("\"workload\": \"bad\xEF\xBF\xBDname.jsonl\""), std::string::npos) << json;
}

// How a run ends (README: exit status): failures before the runs are the arguments' and
// inputs' (2), after they started the run's own (3) unless about an input; a failure after the
// results were printed keeps them, and a disagreement stays 1.
TEST(ExitStatus, FailuresBeforeTheRunsAreTheInputsAndAfterThemTheRuns) {
  const auto status = [](auto exception, bool started) {
    return failure_status(std::make_exception_ptr(exception), started);
  };
  EXPECT_EQ(status(Error("bad workload"), false), 2);
  EXPECT_EQ(status(Error("Model::forward: rows 0 and 1 are both sequence 0"), true), 3);
  EXPECT_EQ(status(InputError("request over the context length"), true), 2);
  EXPECT_EQ(status(std::bad_alloc(), false), 3);
  EXPECT_EQ(status(std::runtime_error("json"), true), 3);
}

// Running out of memory is said plainly, with what needs less of it.
TEST(ExitStatus, OutOfMemoryIsReportedClearly) {
  EXPECT_EQ(failure_message(std::make_exception_ptr(std::bad_alloc())),
            "out of memory (std::bad_alloc): the run needs more memory than this process can "
            "have; a smaller --budget, --parallel or --block-tokens, or a smaller workload, "
            "needs less");
  EXPECT_EQ(failure_message(std::make_exception_ptr(Error("replay: x"))), "replay: x");
}

TEST(ExitStatus, AFailureAfterTheResultsIsReportedAndEveryStepStillRuns) {
  std::ostringstream errors;
  int ran = 0;
  const std::vector<std::function<void()>> steps{
      [&] { throw Error("replay: cannot write the chart to /x"); }, [&] { ++ran; }};
  EXPECT_EQ(finish_run(0, steps, errors), 3);
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(errors.str(), "kvsnap: replay: cannot write the chart to /x\n");
  EXPECT_EQ(finish_run(1, steps, errors), 1);  // a disagreement is not masked
  EXPECT_EQ(finish_run(0, {[&] { ++ran; }}, errors), 0);
  EXPECT_EQ(ran, 3);
}

// Runs that load a --cache-dir at start and save it at the end would overwrite each other's
// saves: the CLI takes an exclusive lock on DIR/kvsnap.lock for the run, and a second run is
// refused at once, naming the folder and the process that holds it.
TEST(Output, ACacheDirectoryIsLockedForOneRunAtATime) {
  const auto dir = kvsnap::testing::private_scratch("cache_dir_lock");
  {
    const CacheDirLock first = lock_cache_dir(dir.string(), false);
    EXPECT_TRUE(first.held());
    EXPECT_EQ(kvsnap::testing::mode_of(dir / kCacheDirLockFile), 0600u);
    const std::string message =
        "cache directory " + dir.string() + ": in use by another kvsnap run (pid " +
        std::to_string(::getpid()) + ") (it holds " + (dir / kCacheDirLockFile).string() + ")";
    EXPECT_TRUE(throws_error([&] { (void)lock_cache_dir(dir.string(), false); },
                             {message.c_str(), "use another --cache-dir"}));
  }
  // Released with the first run: the next one takes it; a shared folder's lock file is one its
  // other users can open and lock too.
  EXPECT_TRUE(lock_cache_dir(dir.string(), true).held());
  EXPECT_EQ(kvsnap::testing::mode_of(dir / kCacheDirLockFile), 0644u);
  std::filesystem::remove(dir / kCacheDirLockFile);
  ASSERT_EQ(::mkfifo((dir / kCacheDirLockFile).c_str(), 0600), 0);
  EXPECT_TRUE(
      throws_error([&] { (void)lock_cache_dir(dir.string(), true); }, {"is not a regular file"}));
  // A hard link to another file is refused, and that file left as it was.
  std::filesystem::remove(dir / kCacheDirLockFile);
  const auto victim = dir / "victim";
  { std::ofstream(victim) << "keep"; }
  std::filesystem::permissions(
      victim, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  std::filesystem::create_hard_link(victim, dir / kCacheDirLockFile);
  EXPECT_TRUE(throws_error([&] { (void)lock_cache_dir(dir.string(), true); },
                           {"kvsnap.lock has 2 names (a hard link to another file)"}));
  std::ifstream kept(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "keep");
  EXPECT_EQ(kvsnap::testing::mode_of(victim), 0600u);
  std::filesystem::remove_all(dir);
}

// --chart: checked before the runs, then replaced in one rename (never half written), a new one
// with the umask like any program's output, one it replaces keeping its permissions.
TEST(Output, AChartIsCheckedThenReplacedAtomically) {
  const kvsnap::testing::ScopedUmask umask(022);
  const auto dir = kvsnap::testing::private_scratch("chart");
  const std::string path = (dir / "c.svg").string();
  check_writable(path, "--chart");
  EXPECT_TRUE(std::filesystem::is_empty(dir));  // the probe is gone
  { std::ofstream(path) << "old"; }
  write_replacing(path, "<svg/>", "--chart");
  std::ifstream in(path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "<svg/>");
  EXPECT_EQ(kvsnap::testing::mode_of(path), 0644u);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1);  // no temporary
  // A file someone made at the temporary's name during the run is neither written into nor
  // renamed over the chart.
  const std::string planted = path + ".tmp-" + std::to_string(::getpid());
  { std::ofstream(planted) << "planted"; }
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);  // made private
  write_replacing(path, "<svg>2</svg>", "--chart");
  EXPECT_EQ(kvsnap::testing::mode_of(path), 0600u);
  std::ifstream again(path), left(planted);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(again), {}), "<svg>2</svg>");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(left), {}), "planted");
  std::filesystem::remove(planted);
  const std::string missing = "--chart " + (dir / "no" / "c.svg").string() + ": cannot write it";
  EXPECT_TRUE(throws_error([&] { check_writable((dir / "no" / "c.svg").string(), "--chart"); },
                           {missing.c_str(), "No such file or directory"}));
  EXPECT_TRUE(throws_error([&] { check_writable(dir.string(), "--chart"); }, {"it is a folder"}));
  // Only a regular file is replaced: a device, a pipe or a link would be replaced by the chart.
  EXPECT_TRUE(throws_error([] { check_writable("/dev/null", "--chart"); },
                           {"--chart /dev/null", "not a regular file"}));
  const std::string pipe = (dir / "pipe.svg").string(), link = (dir / "link.svg").string();
  ASSERT_EQ(::mkfifo(pipe.c_str(), 0600), 0);
  std::filesystem::create_symlink(path, link);
  for (const std::string& special : {pipe, link}) {
    EXPECT_TRUE(throws_error([&] { check_writable(special, "--chart"); }, {"not a regular file"}))
        << special;
  }
  std::filesystem::remove_all(dir);
}

// The chart replaces no input of the run (the same file under any name) and neither the saved
// cache nor the lock of its cache directory (also before they exist); a chart beside them is
// fine.
TEST(Output, AChartReplacesNoInputOfTheRun) {
  const auto dir = kvsnap::testing::private_scratch("chart_apart");
  const std::string workload = (dir / "w.jsonl").string(), alias = (dir / "alias").string();
  { std::ofstream(workload) << "{}"; }
  std::filesystem::create_hard_link(workload, alias);
  const std::string cache = (dir / "cache").string();
  std::filesystem::create_directories(cache);
  const std::vector<std::pair<std::string, std::string>> inputs{
      {"the workload", workload},
      {"the weights", ""},
      {"the cache directory's lock", cache + "/kvsnap.lock"}};
  for (const std::string& chart : {workload, alias}) {
    EXPECT_TRUE(throws_error([&] { check_apart(chart, "--chart", inputs); },
                             {"--chart", "it is the workload", "w.jsonl"}))
        << chart;
  }
  for (const std::string& chart : {cache + "/kvsnap.lock", cache + "/sub/../kvsnap.lock"}) {
    EXPECT_TRUE(throws_error([&] { check_apart(chart, "--chart", inputs); },
                             {"--chart", "it is the cache directory's lock"}))
        << chart;
  }
  check_apart(cache + "/chart.svg", "--chart", inputs);  // beside them: accepted
  check_apart((dir / "chart.svg").string(), "--chart", inputs);
  std::filesystem::remove_all(dir);
}

// Writes a model config and two sets of weights for it (seeds 1 and 2) to $KVSNAP_WEIGHTS_DIR
// (else a scratch folder): the inputs of cli_cache_dir_keyed_by_weights.
TEST(CliFixture, WritesAModelConfigAndTwoSetsOfWeights) {
  const char* target = std::getenv("KVSNAP_WEIGHTS_DIR");
  const std::filesystem::path dir = target != nullptr
                                        ? std::filesystem::path(target)
                                        : kvsnap::testing::private_scratch("cli_fixture_weights");
  std::filesystem::create_directories(dir);
  for (const uint64_t seed : {1, 2}) {
    ModelConfig config = tiny_model();
    config.seed = seed;
    const Model model(config);
    const std::string weights = (dir / fmt::format("weights{}.safetensors", seed)).string();
    model.save((dir / fmt::format("model{}.json", seed)).string(), weights);
    EXPECT_EQ(Model::load((dir / "model1.json").string(), weights).config().hidden, 32);
  }
  if (target == nullptr) std::filesystem::remove_all(dir);
}

// Two runs agree on the same requests, replies and logits within the tolerance, relative to a
// logit's size above 1.
TEST(Compare, RunsAgreeOnRepliesAndLogitsWithinTheTolerance) {
  RunResult a;
  RequestResult r;
  r.id = "a";
  r.reply = {5, 6};
  r.logits = LogitRows::of({{0.5f, 20.0f}, {-3.0f, 0.0f}});
  a.requests = {r};
  RunResult b = a;
  EXPECT_TRUE(compare(a, b, 1e-4).first_difference.empty());
  b.requests[0].logits = LogitRows::of({{0.5f, 20.001f}, {-3.0f, 0.0f}});  // 5e-5 of 20
  EXPECT_TRUE(compare(a, b, 1e-4).first_difference.empty());
  b.requests[0].logits = LogitRows::of({{0.5002f, 20.0f}, {-3.0f, 0.0f}});  // 2e-4 of 0.5 (< 1)
  Comparison c = compare(a, b, 1e-4);
  EXPECT_TRUE(c.same_tokens);
  EXPECT_NE(c.first_difference.find("logits differ"), std::string::npos) << c.first_difference;
  b = a;
  b.requests[0].logits =
      LogitRows::of({{0.5f, 20.0f}, {std::numeric_limits<float>::quiet_NaN(), 0.0f}});
  c = compare(a, b, 1e-4);
  EXPECT_NE(c.first_difference.find("logits differ"), std::string::npos) << c.first_difference;
  b = a;
  b.requests[0].reply = {5, 7};
  c = compare(a, b, 1e-4);
  EXPECT_FALSE(c.same_tokens);
  EXPECT_NE(c.first_difference.find("request 1 (a)"), std::string::npos) << c.first_difference;
  // Logits rows missing on one side, or of another width, or another request: no agreement
  // (the rows compared were only those both runs had).
  b = a;
  b.requests[0].logits = LogitRows::of({{0.5f, 20.0f}});
  c = compare(a, b, 1e-4);
  EXPECT_NE(c.first_difference.find("request 1 (a): 2 and 1 logits rows"), std::string::npos)
      << c.first_difference;
  b.requests[0].logits = LogitRows();
  EXPECT_FALSE(compare(b, a, 1e-4).first_difference.empty());
  b.requests[0].logits = LogitRows::of({{0.5f, 20.0f, 1.0f}, {-3.0f, 0.0f, 1.0f}});
  c = compare(a, b, 1e-4);
  EXPECT_NE(c.first_difference.find("of 2 and 3 values"), std::string::npos) << c.first_difference;
  b = a;
  b.requests[0].id = "b";
  c = compare(a, b, 1e-4);
  EXPECT_FALSE(c.same_tokens);
  EXPECT_NE(c.first_difference.find("request 1 is a in one run and b in the other"),
            std::string::npos)
      << c.first_difference;
  b = a;
  b.requests.push_back(r);
  c = compare(a, b, 1e-4);
  EXPECT_FALSE(c.same_tokens);
  EXPECT_NE(c.first_difference.find("1 requests against 2"), std::string::npos)
      << c.first_difference;
  // The outputs that pair the runs' requests refuse runs of other lengths (not read past one).
  EXPECT_TRUE(throws_error([&] { (void)format_json(summarize(a, b), c, a, b, "w"); },
                           {"format_json: runs of 1 and 2 requests"}));
  EXPECT_TRUE(
      throws_error([&] { (void)format_chart(b, a); }, {"format_chart: runs of 2 and 1 requests"}));
  ParallelRun parallel;
  parallel.run = b;
  EXPECT_TRUE(throws_error([&] { (void)format_parallel_json(parallel, a, c, "w"); },
                           {"format_parallel_json: runs of 2 and 1 requests"}));
  EXPECT_NO_THROW((void)format_chart(a, a));
}

}  // namespace
}  // namespace kvsnap::tools
