// The Python module's shared pieces: the snapshot wrapper every part hands out, and the
// functions that register each part on the module.
#pragma once

#include <kvsnap/kvsnap.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "numpy_arrays.h"

namespace kvsnap::python {

// kvsnap.Snapshot: owns a SnapshotPtr until a consuming call (merge, split) takes it; after
// that every use raises kvsnap.Error naming the call that consumed it.
class PySnapshot {
 public:
  explicit PySnapshot(SnapshotPtr snapshot) : snapshot_(std::move(snapshot)) {}

  // The snapshot, or Error naming `call` when it was consumed.
  Snapshot& get(const char* call) const;
  // Takes the snapshot out for `consumer` (e.g. "KVCache.merge"); Error when already taken.
  SnapshotPtr take(const char* consumer);
  bool consumed() const { return snapshot_ == nullptr; }

 private:
  SnapshotPtr snapshot_;
  std::string consumer_;
};

// A Python value for a snapshot a call returned: a kvsnap.Snapshot, or None for a null one.
std::unique_ptr<PySnapshot> wrap_snapshot(SnapshotPtr snapshot);

// The caches of `layers`, a tuple made once of the caller's sequence (so that no Python code
// runs, and no layer is dropped, between taking the pointers and using them; the tuple keeps
// them alive): None for a stateless layer gives null. Error naming `call` for an item that is
// neither a kvsnap cache nor None.
std::vector<Cache*> to_layers(const py::tuple& layers, const char* call);

void bind_batch_and_history(py::module_& module);
void bind_caches(py::module_& module);
void bind_prefix(py::module_& module);
void bind_speculation(py::module_& module);
void bind_ops(py::module_& module);

}  // namespace kvsnap::python
