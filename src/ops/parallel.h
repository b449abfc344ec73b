// Internal: the kernels' worker threads. `parallel_for(n, task)` runs task(0) … task(n-1) over the
// threads set by kvsnap::set_threads (the caller is one of them) and returns when all are done.
// Tasks must write disjoint outputs; each output must not depend on which thread computed it or
// how the work was split (the kernels split by output rows, columns or heads, whose sums keep
// their order), so results are bitwise the same for every thread count.
//
// One parallel region at a time: a call from inside a task, or while another thread's region
// runs, runs its tasks serially on the calling thread (never waits for the pool). Either way
// every task runs, then the first exception a task threw is rethrown. Workers spin briefly
// after a region (the next one of a forward pass comes within microseconds), then sleep.
#pragma once

#include <cstdint>
#include <functional>

namespace kvsnap::detail {

void parallel_for(int64_t n, const std::function<void(int64_t)>& task);

// Threads a region started here now would use: 1 inside a task, while a region runs on any
// thread, or when the pool is off (a hint for splitting work; the split never changes results).
int parallel_threads();

}  // namespace kvsnap::detail
