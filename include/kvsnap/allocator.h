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

// The process-wide heap allocator every Array uses unless told otherwise.
KVSNAP_EXPORT Allocator& default_allocator();

// Bytes currently held by all live Array storage of the default allocator.
KVSNAP_EXPORT int64_t live_bytes();
// Allocations made so far by the default allocator (monotonic; compare two readings).
KVSNAP_EXPORT int64_t allocation_count();

}  // namespace kvsnap
