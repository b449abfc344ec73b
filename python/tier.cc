// kvsnap.Tier: the shared tier (kvsnap/tier.h) from Python — opened over a store address for a
// list of layers and handed to a PrefixCache (tier=...), which asks it on a miss and writes what
// sessions evaluate behind them, so other processes (and restarts) restore instead of
// recomputing.
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <mutex>

#include "bindings.h"

namespace kvsnap::python {
namespace {

// The tier's log: each line kept for take_log (the newest kLines) and written to stderr unless
// quiet. The tier logs from any thread, its writer's included, so nothing here touches Python.
class LogBook {
 public:
  explicit LogBook(bool to_stderr) : to_stderr_(to_stderr) {}
  void add(const std::string& line) {
    if (to_stderr_) fmt::print(stderr, "kvsnap tier: {}\n", line);
    const std::lock_guard<std::mutex> lock(mutex_);
    if (lines_.size() == kLines) lines_.pop_front();
    lines_.push_back(line);
  }
  std::vector<std::string> take() {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out(lines_.begin(), lines_.end());
    lines_.clear();
    return out;
  }

 private:
  static constexpr size_t kLines = 1024;
  const bool to_stderr_;
  std::mutex mutex_;
  std::deque<std::string> lines_;
};

// `seconds` as milliseconds, or Error naming the option: Tier::open takes [0, 24 h].
std::chrono::milliseconds milliseconds(double seconds, const char* option) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds > 86400) {
    throw Error(
        fmt::format("Tier: {} {} s is not a number of seconds in [0, 86400]", option, seconds));
  }
  return std::chrono::milliseconds(std::llround(seconds * 1000));
}

struct TierArguments {
  std::string model_fingerprint, tenant, key;
  int64_t chunk_tokens, max_object_bytes, max_lookup_bytes;
  double lookup_timeout, write_timeout, retry_interval;
  int64_t ttl, write_queue, write_queue_bytes;
};

TierOptions to_options(const TierArguments& a) {
  TierOptions options;
  options.model_fingerprint = a.model_fingerprint;
  options.tenant = a.tenant;
  options.key = a.key;
  options.chunk_tokens = a.chunk_tokens;
  options.max_object_bytes = a.max_object_bytes;
  options.max_lookup_bytes = a.max_lookup_bytes;
  options.lookup_timeout = milliseconds(a.lookup_timeout, "lookup_timeout");
  options.write_timeout = milliseconds(a.write_timeout, "write_timeout");
  options.retry_interval = milliseconds(a.retry_interval, "retry_interval");
  options.ttl = std::chrono::seconds(a.ttl);
  options.write_queue = a.write_queue;
  options.write_queue_bytes = a.write_queue_bytes;
  return options;
}

std::unique_ptr<PyTier> open_tier(const std::string& address, const py::sequence& layers,
                                  const TierArguments& arguments, bool log_to_stderr) {
  TierOptions options = to_options(arguments);
  auto log = std::make_shared<LogBook>(log_to_stderr);
  options.log = [log](const std::string& line) { log->add(line); };
  py::tuple held(layers);
  const std::vector<Cache*> caches = to_layers(held, "Tier");
  std::shared_ptr<Tier> tier =
      without_gil([&] { return Tier::open(address, caches, std::move(options)); });
  return std::unique_ptr<PyTier>(
      new PyTier{{}, held, std::move(tier), [log] { return log->take(); }});
}

void bind_stats(py::module_& m) {
  py::class_<TierStats>(m, "TierStats", "A tier's counters since it opened.")
      .def_readonly("lookups", &TierStats::lookups,
                    "Lookups with something to ask the store (TierStats in tier.h).")
      .def_readonly("hits", &TierStats::hits, "Lookups that returned a restore point.")
      .def_readonly("restored_tokens", &TierStats::restored_tokens,
                    "Tokens the restore points added to what their callers held.")
      .def_readonly("bytes_read", &TierStats::bytes_read)
      .def_readonly("bytes_written", &TierStats::bytes_written)
      .def_readonly("timeouts", &TierStats::timeouts, "Lookups cut short by lookup_timeout.")
      .def_readonly("rejected", &TierStats::rejected,
                    "Objects damaged, truncated, foreign or unauthenticated.")
      .def_readonly("unauthenticated", &TierStats::unauthenticated,
                    "Of those, objects without a valid MAC.")
      .def_readonly("objects_written", &TierStats::objects_written)
      .def_readonly("dropped_batches", &TierStats::dropped_batches,
                    "Write batches dropped (queue full, store failed, out of memory).")
      .def_readonly("store_errors", &TierStats::store_errors,
                    "Failed connections, round trips or refused writes.")
      .def_readonly("caller_microseconds", &TierStats::caller_microseconds,
                    "Time lookups and stores took on the callers' threads.");
}

}  // namespace

PyTier::~PyTier() {
  let_go_without_gil([&] { tier.reset(); });  // waits for the queued writes (write_timeout)
}

void bind_tier(py::module_& m) {
  bind_stats(m);
  py::class_<PyTier>(m, "Tier", R"(A store of restore points shared by processes (kvsnap/tier.h).

Tier(address, layers, model_fingerprint=...) opens "dir:PATH" (a private folder) or
"redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]" for `layers` (the PrefixCache's own list); pass it
as PrefixCache(layers, tier=tier). A slow, failing or hostile store costs restores, never a
request: lookups wait at most lookup_timeout seconds, writes go behind on the tier's own thread.
Without `key` (load_tier_key) the store is trusted: damage is caught, forgery is not.)")
      .def(py::init([](const std::string& address, const py::sequence& layers,
                       const std::string& model_fingerprint, const std::string& tenant,
                       const std::optional<py::bytes>& key, int64_t chunk_tokens,
                       int64_t max_object_bytes, int64_t max_lookup_bytes, double lookup_timeout,
                       double write_timeout, double retry_interval, int64_t ttl,
                       int64_t write_queue, int64_t write_queue_bytes, bool log_to_stderr) {
             // An empty key would open the tier unauthenticated: only None asks for that (an
             // unset variable's os.environ.get("K", "").encode() must not).
             if (key && py::len(*key) == 0) {
               throw Error(
                   "Tier: key is empty; a MAC key holds at least 16 bytes (None: a trusted store)");
             }
             return open_tier(address, layers,
                              {model_fingerprint, tenant, key ? std::string(*key) : std::string(),
                               chunk_tokens, max_object_bytes, max_lookup_bytes, lookup_timeout,
                               write_timeout, retry_interval, ttl, write_queue, write_queue_bytes},
                              log_to_stderr);
           }),
           py::arg("address"), py::arg("layers"), py::kw_only(), py::arg("model_fingerprint"),
           py::arg("tenant") = "", py::arg("key") = py::none(),
           py::arg("chunk_tokens").noconvert() = 256,
           py::arg("max_object_bytes").noconvert() = int64_t(512) << 20,
           py::arg("max_lookup_bytes").noconvert() = int64_t(8) << 30,
           py::arg("lookup_timeout") = 0.05, py::arg("write_timeout") = 2.0,
           py::arg("retry_interval") = 0.5, py::arg("ttl").noconvert() = 86400,
           py::arg("write_queue").noconvert() = 64,
           py::arg("write_queue_bytes").noconvert() = int64_t(1) << 30,
           py::arg("log_to_stderr") = true,
           "model_fingerprint: what makes stored state valid (the model's configuration and "
           "weights, or a hash of them); tenant: the operator's isolation salt; key: MAC key "
           "bytes (load_tier_key), None for a trusted store (empty bytes are refused); times in "
           "seconds. Never fails "
           "because the store is unreachable (lookups miss until it answers). Dropping the "
           "tier waits for its queued writes (at most write_timeout): on the main thread with "
           "the GIL released, on another with it held.")
      .def(
          "stats", [](const PyTier& t) { return t.tier->stats(); }, Released())
      .def(
          "flush",
          [](const PyTier& t, double timeout) {
            const std::chrono::milliseconds wait = milliseconds(timeout, "flush timeout");
            return without_gil([&] { return t.tier->flush(wait); });
          },
          py::arg("timeout") = 10.0,
          "Waits until every queued write has been tried (at most `timeout` seconds); True "
          "when drained.")
      .def(
          "take_log", [](const PyTier& t) { return t.take_log(); },
          "The lines the tier logged since the last call (the newest 1024), oldest first.")
      .def_property_readonly(
          "address", [](const PyTier& t) { return t.tier->address(); },
          "The address, any password replaced by ***.")
      .def_property_readonly(
          "authenticated", [](const PyTier& t) { return t.tier->authenticated(); },
          "Whether objects carry a MAC (a key was given).");
  m.def(
      "load_tier_key",
      [](const std::string& path) {
        std::string key = without_gil([&] { return load_tier_key(path); });
        return py::bytes(key);
      },
      py::arg("path"),
      "A MAC key from a private file (this user's, mode 0600, in a folder others cannot write, "
      "16 bytes to 1 MiB), for Tier(key=...).");
  m.def("load_tier_address", &load_tier_address, py::arg("path"), Released(),
        "A tier address (which may hold a Redis password) from a file checked as load_tier_key "
        "checks key files.");
}

}  // namespace kvsnap::python
