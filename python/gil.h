// The GIL and kvsnap's own locks.
//
// kvsnap's caches lock themselves, and inside their calls — under their locks, on any thread —
// they let go of memory the module wrapped (numpy arrays, DLPack capsules they adopted). Were a
// thread holding a cache's lock to wait for the GIL while the GIL's holder waits for that lock
// (or runs a finalizer that lets a third thread in), the two would deadlock. So:
//   - kvsnap never touches a Python object: a reference it lets go of is queued (defer_decref,
//     no GIL needed) and given back by the module where it holds the GIL outside every kvsnap
//     call (release_deferred): at the end of each call that released the GIL, when the module's
//     own objects go away, and, for references dropped on threads that never return to Python,
//     from a pending call (Py_AddPendingCall) the interpreter runs on its main thread;
//   - calls that may take long or wait for a cache's lock run with the GIL released
//     (without_gil), after every Python object they need was converted: no thread then holds
//     a kvsnap lock while waiting for the GIL.
#pragma once

#include <pybind11/pybind11.h>

#include <utility>

namespace kvsnap::python {

namespace py = pybind11;

// At import, GIL held: notes the interpreter's main thread (threading.main_thread()) and has the
// interpreter's exit wait for the kvsnap calls in flight (GilReleased).
void prepare_for_exit();

// Queues `object`'s reference for release_deferred. Any thread, GIL or not, any lock held.
void defer_decref(PyObject* object) noexcept;

// Gives back the queued references (their finalizers may run any Python code). Does nothing
// unless this thread holds the GIL, and nothing once the interpreter is finalizing (the objects
// are left to the exiting process). Call only outside kvsnap calls (no kvsnap lock held), and
// not from a noexcept function: should the interpreter begin to finalize while a finalizer runs
// on a thread other than the main one, Python ends that thread with pthread_exit, whose
// unwinding must pass.
void release_deferred();

// For destructors (noexcept): release_deferred on the main thread; elsewhere nothing (what they
// let go of waits for the enclosing call's scope or for the main thread's pending call).
void release_deferred_in_destructor() noexcept;

// Scopes of ReleaseDeferredAtExit open on this thread: what the thread lets go of meanwhile waits
// for their end (no pending call is queued for it).
inline thread_local int release_scopes = 0;

// Calls release_deferred when the scope ends (also on an exception). Made and ended with the GIL
// held, outside kvsnap calls: around a bound call (ReleaseAfter), or in without_gil.
class ReleaseDeferredAtExit {
 public:
  ReleaseDeferredAtExit() { ++release_scopes; }
  ReleaseDeferredAtExit(const ReleaseDeferredAtExit&) = delete;
  ReleaseDeferredAtExit& operator=(const ReleaseDeferredAtExit&) = delete;
  ~ReleaseDeferredAtExit() noexcept(false) {
    release_deferred();
    --release_scopes;
  }
};

// Declared first in an object of the module, so destroyed last: gives back what the other
// members let go of (the object goes with the GIL held, outside kvsnap calls).
struct ReleaseDeferredLast {
  ~ReleaseDeferredLast() { release_deferred_in_destructor(); }
};

// The GIL released for a scope, as py::gil_scoped_release, with two additions for the
// interpreter's exit, where daemon threads may still be inside kvsnap calls:
//   - such a thread (any but the main one) that would take the GIL back once the interpreter is
//     finalizing waits for the process to end instead (as Python 3.14 does): taking it would end
//     the thread with pthread_exit, whose unwinding through a noexcept destructor aborts the
//     process. The main thread finalizes, and may still call kvsnap from finalizers. The
//     destructor lets that unwinding pass should finalization begin just after its check;
//   - the scopes are counted, and the interpreter's last step (Py_AtExit) waits until none is
//     open, so the process does not destroy kvsnap's static state under a running call.
class GilReleased {
 public:
  GilReleased();
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;
  ~GilReleased() noexcept(false);

 private:
  PyThreadState* state_;
};

// Runs `call` with the GIL released, then (the GIL held again, also on an exception) gives back
// the references kvsnap let go of meanwhile. `call` must not touch a Python object: convert the
// arguments before, build the Python results after.
template <class Call>
auto without_gil(Call&& call) {
  const ReleaseDeferredAtExit release_after;
  const GilReleased released;
  return std::forward<Call>(call)();
}

// For destructors (noexcept): the GIL released by release_gil_in_destructor and taken back by
// restore_gil_in_destructor — on the main thread only, while the interpreter is not finalizing
// (null, nothing released, elsewhere). Another thread keeps it: the wait to take it back can
// begin before the interpreter finalizes and end in it, which ends the thread with pthread_exit
// inside the wait, through the destructor — an abort. Keeping the GIL while kvsnap state goes
// cannot deadlock (kvsnap never waits for the GIL under its locks); it only pauses the other
// Python threads meanwhile.
PyThreadState* release_gil_in_destructor() noexcept;
void restore_gil_in_destructor(PyThreadState* state) noexcept;

// For destructors: runs `let_go` — kvsnap state going away, which may wait for a cache's lock
// (another thread's long update) or copy what lazy snapshots name — on the main thread with the
// GIL released, so the other Python threads run meanwhile. `let_go` must not touch a
// Python object, nor throw.
template <class LetGo>
void let_go_without_gil(LetGo&& let_go) noexcept {
  PyThreadState* const state = release_gil_in_destructor();
  std::forward<LetGo>(let_go)();
  restore_gil_in_destructor(state);
}

// For bindings whose arguments and results are plain C++ values (no Python object touched inside):
// runs the call with the GIL released, then gives back what kvsnap let go of meanwhile.
using Released = py::call_guard<ReleaseDeferredAtExit, GilReleased>;

// For bindings that convert arrays (their last references may go when the call ends): gives back
// what kvsnap let go of once the call and its locals are done.
using ReleaseAfter = py::call_guard<ReleaseDeferredAtExit>;

}  // namespace kvsnap::python
