// Running out of memory on purpose: a forked child whose address space may grow only by a given
// headroom (RLIMIT_AS), so the allocations a test aims at fail with std::bad_alloc while the
// test runner itself is never limited.
#pragma once

#include <kvsnap/allocator.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <functional>

#include "array/sanitizers.h"

namespace kvsnap::testing {

#if defined(KVSNAP_ADDRESS_SANITIZER)
constexpr bool kAddressSanitizer = true;  // it aborts on impossible sizes and ignores RLIMIT_AS
#else
constexpr bool kAddressSanitizer = false;
#endif
#if defined(KVSNAP_THREAD_SANITIZER)
constexpr bool kThreadSanitizer = true;  // its own allocations fail under RLIMIT_AS
#else
constexpr bool kThreadSanitizer = false;
#endif

// Runs `body` in a forked child whose address space may grow by at most `headroom` bytes more
// than it has at the fork; returns the child's exit status (body's result), or -1 if it died
// (std::terminate included). The limit is a soft one: `body` may lift it (lift_memory_limit).
inline int run_with_headroom(int64_t headroom, const std::function<int()>& body) {
  const pid_t child = ::fork();
  if (child == 0) {
    trim_pool();  // no pooled buffer to reuse: whatever the body allocates is mapped anew
    int64_t pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    rlimit rl{};
    ::getrlimit(RLIMIT_AS, &rl);
    rl.rlim_cur = static_cast<rlim_t>(pages * ::sysconf(_SC_PAGESIZE) + headroom);
    ::setrlimit(RLIMIT_AS, &rl);
    int result = 3;
    try {
      result = body();
    } catch (...) {  // never back into the test runner from the child
    }
    ::_exit(result);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// In run_with_headroom's child: no limit from here on (to check what the body left behind).
inline void lift_memory_limit() {
  rlimit rl{};
  ::getrlimit(RLIMIT_AS, &rl);
  rl.rlim_cur = rl.rlim_max;
  ::setrlimit(RLIMIT_AS, &rl);
}

}  // namespace kvsnap::testing
