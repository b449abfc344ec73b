// The headline figures of `kvsnap bench`: each measured operation as a ratio against a limit
// measured in the same run (memcpy of the same bytes, or recomputation), with its target.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace kvsnap::bench {

struct Figure {
  std::string group;          // "decode append"
  std::string name;           // "KVCache"
  double value = 0;           // the measurement, in `unit`
  std::string unit;           // "ns/token"
  double ratio = 0;           // against the limit; meaning in `ratio_meaning`
  std::string ratio_meaning;  // "x memcpy time"
  std::string target;         // "<= 3x memcpy + 200 ns" (empty: reported, no target)
  bool pass = true;
  std::string note;
};

struct BenchOptions {
  bool end_to_end = true;  // include the replays, sequential and parallel (the slowest figures)
  // Every figure's code at small sizes (a layer of 1 head of depth 8, a model of ~20k parameters, a
  // few short requests, each timing one call), so a test runs it all in seconds: the values mean
  // nothing.
  bool smoke = false;
  std::function<void(const std::string&)> progress = [](const std::string&) {};
};

std::vector<Figure> run_figures(const BenchOptions&);

std::string format_figures(const std::vector<Figure>&);
std::string figures_json(const std::vector<Figure>&);
// An SVG chart of every figure with a ratio: a bar per figure on a log scale (0.01 to 1000),
// green when it passes its target, red when it fails it, grey without one.
std::string figures_chart(const std::vector<Figure>&);
// The exit status of `kvsnap bench`: 0 when every figure with a target passes it, else 1.
int figures_status(const std::vector<Figure>&);

}  // namespace kvsnap::bench
