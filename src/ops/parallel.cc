// The kernels' worker threads (parallel.h). A region: the caller publishes the task and bumps a
// generation; workers spinning or sleeping on it join while the region is open; everyone takes
// task indices from one counter. The caller returns once every task is done and every worker
// that joined has left, so the next region may reuse the fields. A worker that wakes late finds
// the region closed and goes back to waiting: the caller waits only for tasks and for workers
// that joined (spinning briefly, then yielding, so a preempted worker gets a core back).
#include "ops/parallel.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "kvsnap/error.h"
#include "kvsnap/ops.h"

namespace kvsnap {
namespace detail {
namespace {

thread_local bool in_region = false;

void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

class Pool {
 public:
  static Pool& instance() {
    static Pool* pool = new Pool;  // never destroyed: its workers sleep until the process ends
    return *pool;
  }

  int threads() const { return size_.load(); }

  void resize(int threads) {
    if (in_region) {
      throw Error(
          fmt::format("set_threads: called from inside a parallel region's task (it "
                      "would wait for the region it is part of)"));
    }
    const std::lock_guard<std::mutex> region(region_);  // waits for the region in flight
    stop_workers();
    const uint64_t now = generation_.load();  // no region runs: it changes with the next one
    try {
      for (int i = 1; i < threads; ++i) workers_.emplace_back([this, now] { work(now); });
    } catch (...) {
      size_.store(static_cast<int>(workers_.size()) + 1);  // the threads that did start
      throw;
    }
    size_.store(threads);
  }

  void run(int64_t n, const std::function<void(int64_t)>& task) {
    if (n <= 0) return;
    if (n == 1 || in_region) return serially(n, task);
    std::unique_lock<std::mutex> region(region_, std::try_to_lock);
    if (!region.owns_lock() || workers_.empty()) return serially(n, task);
    task_ = &task;
    n_ = n;
    next_.store(0);
    done_.store(0);
    error_ = nullptr;
    open_.store(true);
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    in_region = true;
    drain();
    wait_until([&] { return done_.load() >= n_; });
    open_.store(false);
    wait_until([&] { return active_.load() == 0; });  // joined workers leave after the last task
    in_region = false;
    if (error_) std::rethrow_exception(error_);
  }

  // Whether a region runs now (on any thread).
  bool busy() const { return open_.load(); }

 private:
  // How long a worker spins for the next region before it sleeps (a forward pass starts its
  // regions tens of microseconds apart; waking a sleeping thread costs about as much), and how
  // many pauses the caller spins before it yields.
  static constexpr std::chrono::microseconds kSpinTime{300};
  static constexpr int kSpins = 2000;

  // Like a region, but on this thread: every task runs, then the first exception is rethrown.
  static void serially(int64_t n, const std::function<void(int64_t)>& task) {
    std::exception_ptr first;
    for (int64_t i = 0; i < n; ++i) {
      try {
        task(i);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  // Spins briefly, then yields: a thread it waits for may have been preempted (more threads
  // than cores, or a busy machine), and spinning would keep it off the core.
  template <class Ready>
  static void wait_until(Ready ready) {
    for (int spin = 0; !ready(); ++spin) {
      if (spin < kSpins) {
        relax();
      } else {
        std::this_thread::yield();
      }
    }
  }

  void drain() {
    for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) {
      try {
        (*task_)(i);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1);
    }
  }

  void work(uint64_t seen) {
    while (true) {
      const auto until = std::chrono::steady_clock::now() + kSpinTime;
      for (int spin = 1; generation_.load() == seen && !stopping_.load(); ++spin) {
        relax();
        if (spin % 64 == 0 && std::chrono::steady_clock::now() >= until) break;
      }
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_.load() || generation_.load() != seen; });
      }
      if (stopping_.load()) return;
      seen = generation_.load();
      if (!open_.load()) continue;  // woke late: the region is over (checked again below)
      // Join only the region `seen` names, and only while it is open (sequentially consistent:
      // either the caller sees this worker active, or this worker sees the region closed).
      active_.fetch_add(1);
      if (open_.load() && generation_.load() == seen) {
        in_region = true;
        drain();
        in_region = false;
      }
      active_.fetch_sub(1);
    }
  }

  void stop_workers() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stopping_.store(true);
    }
    wake_.notify_all();
    for (std::thread& worker : workers_) worker.join();
    workers_.clear();
    stopping_.store(false);
  }

  std::mutex region_;  // one region at a time; held while resizing
  std::mutex mutex_;   // with wake_: sleeping workers
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> open_{false}, stopping_{false};
  std::atomic<int> active_{0}, size_{1};
  std::atomic<int64_t> next_{0}, done_{0};
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t n_ = 0;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
};

}  // namespace

void parallel_for(int64_t n, const std::function<void(int64_t)>& task) {
  Pool::instance().run(n, task);
}

int parallel_threads() {
  const Pool& pool = Pool::instance();
  return in_region || pool.busy() ? 1 : pool.threads();
}

}  // namespace detail

void set_threads(int threads) {
  constexpr int kMaximum = 256;
  if (threads < 1 || threads > kMaximum) {
    throw Error(fmt::format("set_threads: {} threads is outside [1, {}]", threads, kMaximum));
  }
  detail::Pool::instance().resize(threads);
}

int threads() { return detail::Pool::instance().threads(); }

}  // namespace kvsnap
