#include "gil.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace kvsnap::python {
namespace {

struct Deferred {
  std::mutex mutex;
  std::vector<PyObject*> objects;  // references kvsnap let go of, not yet given back
  bool nudged = false;             // a pending call is queued (or the queue is being drained)
};

// Never destroyed: kvsnap may let go of memory during the process's exit, after this module's
// static objects would have been. A child process made by fork() gets a new one (the parent's
// mutex may have been held by a thread the child does not have; its references are left alive).
std::atomic<Deferred*> queue_now{new Deferred};
Deferred& deferred() { return *queue_now.load(); }

bool finalizing() {
  if (!Py_IsInitialized()) return true;
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

unsigned long main_thread = 0;  // NOLINT: set once, at import
std::atomic<int> calls_in_flight{0};

// The interpreter's last step (Py_AtExit): no thread can take the GIL any more, so no call
// starts; the calls still running finish (and their threads then wait in ~GilReleased).
void wait_for_calls_in_flight() {
  while (calls_in_flight.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

int release_pending(void*) {
  release_deferred();
  return 0;
}

// In a child process made by fork(): the thread that forked is its only thread (and Python's
// main one), and no call is in flight there.
void after_fork_in_child() {
  calls_in_flight.store(0);
  main_thread = PyThread_get_thread_ident();
  queue_now.store(new Deferred);
}

}  // namespace

void prepare_for_exit() {
  main_thread =
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  Py_AtExit(&wait_for_calls_in_flight);
  pthread_atfork(nullptr, nullptr, &after_fork_in_child);
}

GilReleased::GilReleased() {
  calls_in_flight.fetch_add(1);
  state_ = PyEval_SaveThread();
}

GilReleased::~GilReleased() noexcept(false) {
  calls_in_flight.fetch_sub(1);
  while (finalizing() && PyThread_get_thread_ident() != main_thread) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  PyEval_RestoreThread(state_);
}

PyThreadState* release_gil_in_destructor() noexcept {
  // Only the main thread: another waiting to take the GIL back when the interpreter begins to
  // finalize would be ended inside the wait (pthread_exit, through this noexcept frame: abort).
  if (finalizing() || !PyGILState_Check() || PyThread_get_thread_ident() != main_thread) {
    return nullptr;
  }
  calls_in_flight.fetch_add(1);
  return PyEval_SaveThread();
}

void restore_gil_in_destructor(PyThreadState* state) noexcept {
  if (state == nullptr) return;
  calls_in_flight.fetch_sub(1);
  while (finalizing() && PyThread_get_thread_ident() != main_thread) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  PyEval_RestoreThread(state);
}

void defer_decref(PyObject* object) noexcept {
  Deferred& queue = deferred();
  bool nudge = false;
  {
    const std::lock_guard<std::mutex> lock(queue.mutex);
    try {
      queue.objects.push_back(object);
    } catch (...) {
      return;  // out of memory: the object is left alive rather than freed under a lock
    }
    if (release_scopes > 0) return;  // this thread gives it back when its scope ends
    nudge = !queue.nudged;
    queue.nudged = true;
  }
  // For references dropped on threads that do not return to the module: the interpreter runs
  // pending calls on its main thread, between bytecodes (never inside a kvsnap call).
  if (nudge && !finalizing() && Py_AddPendingCall(&release_pending, nullptr) != 0) {
    const std::lock_guard<std::mutex> lock(queue.mutex);
    queue.nudged = false;  // the queue of pending calls is full: the next drop tries again
  }
}

void release_deferred_in_destructor() noexcept {
  // Elsewhere than on the main thread, a finalizer run here could see the interpreter begin to
  // finalize and end this thread with pthread_exit, whose unwinding cannot pass the noexcept
  // destructors above this one: the enclosing call's scope or a pending call gives them back.
  if (PyThread_get_thread_ident() != main_thread) return;
  release_deferred();
}

void release_deferred() {
  if (finalizing() || !PyGILState_Check()) return;
  Deferred& queue = deferred();
  for (;;) {
    std::vector<PyObject*> objects;
    {
      const std::lock_guard<std::mutex> lock(queue.mutex);
      objects.swap(queue.objects);
      queue.nudged = false;
    }
    if (objects.empty()) return;
    // Finalizers run below; an exception being raised or handled must survive them.
    PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
    PyErr_Fetch(&type, &value, &trace);
    for (PyObject* object : objects) Py_DECREF(object);
    PyErr_Restore(type, value, trace);
  }
}

}  // namespace kvsnap::python
