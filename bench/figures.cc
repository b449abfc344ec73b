#include "figures.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <new>
#include <nlohmann/json.hpp>
#include <thread>

#include "figure_parts.h"
#include "model/weights.h"
#include "ops/kernel_report.h"
#include "output.h"

namespace kvsnap::bench {
namespace {

// Sets smoke_run for the figures run while it lives.
class SmokeScope {
 public:
  explicit SmokeScope(bool on) { smoke_run = on; }
  ~SmokeScope() { smoke_run = false; }
  SmokeScope(const SmokeScope&) = delete;
  SmokeScope& operator=(const SmokeScope&) = delete;
};

void memcpy_figures(std::vector<Figure>& out) {
  for (int64_t mib : {1, 4, 16, 64, 256}) {
    if (smoke() && mib > 1) break;
    const int64_t bytes = mib << 20;
    const double ns = memcpy_ns(bytes);
    const double gbps = static_cast<double>(bytes) / ns;
    out.push_back({"memcpy bandwidth", fmt::format("{} MiB", mib), gbps, "GB/s", 1.0, "the limit",
                   "", true, ""});
  }
}

// What this run's figures were measured on: the cores, and which variant of each hand-written
// kernel the CPU runs (the figures of an AVX-512 and of an AVX2 machine are not comparable).
void machine_figures(std::vector<Figure>& out) {
  const detail::OpsKernels ops = detail::ops_kernels();
  out.push_back(
      {"machine", "cores; kernels this CPU runs",
       static_cast<double>(std::thread::hardware_concurrency()), "cores", 0, "", "", true,
       fmt::format("products {}, attention {}, softmax {}, SiLU {}",
                   detail::matmul_variants().back().name, ops.attention, ops.softmax, ops.silu)});
  out.push_back({"machine", "compute limit: fma peak of one core", fma_peak_flops_per_ns(),
                 "GFLOP/s", 1.0, "the limit", "", true,
                 "12 independent fma chains in registers, the products' vector width"});
}

}  // namespace

bool smoke() { return smoke_run; }

int64_t sized(int64_t n, int64_t least) { return smoke_run ? std::max(n / 64, least) : n; }

double memcpy_ns(int64_t bytes) {
  CopyBuffers buffers(bytes);
  return time_ns([&] { buffers.copy(); });
}

std::vector<Figure> run_figures(const BenchOptions& options) {
  std::vector<Figure> out;
  const SmokeScope scope(options.smoke);
  const Shape shape = options.smoke ? Shape{.heads = 1, .depth = 8} : Shape{};
  machine_figures(out);
  options.progress("memcpy bandwidth");
  memcpy_figures(out);
  options.progress("decode append");
  decode_figures(out, shape);
  outstanding_snapshot_figures(out, shape);
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
  options.progress("built-in model");
  model_figures(out);
  options.progress("prefix trie");
  trie_figures(out);  // after the model: its begin is set against recomputing
  options.progress("shared tier");
  tier_figures(out, shape);
  if (options.end_to_end) {
    prefix_overhead_figures(out, options);
    end_to_end_figures(out, options);
    parallel_figures(out, options);
  }
  return out;
}

std::string format_figures(const std::vector<Figure>& figures) {
  std::string out = fmt::format("{:<34} {:<40} {:>12} {:<11} {:>9}  {:<30} {}\n", "figure", "case",
                                "value", "unit", "ratio", "target", "");
  std::string group;
  for (const Figure& f : figures) {
    // Two decimals, or two significant digits below 0.1 (a 0.4% share is not "0.00").
    const std::string ratio = f.ratio == 0               ? ""
                              : std::fabs(f.ratio) < 0.1 ? fmt::format("{:.2g}", f.ratio)
                                                         : fmt::format("{:.2f}", f.ratio);
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
  return array.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

int figures_status(const std::vector<Figure>& figures) {
  const bool failed = std::any_of(figures.begin(), figures.end(),
                                  [](const Figure& f) { return !f.target.empty() && !f.pass; });
  return failed ? 1 : 0;
}

std::string figures_chart(const std::vector<Figure>& figures) {
  std::vector<const Figure*> rows;
  for (const Figure& f : figures) {  // a failure with no ratio (nothing measured) too, at 0.01
    if (f.ratio > 0 || (!f.target.empty() && !f.pass)) rows.push_back(&f);
  }
  const double row_height = 18, top = 60, label_width = 600, bar_left = 20 + label_width;
  const double bar_width = 320, width = bar_left + bar_width + 110;
  const double height = top + row_height * static_cast<double>(rows.size()) + 20;
  // log10 of the ratio from -2 (0.01) to 3 (1000) across the bar's width.
  const auto x = [&](double ratio) {
    return bar_left + bar_width * std::clamp((std::log10(ratio) + 2) / 5, 0.0, 1.0);
  };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"20\" y=\"22\" font-size=\"15\">kvsnap bench: each figure's ratio against its "
      "limit (log scale)</text>\n<text x=\"20\" y=\"40\">green: passes its target; red: "
      "fails it; grey: no target (hover a bar for its meaning and target)</text>\n",
      width, height);
  for (int decade = -2; decade <= 3; ++decade) {
    const double at = x(std::pow(10.0, decade));
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1}\" y2=\"{2}\" stroke=\"#ddd\"/>"
        "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4}</text>\n",
        at, top - 4, height - 16, top - 8, std::pow(10.0, decade));
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const Figure& f = *rows[i];
    const double y = top + row_height * static_cast<double>(i);
    const std::string verdict = f.target.empty() ? "" : f.pass ? "PASS" : "FAIL";
    const char* colour = f.target.empty() ? "#999" : f.pass ? "#3a7" : "#c44";
    svg += fmt::format(
        "<text x=\"20\" y=\"{0:.1f}\">{1}</text><rect x=\"{2:.1f}\" y=\"{3:.1f}\" "
        "width=\"{4:.1f}\" height=\"12\" fill=\"{5}\"><title>{6}</title></rect>"
        "<text x=\"{7:.1f}\" y=\"{0:.1f}\">{8:.2f} {9}</text>\n",
        y + 10, tools::xml_escape(f.group + ": " + f.name), bar_left, y, x(f.ratio) - bar_left,
        colour,
        tools::xml_escape(fmt::format("{:.3g} {}{}", f.ratio, f.ratio_meaning,
                                      f.target.empty() ? "" : "; target " + f.target)),
        x(f.ratio) + 4, f.ratio, verdict);
  }
  return svg + "</svg>\n";
}

}  // namespace kvsnap::bench
