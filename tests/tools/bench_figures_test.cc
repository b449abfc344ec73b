// `kvsnap bench`: its exit status and its chart.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "figures.h"

namespace kvsnap::bench {
namespace {

std::vector<Figure> some_figures() {
  return {{"decode append", "KVCache", 12, "ns/token", 2.5, "x memcpy time", "<= 3x", true, ""},
          {"memcpy bandwidth", "1 MiB", 20, "GB/s", 1.0, "the limit", "", true, ""},
          {"machine", "cores", 2, "cores", 0, "", "", true, "no ratio: not charted"}};
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
