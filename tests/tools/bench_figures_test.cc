// `kvsnap bench`: its exit status and its chart.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common.h"
#include "figures.h"

namespace kvsnap::bench {
namespace {

std::vector<Figure> some_figures() {
  return {{"decode append", "KVCache", 12, "ns/token", 2.5, "x memcpy time", "<= 3x", true, ""},
          {"memcpy bandwidth", "1 MiB", 20, "GB/s", 1.0, "the limit", "", true, ""},
          {"machine", "cores", 2, "cores", 0, "", "", true, "no ratio: not charted"}};
}

// The code of every figure runs, end to end included, at the smoke run's tiny sizes (the Debug
// and sanitizer builds would take hours at the real ones): each group reports, every value is a
// number, the table, JSON and chart are made, and the run leaves timing as it found it.
TEST(BenchFigures, EveryFigureRunsInASmokeRun) {
  BenchOptions options;
  options.smoke = true;
  std::vector<std::string> steps;
  options.progress = [&](const std::string& step) { steps.push_back(step); };
  const std::vector<Figure> figures = run_figures(options);
  EXPECT_FALSE(smoke_run);
  std::set<std::string> groups;
  for (const Figure& f : figures) {
    groups.insert(f.group);
    EXPECT_TRUE(std::isfinite(f.value)) << f.group << ": " << f.name;
    EXPECT_TRUE(std::isfinite(f.ratio)) << f.group << ": " << f.name;
  }
  for (const char* group :
       {"machine", "memcpy bandwidth", "decode append", "prefill 128k in 512-token chunks",
        "lazy capture", "materialize lazy snapshot", "restore owned snapshot",
        "merge + split of lazy snapshots", "recurrent decode step", "built-in model prefill",
        "prefix trie", "tier store, paged sequence", "prefix cache per request",
        "end to end (kvsnap replay)", "many sequences (many-users)"}) {
    EXPECT_EQ(groups.count(group), 1u) << group;
  }
  EXPECT_NE(std::find(steps.begin(), steps.end(), "shared tier"), steps.end());
  // The replays agree at any size: a smoke run that disagrees is a broken run, not noise. (The
  // sequential one with recomputation; each model's eight- and one-slot runs.)
  int agreements = 0;
  for (const Figure& f : figures) {
    if (f.target == "identical tokens, logits within 1e-4") {
      ++agreements;
      EXPECT_TRUE(f.pass) << f.name;
    }
  }
  EXPECT_EQ(agreements, 3);
  EXPECT_NE(format_figures(figures).find("many sequences (many-users)"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(figures_json(figures)).size(), figures.size());
  EXPECT_EQ(figures_chart(figures).rfind("<svg", 0), 0u);
}

// CI can gate on the bench: a figure that fails its target fails the run.
TEST(BenchFigures, AFigureThatFailsItsTargetFailsTheRun) {
  std::vector<Figure> figures = some_figures();
  EXPECT_EQ(figures_status(figures), 0);
  figures.push_back(
      {"many sequences", "8 slots vs 1", 900, "tokens/s", 1.9, "x one slot", ">= 2.5", false, ""});
  EXPECT_EQ(figures_status(figures), 1);
  figures.back().target = "";  // reported without a target: nothing to fail
  EXPECT_EQ(figures_status(figures), 0);
}

// Beside its table, a chart: a bar per figure with a ratio, coloured by its verdict, its text
// escaped for XML.
TEST(BenchFigures, TheChartHasABarPerFigureWithARatio) {
  std::vector<Figure> figures = some_figures();
  figures.push_back({"a<b", "c&d", 1, "x", 3, "x faster", ">= 4", false, ""});
  const std::string svg = figures_chart(figures);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("decode append: KVCache"), std::string::npos);
  EXPECT_NE(svg.find("2.50 PASS"), std::string::npos);
  EXPECT_NE(svg.find("fill=\"#c44\""), std::string::npos);  // the failing one
  EXPECT_NE(svg.find("a&lt;b: c&amp;d"), std::string::npos);
  EXPECT_NE(svg.find("3.00 FAIL"), std::string::npos);
  EXPECT_EQ(svg.find("cores"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  // A failure with nothing measured (no ratio) is charted too, and its table shows small ratios.
  figures.push_back({"materialize", "1k", 0, "GB/s", 0, "x memcpy", ">= 0.8", false, "none"});
  figures.push_back({"prefix cache", "8k", 0.2, "ms", 0.004, "of the request", "", true, ""});
  EXPECT_NE(figures_chart(figures).find("materialize: 1k"), std::string::npos);
  EXPECT_NE(format_figures(figures).find("0.004"), std::string::npos);
}

}  // namespace
}  // namespace kvsnap::bench
