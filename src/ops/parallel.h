// Internal: the kernels' worker threads. `parallel_for(n, task)` runs task(0) … task(n-1) over the
// threads set by kvsnap::set_threads (the caller is one of them) and returns when all are done.
// Tasks must write disjoint outputs; each output must not depend on which thread computed it or
// how the work was split (the kernels split by output rows, columns or heads, whose sums keep
// their order), so results are bitwise the same for every thread count.
//
// One parallel region at a time: a call from inside a task, or while another thread's region
// runs, runs its tasks serially on the calling thread (never waits for the pool). Workers spin
// briefly after a region (the next one of a forward pass comes within microseconds), then sleep.
#pragma once

#include <cstdint>
#include <functional>

namespace kvsnap::detail {

void parallel_for(int64_t n, const std::function<void(int64_t)>& task);

// Threads a region may use now (1 when the pool is off or busy).
int parallel_threads();

}  // namespace kvsnap::detail
