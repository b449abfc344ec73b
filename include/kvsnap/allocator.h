// Allocator — where Array storage comes from, with exact byte accounting.
//
// Every Array buffer is obtained from an Allocator, which counts the bytes it currently holds
// and the allocations it has made, so tests and benchmarks can prove that an operation
// allocated nothing:
//
//   int64_t before = kvsnap::allocation_count();
//   auto view = a.slice(0, 1, 3);             // a view: no storage allocated
//   assert(kvsnap::allocation_count() == before);
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kvsnap/export.h"

namespace kvsnap {

// Source of Array storage. Thread-safe counters; allocate/deallocate must be too.
class KVSNAP_EXPORT Allocator {
 public:
  virtual ~Allocator();

  // Returns `bytes` bytes aligned to kAlignment (never null; throws std::bad_alloc).
  [[nodiscard]] void* allocate(int64_t bytes);
  // Returns memory obtained from allocate(bytes) on this allocator.
  void deallocate(void* pointer, int64_t bytes) noexcept;

  // Bytes currently held by live buffers of this allocator.
  int64_t live_bytes() const noexcept { return live_bytes_.load(std::memory_order_relaxed); }
  // Allocations made by this allocator since it was created (monotonic).
  int64_t allocation_count() const noexcept {
    return allocation_count_.load(std::memory_order_relaxed);
  }

  // Buffers are cache-line aligned, and wide enough for any vector load.
  static constexpr std::size_t kAlignment = 64;

 protected:
  virtual void* do_allocate(int64_t bytes) = 0;
  virtual void do_deallocate(void* pointer, int64_t bytes) noexcept = 0;

 private:
  std::atomic<int64_t> live_bytes_{0};
  std::atomic<int64_t> allocation_count_{0};
};

// The process-wide heap allocator every Array uses unless told otherwise. Buffers of at least
// kPooledBytes are pre-faulted when new and pooled by size class when released, so the next
// buffer of about the same size is warm: materialization, restore, growth and recurrent states
// run at memory bandwidth instead of page-fault speed. live_bytes() counts only buffers of live
// arrays; pooled ones are pool_bytes(). (AddressSanitizer builds do not pool.)
KVSNAP_EXPORT Allocator& default_allocator();

// Buffers smaller than this come from operator new and are not pooled.
inline constexpr int64_t kPooledBytes = int64_t(64) << 10;

struct PoolOptions {
  // Most bytes the pool keeps (the buffers released longest ago go first). The environment
  // variable KVSNAP_POOL_BYTES sets the starting value (digits, then optionally K, M or G:
  // "256M"; another value is said on stderr and ignored); 0 turns pooling off.
  int64_t max_bytes = int64_t(512) << 20;
  // A buffer unused for this long is returned to the system at the next allocation or release of
  // a pooled size (kPooledBytes and up; looked at most every 100 ms), or by trim_pool(): a server
  // that goes on allocating only small arrays keeps what is pooled (at most max_bytes) until then
  // (infinity: never).
  double idle_seconds = 2.0;
  // Buffers of kHugePageBytes and more are aligned to it and backed by transparent huge pages
  // where the kernel offers them (madvise; nothing changes where it does not): a decode step
  // streams tens of MB of weights, keys and values, and with 4 KB pages every 4 KB costs a
  // TLB miss and stops the hardware's prefetch. The environment variable KVSNAP_HUGE_PAGES=0
  // sets the starting value to false. Applies to buffers mapped after the change.
  bool huge_pages = true;
};
// Buffers at least this large are backed by huge pages when PoolOptions::huge_pages is set.
inline constexpr int64_t kHugePageBytes = int64_t(2) << 20;
// Throws kvsnap::Error, changing nothing, for a negative max_bytes or a negative or NaN
// idle_seconds. The new limits apply to what the pool holds at once: buffers go until it is
// within max_bytes (the oldest first), and those idle past idle_seconds.
KVSNAP_EXPORT void set_pool_options(const PoolOptions&);
KVSNAP_EXPORT PoolOptions pool_options();
// Bytes the default allocator's pool holds for reuse.
KVSNAP_EXPORT int64_t pool_bytes();
// Returns every pooled buffer to the system now (e.g. when a server goes idle).
KVSNAP_EXPORT void trim_pool();

// Bytes currently held by all live Array storage of the default allocator.
KVSNAP_EXPORT int64_t live_bytes();
// Allocations made so far by the default allocator (monotonic; compare two readings).
KVSNAP_EXPORT int64_t allocation_count();

}  // namespace kvsnap
