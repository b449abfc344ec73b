#include "figures.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "figure_parts.h"
#include "model/weights.h"
#include "ops/kernel_report.h"

namespace kvsnap::bench {
namespace {

void memcpy_figures(std::vector<Figure>& out) {
  for (int64_t mib : {1, 4, 16, 64, 256}) {
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
}

}  // namespace

double memcpy_ns(int64_t bytes) {
  CopyBuffers buffers(bytes);
  return time_ns([&] { buffers.copy(); });
}

double memcpy_fresh_ns(int64_t bytes) {
  std::vector<char> source(static_cast<size_t>(bytes), 1);
  return time_ns(
      [&] {
        void* fresh = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        std::memcpy(fresh, source.data(), source.size());
        ::munmap(fresh, static_cast<size_t>(bytes));
      },
      0.05, 3);
}

std::vector<Figure> run_figures(const BenchOptions& options) {
  std::vector<Figure> out;
  const Shape shape;
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
  options.progress("prefix trie");
  trie_figures(out);
  options.progress("built-in model");
  model_figures(out);
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
  return array.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace kvsnap::bench
