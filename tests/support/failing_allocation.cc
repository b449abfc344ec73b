// The global operator new of the oom_test binary (failing_allocation.h, replaced_new.h):
// counted while armed, and failing once at the run's chosen count.
#include "support/failing_allocation.h"

#include <gtest/gtest.h>
#include <kvsnap/error.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <new>
#include <string>

#include "cache/state_snapshot.h"
#include "support/replaced_new.h"

namespace {

std::atomic<bool> armed{false};
std::atomic<int64_t> counted{0}, fail_at{0};

}  // namespace

// Every form of global operator new comes here (support/replaced_new.h).
void kvsnap::testing::on_allocation(std::size_t) {
  if (!armed.load(std::memory_order_relaxed)) return;
  if (counted.fetch_add(1, std::memory_order_relaxed) + 1 == fail_at.load()) {
    armed = false;  // one failure per run: the rest of the run must cope with it
    const char* stop = std::getenv("KVSNAP_OOM_BREAK");  // failing_allocation.h
    if (stop != nullptr && std::atoll(stop) == fail_at.load()) std::raise(SIGTRAP);
    throw std::bad_alloc();
  }
}

namespace kvsnap::testing {

void start_run(int64_t n) {
  detail::reuse_pooled_objects = false;  // every snapshot object from operator new: each can fail
  armed = false;
  counted = 0;
  fail_at = n;
}

bool armed_call(const std::function<void()>& call) {
  armed = fail_at.load() > counted.load();
  try {
    call();
  } catch (const std::bad_alloc&) {
    armed = false;
    return false;
  } catch (const Error& e) {
    armed = false;
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
    return false;
  }
  armed = false;
  return true;
}

void disarm() { armed = false; }
bool failed_in_run() { return counted.load() >= fail_at.load(); }
int64_t counted_allocations() { return counted.load(); }

int64_t sweep(const std::function<void()>& run) {
  for (int64_t n = 1;; ++n) {
    SCOPED_TRACE("allocation " + std::to_string(n) + " fails");
    start_run(n);
    run();
    disarm();
    if (::testing::Test::HasFailure() || !failed_in_run()) return n;
  }
}

}  // namespace kvsnap::testing
