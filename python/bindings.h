// The Python module's shared pieces: the snapshot wrapper every part hands out, and the
// functions that register each part on the module.
#pragma once

#include <kvsnap/kvsnap.h>
#include <pybind11/pybind11.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gil.h"
#include "numpy_arrays.h"

namespace kvsnap::python {

// kvsnap.Snapshot: owns a SnapshotPtr until a consuming call (merge, split) takes it; after
// that every use raises kvsnap.Error naming the call that consumed it. Calls that use it with
// the GIL released hold a Use, and a consuming call refuses while one does (another thread's
// call may be reading it).
class PySnapshot {
 public:
  explicit PySnapshot(SnapshotPtr snapshot) : snapshot_(std::move(snapshot)) {}
  // Releases the snapshot, then gives back what it let go of (release_deferred).
  ~PySnapshot();
  PySnapshot(const PySnapshot&) = delete;
  PySnapshot& operator=(const PySnapshot&) = delete;

  // The snapshot, or Error naming `call` when it was consumed.
  Snapshot& get(const char* call) const;
  // Error naming `consumer` unless take(consumer) would succeed.
  void check_take(const char* consumer) const;
  // Takes the snapshot out for `consumer` (e.g. "Cache.merge"); Error when already taken or in
  // use by a call running on another thread.
  SnapshotPtr take(const char* consumer);
  bool consumed() const { return snapshot_ == nullptr; }

  // The snapshot held for a call that runs without the GIL: made and destroyed with the GIL
  // held; take() refuses while one exists. Of a null PySnapshot: null (None, a live rewind).
  class Use {
   public:
    Use(const PySnapshot* snapshot, const char* call);  // Error when consumed
    Use(Use&& other) noexcept : owner_(other.owner_), snapshot_(other.snapshot_) {
      other.owner_ = nullptr;
    }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    Use& operator=(Use&&) = delete;
    ~Use();
    Snapshot* get() const { return snapshot_; }

   private:
    const PySnapshot* owner_;
    Snapshot* snapshot_;
  };

 private:
  SnapshotPtr snapshot_;
  std::string consumer_;
  mutable int users_ = 0;  // Uses alive (changed with the GIL held)
};

// Deletes a cache as other kvsnap objects go (PySnapshot): with the GIL released — a cache's
// destructor waits for its lock and copies out every lazy snapshot of it, which may take long —
// then gives back what it let go of.
struct DeleteWithoutGil {
  template <class T>
  void operator()(T* object) const noexcept {
    let_go_without_gil([&] { delete object; });
    release_deferred_in_destructor();
  }
};
// The binding of a cache class: held through DeleteWithoutGil (every class of the hierarchy,
// as pybind11 requires one holder kind throughout).
template <class T, class... Bases>
using CacheClass = py::class_<T, Bases..., std::unique_ptr<T, DeleteWithoutGil>>;

// A Python value for a snapshot a call returned: a kvsnap.Snapshot, or None for a null one.
std::unique_ptr<PySnapshot> wrap_snapshot(SnapshotPtr snapshot);

// The caches of `layers`, a tuple made once of the caller's sequence (so that no Python code
// runs, and no layer is dropped, between taking the pointers and using them; the tuple keeps
// them alive): None for a stateless layer gives null. Error naming `call` for an item that is
// neither a kvsnap cache nor None.
std::vector<Cache*> to_layers(const py::tuple& layers, const char* call);

// kvsnap.Tier (tier.cc): the tier, the layers it was opened for (kept alive while it is), and
// what it logged.
struct PyTier {
  ~PyTier();  // waits for the queued writes, without the GIL on the main thread
  ReleaseDeferredLast release_last;
  py::tuple layers;
  std::shared_ptr<Tier> tier;
  std::function<std::vector<std::string>()> take_log;
};

void bind_batch_and_history(py::module_& module);
void bind_caches(py::module_& module);
void bind_prefix(py::module_& module);
void bind_speculation(py::module_& module);
void bind_ops(py::module_& module);
void bind_tier(py::module_& module);

}  // namespace kvsnap::python
