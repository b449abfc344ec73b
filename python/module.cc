// The Python module `kvsnap`: kvsnap's caches, snapshots, prefix cache, snapshot files and
// reference kernels over numpy arrays, without copies where the layout allows.
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(kvsnap, m) {
  namespace py = pybind11;
  using namespace kvsnap::python;
  m.doc() = R"(kvsnap: snapshot, rewind, branch and reuse the inference state of language models.

Caches take numpy arrays (keys and values [B, H, L, D], recurrent states) without copying where
the layout allows, and hand their buffers back as read-only numpy views. Every contract
violation raises kvsnap.Error with kvsnap's message; the object is then unchanged. Objects are
not thread-safe: use a cache, its snapshots and its prefix cache from one thread at a time.)";
  m.attr("__version__") = "0.1.0";
  py::register_exception<kvsnap::Error>(m, "Error").attr("__doc__") =
      "A contract violation or bad data. The message is kvsnap's (the call, the values, the "
      "rule); the object is unchanged.";
  bind_arrays(m);
  bind_batch_and_history(m);
  bind_caches(m);
  bind_prefix(m);
  bind_speculation(m);
  bind_ops(m);
}
