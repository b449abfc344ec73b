// kvsnap.Speculation: exact rollback of a verified chunk of drafts, for every cache kind.
#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <vector>

#include "bindings.h"

namespace kvsnap::python {
namespace {

// A Speculation and the Python caches it rolls back, kept alive as long as it is. `mutex` makes
// its calls from several threads run one at a time (taken with the GIL released: they wait for
// the layers' locks).
struct PySpeculation {
  // Cancelling an open round waits for the layers' locks: without the GIL.
  ~PySpeculation() {
    let_go_without_gil([&] { speculation.reset(); });
  }

  ReleaseDeferredLast release_last;  // gives back what the members let go of
  py::tuple layers;                  // destroyed after `speculation` (declared first)
  std::mutex mutex;
  std::unique_ptr<Speculation> speculation;  // its destructor cancels an open round
};

std::unique_ptr<PySpeculation> make_speculation(const py::sequence& layers, SeqId seq) {
  py::tuple held(layers);  // one pass over the caller's sequence
  const std::vector<Cache*> caches = to_layers(held, "Speculation");
  auto speculation = without_gil([&] { return std::make_unique<Speculation>(caches, seq); });
  return std::unique_ptr<PySpeculation>(new PySpeculation{{}, held, {}, std::move(speculation)});
}

// Runs `call` on the speculation with the GIL released and its mutex held.
template <class Call>
auto on_round(PySpeculation& s, Call&& call) {
  return without_gil([&] {
    const std::lock_guard<std::mutex> lock(s.mutex);
    return std::forward<Call>(call)(*s.speculation);
  });
}

}  // namespace

void bind_speculation(py::module_& m) {
  py::class_<PySpeculation>(m, "Speculation", R"(Exact rollback of a verified chunk of drafts.

begin(k) before the verify forward of the last accepted token and k drafts at the layers'
common offset; accept(a) after it, when the model confirmed the first a drafts: every layer
then stands at start + a + 1 without recomputing anything — attention layers rewind,
whole-state layers (a window past its size, a recurrent state) restore what the forward
captured. With a prefix cache session, append only the accepted tokens, or append the drafts
and retract_outputs() the rejected ones.)")
      .def(py::init(&make_speculation), py::arg("layers"), py::kw_only(),
           py::arg("seq").noconvert() = 0,
           "Rounds over sequence `seq` of `layers` (the model's caches in order, None for a "
           "stateless layer; a cache listed twice is one state, rolled back once).")
      .def(
          "begin",
          [](PySpeculation& s, int64_t drafts) {
            on_round(s, [&](Speculation& round) { round.begin(drafts); });
          },
          py::arg("drafts").noconvert(),
          "Opens a round before the verify forward of 1 + `drafts` tokens. Raises Error, "
          "changing nothing, for drafts < 0 or > 2^20, a round ending past position 2^31 - 1, "
          "an open round, layers that disagree on their offset, or a layer of any kind with "
          "captures already scheduled for the sequence.")
      .def(
          "accept",
          [](PySpeculation& s, int64_t accepted) {
            on_round(s, [&](Speculation& round) { round.accept(accepted); });
          },
          py::arg("accepted").noconvert(),
          "Closes the round: the first `accepted` drafts were confirmed. Every layer is checked "
          "before any moves: raises Error, the round left open and nothing changed, unless 0 <= "
          "accepted <= drafts, every layer stands at the verify forward's end, and every layer "
          "that must move can (one that rewinds has no schedule: someone else's must be taken "
          "or cancelled first; a capturing one still holds the round's captures: if another "
          "call took or replaced them, only cancel() ends the round).")
      .def(
          "cancel",
          [](PySpeculation& s) { on_round(s, [](Speculation& round) { round.cancel(); }); },
          "Drops an open round's captures without moving any layer (a schedule that replaced "
          "the round's is someone else's and stays).")
      .def_property_readonly(
          "open",
          [](PySpeculation& s) {
            return on_round(s, [](Speculation& round) { return round.open(); });
          },
          "Whether a round is open.")
      .def_property_readonly(
          "start",
          [](PySpeculation& s) {
            return on_round(s, [](Speculation& round) { return round.start(); });
          },
          "The open round's start offset (once it closed, the last round's; 0 before any).")
      .def_property_readonly(
          "drafts",
          [](PySpeculation& s) {
            return on_round(s, [](Speculation& round) { return round.drafts(); });
          },
          "The open round's draft count (once it closed, the last round's; 0 before any).")
      .def_property_readonly(
          "capturing_layers",
          [](PySpeculation& s) {
            return on_round(s, [](Speculation& round) { return round.capturing_layers(); });
          },
          "Layers that capture in the open round (whole-state layers that cannot rewind).")
      .def("stats", [](PySpeculation& s) {
        return on_round(s, [](Speculation& round) { return round.stats(); });
      });

  py::class_<Speculation::Stats>(m, "SpeculationStats", "The rounds so far.")
      .def_readonly("rounds", &Speculation::Stats::rounds, "Accepted rounds.")
      .def_readonly("drafted", &Speculation::Stats::drafted, "Draft tokens verified.")
      .def_readonly("accepted", &Speculation::Stats::accepted, "Of them, confirmed.")
      .def_readonly("restores", &Speculation::Stats::restores, "Layer restores from a capture.")
      .def_readonly("rewinds", &Speculation::Stats::rewinds, "Layer offset rewinds.");
}

}  // namespace kvsnap::python
