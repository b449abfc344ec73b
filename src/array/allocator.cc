#include "kvsnap/allocator.h"

#include <new>

namespace kvsnap {
namespace {

class HeapAllocator final : public Allocator {
 protected:
  void* do_allocate(int64_t bytes) override {
    // Zero-byte arrays still get a unique, freeable pointer.
    return ::operator new (static_cast<std::size_t>(bytes > 0 ? bytes : 1),
                           std::align_val_t{kAlignment});
  }
  void do_deallocate(void* pointer, int64_t) noexcept override {
    ::operator delete (pointer, std::align_val_t{kAlignment});
  }
};

}  // namespace

Allocator::~Allocator() = default;

void* Allocator::allocate(int64_t bytes) {
  void* pointer = do_allocate(bytes);
  live_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  allocation_count_.fetch_add(1, std::memory_order_relaxed);
  return pointer;
}

void Allocator::deallocate(void* pointer, int64_t bytes) noexcept {
  live_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
  do_deallocate(pointer, bytes);
}

Allocator& default_allocator() {
  // Never destroyed: Arrays in static storage may outlive any ordinary static.
  static HeapAllocator* const allocator = new HeapAllocator();
  return *allocator;
}

int64_t live_bytes() { return default_allocator().live_bytes(); }
int64_t allocation_count() { return default_allocator().allocation_count(); }

}  // namespace kvsnap
