// kvsnap.PrefixCache and its sessions, and snapshot files (save_snapshots, load_snapshots).
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <mutex>
#include <optional>
#include <vector>

#include "bindings.h"

namespace kvsnap::python {
namespace {

// The prefix cache and the Python caches it drives, kept alive as long as it is. Thread-safe
// itself: its calls run with the GIL released.
struct PyPrefixCache {
  // The trie goes (its snapshots may wait for the layers' locks) without the GIL.
  ~PyPrefixCache() {
    let_go_without_gil([&] { prefix.reset(); });
  }

  ReleaseDeferredLast release_last;     // gives back what the ones below let go of
  py::tuple layers;                     // destroyed after `prefix` (declared first)
  py::object tier;                      // the kvsnap.Tier, or None
  std::unique_ptr<PrefixCache> prefix;  // drives the layers' offsets from now on
};

// A session and the prefix cache it belongs to (kept alive: a session may outlive every other
// reference to it). `mutex` makes the session's calls from several threads run one at a time
// (taken with the GIL released).
struct PySession {
  // A session dropped open is closed (it pages out under the prefix cache's lock) without the GIL.
  ~PySession() {
    let_go_without_gil([&] {
      try {
        session.close();
      } catch (...) {  // as ~Session: close() left the cache consistent
      }
    });
  }

  ReleaseDeferredLast release_last;
  py::object owner;
  std::mutex mutex;
  PrefixCache::Session session;
};

std::unique_ptr<PyPrefixCache> make_prefix_cache(const py::sequence& layers,
                                                 std::optional<int64_t> budget, SeqId slots,
                                                 const py::object& tier) {
  PrefixCache::Options options;
  if (budget) options.max_paged_out_bytes = *budget;
  options.slots = slots;
  if (!tier.is_none()) {
    if (!py::isinstance<PyTier>(tier)) {
      throw Error(fmt::format("PrefixCache: tier must be a kvsnap.Tier or None, not {}",
                              Py_TYPE(tier.ptr())->tp_name));
    }
    options.tier = tier.cast<const PyTier&>().tier;
  }
  py::tuple held(layers);  // one pass over the caller's sequence
  const std::vector<Cache*> caches = to_layers(held, "PrefixCache");
  auto prefix = without_gil([&] { return std::make_unique<PrefixCache>(caches, options); });
  return std::unique_ptr<PyPrefixCache>(new PyPrefixCache{{}, held, tier, std::move(prefix)});
}

// Runs `call` on the session with the GIL released and its mutex held.
template <class Call>
auto on_session(PySession& s, Call&& call) {
  return without_gil([&] {
    const std::lock_guard<std::mutex> lock(s.mutex);
    return std::forward<Call>(call)(s.session);
  });
}

void bind_session(py::module_& m) {
  py::class_<PySession>(m, "Session", R"(One request's use of the prefix cache.

Evaluate remaining() from offset cached(), call prefill_done(), then append_output() for each
generated token the model evaluates; close() (or leaving a `with` block) pages the evaluated
tokens out into the trie.)")
      .def(
          "remaining",
          [](PySession& s) {
            const std::vector<int32_t> tokens = on_session(s, [](PrefixCache::Session& session) {
              const std::span<const int32_t> remaining = session.remaining();
              return std::vector<int32_t>(remaining.begin(), remaining.end());
            });
            return py::array_t<int32_t>(static_cast<py::ssize_t>(tokens.size()), tokens.data());
          },
          "The prompt tokens the model must still evaluate (an int32 copy).")
      .def_property_readonly(
          "cached",
          [](PySession& s) {
            return on_session(s, [](auto& session) { return session.cached(); });
          },
          "Tokens restored from the cache: the live caches stand at this offset.")
      .def_property_readonly(
          "slot",
          [](PySession& s) { return on_session(s, [](auto& session) { return session.slot(); }); },
          "The slot (the layers' sequence) this session runs on.")
      .def(
          "schedule_snapshots",
          [](PySession& s, const std::vector<int64_t>& offsets) {
            on_session(s, [&](auto& session) { session.schedule_snapshots(offsets); });
          },
          py::arg("offsets").noconvert(),
          "Extra restore points in [cached, prompt size], before prefill: user nodes.")
      .def(
          "schedule_branch_points",
          [](PySession& s, const std::vector<int64_t>& offsets) {
            on_session(s, [&](auto& session) { session.schedule_branch_points(offsets); });
          },
          py::arg("offsets").noconvert(),
          "Restore points that are guesses (where other prompts may leave this one), in "
          "[cached, prompt size], before prefill: ordinary nodes, evicted like any other.")
      .def(
          "prefill_done",
          [](PySession& s) { on_session(s, [](auto& session) { session.prefill_done(); }); },
          "Call after the prefill forward over remaining().")
      .def(
          "append_output",
          [](PySession& s, int32_t token) {
            on_session(s, [&](auto& session) { session.append_output(token); });
          },
          py::arg("token").noconvert(), "A generated token (an int: not a float, taken whole).")
      .def(
          "retract_outputs",
          [](PySession& s, int64_t count) {
            on_session(s, [&](auto& session) { session.retract_outputs(count); });
          },
          py::arg("count").noconvert(),
          "Takes back the last `count` generated tokens (drafts the verification rejected; "
          "never paged out). Raises Error, changing nothing, unless decoding, 0 <= count <= "
          "the tokens generated so far, and the layers stand at or past the prompt's end.")
      .def(
          "close", [](PySession& s) { on_session(s, [](auto& session) { session.close(); }); },
          "Pages the evaluated tokens out and ends the session (idempotent).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PySession& s, py::args) { on_session(s, [](auto& session) { session.close(); }); });
}

// What the trie holds and has done: bytes, nodes, counters, checks.
void bind_prefix_cache_state(py::class_<PyPrefixCache>& prefix) {
  prefix
      .def_property_readonly("paged_out_bytes",
                             [](const PyPrefixCache& c) {
                               return without_gil([&] { return c.prefix->paged_out_bytes(); });
                             })
      .def_property_readonly(
          "peak_paged_out_bytes",
          [](const PyPrefixCache& c) {
            return without_gil([&] { return c.prefix->peak_paged_out_bytes(); });
          },
          "The most bytes the trie's snapshots held at any instant since the cache was made or "
          "reset_peak_paged_out_bytes() last ran: what the budget bounds.")
      .def(
          "reset_peak_paged_out_bytes",
          [](PyPrefixCache& c) { c.prefix->reset_peak_paged_out_bytes(); }, Released(),
          "Starts a new peak measurement from the bytes held now.")
      .def_property_readonly("node_count",
                             [](const PyPrefixCache& c) {
                               return without_gil([&] { return c.prefix->node_count(); });
                             })
      .def(
          "stats", [](const PyPrefixCache& c) { return c.prefix->stats(); }, Released())
      .def(
          "check_invariants", [](const PyPrefixCache& c) { return c.prefix->check_invariants(); },
          Released(), "Empty when the trie's invariants hold, else the first violation.")
      .def(
          "debug_string", [](const PyPrefixCache& c) { return c.prefix->debug_string(); },
          Released());
}

void bind_prefix_cache(py::module_& m) {
  py::class_<PyPrefixCache> prefix(m, "PrefixCache",
                                   R"(Reuse inference state across requests that share a prefix.

A compressed token trie whose nodes hold per-layer snapshots. `layers` are the model's caches
in order (None for a stateless layer); the prefix cache drives their offsets from now on.)");
  prefix
      .def(py::init(&make_prefix_cache), py::arg("layers"),
           py::arg("max_paged_out_bytes").noconvert() = py::none(),
           py::arg("slots").noconvert() = 1, py::kw_only(), py::arg("tier") = py::none(),
           "Budget for snapshot bytes in the trie (default 8 GiB); `slots` sequences of the "
           "layers served at once, each with at most one open session; `tier`: a kvsnap.Tier "
           "opened for these layers, asked on a miss and written behind.")
      .def(
          "begin",
          [](py::object self, const std::vector<int32_t>& prompt, SeqId slot) {
            PrefixCache& prefix = *self.cast<PyPrefixCache&>().prefix;
            PrefixCache::Session session = without_gil([&] { return prefix.begin(slot, prompt); });
            return std::unique_ptr<PySession>(new PySession{{}, self, {}, std::move(session)});
          },
          py::arg("prompt").noconvert(), py::kw_only(), py::arg("slot").noconvert() = 0,
          "Starts a request on `slot` (one session per slot at a time). Token ids are ints (a "
          "list, or a numpy array of an integer dtype); anything else raises TypeError.")
      .def(
          "match",
          [](const PyPrefixCache& c, const std::vector<int32_t>& prompt,
             std::optional<SeqId> slot) {
            return slot ? c.prefix->match(*slot, prompt) : c.prefix->match(prompt);
          },
          py::arg("prompt").noconvert(), py::kw_only(), py::arg("slot").noconvert() = py::none(),
          Released(),
          "Prompt tokens begin would restore (from the trie alone, or on `slot` as it stands); "
          "changes nothing.")
      .def_property_readonly("slots", [](const PyPrefixCache& c) { return c.prefix->slots(); })
      .def(
          "save",
          [](const PyPrefixCache& c, const std::string& dir, const std::string& model_id,
             bool shared) { c.prefix->save(dir, model_id, SaveOptions{.shared = shared}); },
          py::arg("dir"), py::arg("model_id") = "", py::kw_only(), py::arg("shared") = false,
          Released(),
          "Writes the trie and its snapshots to `dir`: a file of mode 0600, or 0644 when shared "
          "(a folder whose other users load it, with allow_shared). Without shared, a `dir` load "
          "would refuse (another user owns it, group or others can write it) is refused, and "
          "nothing is written.")
      .def(
          "load",
          [](PyPrefixCache& c, const std::string& dir, const std::string& model_id,
             bool allow_shared) {
            c.prefix->load(dir, model_id, LoadOptions{.allow_shared = allow_shared});
          },
          py::arg("dir"), py::arg("model_id") = "", py::kw_only(), py::arg("allow_shared") = false,
          Released(),
          "Replaces the trie by the one saved in `dir` (same layers and model_id). Refuses a "
          "`dir` or file another user owns or others can write unless allow_shared.")
      .def_static(
          "saved_in",
          [](const std::string& dir, bool allow_shared) {
            return PrefixCache::saved_in(dir, LoadOptions{.allow_shared = allow_shared});
          },
          py::arg("dir"), py::kw_only(), py::arg("allow_shared") = false, Released());
  bind_prefix_cache_state(prefix);
}

void bind_prefix_stats(py::module_& m) {
  py::class_<PrefixCache::Stats>(m, "PrefixStats", "What the prefix cache has done so far.")
      .def_readonly("lookups", &PrefixCache::Stats::lookups)
      .def_readonly("matched_tokens", &PrefixCache::Stats::matched_tokens)
      .def_readonly("reused_tokens", &PrefixCache::Stats::reused_tokens)
      .def_readonly("evicted_nodes", &PrefixCache::Stats::evicted_nodes)
      .def_readonly("dropped_snapshots", &PrefixCache::Stats::dropped_snapshots)
      .def_readonly("loaded_nodes", &PrefixCache::Stats::loaded_nodes)
      .def_readonly("paged_out_bytes", &PrefixCache::Stats::paged_out_bytes)
      .def_readonly("nodes", &PrefixCache::Stats::nodes);
}

// Item `i` of save_snapshots' list: a snapshot, or null for None.
PySnapshot::Use snapshot_item(py::handle item, size_t i) {
  if (item.is_none()) return PySnapshot::Use(nullptr, "save_snapshots");
  if (!py::isinstance<PySnapshot>(item)) {
    throw Error(
        fmt::format("save_snapshots: snapshots[{}] has type {}; need a kvsnap.Snapshot or None", i,
                    Py_TYPE(item.ptr())->tp_name));
  }
  return PySnapshot::Use(&item.cast<const PySnapshot&>(), "save_snapshots");
}

void bind_files(py::module_& m) {
  m.def(
      "save_snapshots",
      [](const std::string& path, int64_t offset, const py::sequence& snapshots, bool shared) {
        // One pass over the caller's sequence: no Python code runs (none can drop or consume a
        // snapshot) between taking the pointers and the save, and the tuple keeps them alive.
        const py::tuple items(snapshots);
        std::vector<PySnapshot::Use> uses;  // no other thread consumes them during the save
        std::vector<const Snapshot*> pointers;
        for (size_t i = 0; i < items.size(); ++i) {
          uses.push_back(snapshot_item(items[i], i));
          pointers.push_back(uses.back().get());
        }
        without_gil([&] {
          save_snapshots(path, offset, std::span<const Snapshot* const>(pointers),
                         SaveOptions{.shared = shared});
        });
      },
      py::arg("path"), py::arg("offset").noconvert(), py::arg("snapshots"), py::kw_only(),
      py::arg("shared") = false,
      "Writes one snapshot per layer (None allowed) to a safetensors file, atomically: mode 0600, "
      "or 0644 when shared (a folder whose other users load it, with allow_shared). Without "
      "shared, a folder load_snapshots would refuse (another user owns it, group or others can "
      "write it) is refused, and nothing is written.");
  m.def(
      "load_snapshots",
      [](const std::string& path, bool allow_shared) {
        LoadedSnapshots loaded = without_gil(
            [&] { return load_snapshots(path, LoadOptions{.allow_shared = allow_shared}); });
        py::list snapshots;
        for (SnapshotPtr& s : loaded.snapshots)
          snapshots.append(py::cast(wrap_snapshot(std::move(s))));
        return py::make_tuple(loaded.offset, snapshots);
      },
      py::arg("path"), py::kw_only(), py::arg("allow_shared") = false,
      "Reads a snapshot file: (offset, [Snapshot or None per layer]). Refuses a file, or its "
      "folder, that another user owns or others can write unless allow_shared.");
}

}  // namespace

void bind_prefix(py::module_& m) {
  bind_session(m);
  bind_prefix_cache(m);
  bind_prefix_stats(m);
  bind_files(m);
}

}  // namespace kvsnap::python
