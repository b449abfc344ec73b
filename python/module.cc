// The Python module `kvsnap`: kvsnap's caches, snapshots, prefix cache, snapshot files and
// reference kernels over numpy arrays, without copies where the layout allows.
#include <fmt/format.h>
#include <pybind11/pybind11.h>

#include <cstdlib>
#include <string>

#include "bindings.h"

PYBIND11_MODULE(kvsnap, m) {
  namespace py = pybind11;
  using namespace kvsnap::python;
#if PYBIND11_VERSION_MAJOR == 2 && PYBIND11_VERSION_MINOR < 12
  // pybind11 before 2.12 reads a numpy dtype's item size where numpy 2 keeps its flags: every
  // array would be misread (or a division by zero). Refused at import instead.
  const auto numpy = py::module_::import("numpy").attr("__version__").cast<std::string>();
  if (std::atoi(numpy.c_str()) >= 2) {
    throw py::import_error(fmt::format(
        "kvsnap: built with pybind11 {}.{}, which misreads numpy {}'s arrays: use numpy < 2, or "
        "build with pybind11 >= 2.12",
        PYBIND11_VERSION_MAJOR, PYBIND11_VERSION_MINOR, numpy));
  }
#endif
  m.doc() = R"(kvsnap: snapshot, rewind, branch and reuse the inference state of language models.

Caches take numpy arrays (keys and values [B, H, L, D], recurrent states) without copying where
the layout allows, and hand their buffers back as read-only numpy views. Every contract
violation raises kvsnap.Error with kvsnap's message; the object is then unchanged (merge and
split consume their snapshots whatever happens once they start; a refusal before that — the
same snapshot twice, one already consumed or in use on another thread — consumes none). An argument of the wrong Python type — a
float for an int, or an int outside the C type it goes to (a sequence id past 2^31 - 1) —
raises TypeError before any call.

Threads: calls that work or wait for a cache's lock (cache, prefix cache, session, speculation
calls, the kernels, snapshot files) release the GIL, so Python threads overlap them. Caches and
prefix caches lock themselves: their calls may come from several threads (a prefix cache's
slots each on its own thread); a session's and a speculation's calls from several threads run
one at a time. A snapshot may be read, restored from and saved (save_snapshots) on any thread,
also while another thread writes the sequence it was taken from: a lazy snapshot's tokens are
read under its cache's lock. merge and split, which consume a snapshot, raise kvsnap.Error while
a call on another thread is using it.)";
  m.attr("__version__") = KVSNAP_VERSION;
  py::register_exception<kvsnap::Error>(m, "Error").attr("__doc__") =
      "A contract violation or bad data. The message is kvsnap's (the call, the values, the "
      "rule); the object is unchanged.";
  prepare_for_exit();
  bind_arrays(m);
  bind_batch_and_history(m);
  bind_caches(m);
  bind_tier(m);
  bind_prefix(m);
  bind_speculation(m);
  bind_ops(m);
}
