// The global operator new and delete of a test binary that watches its allocations: every form
// of new calls `kvsnap::testing::on_allocation(bytes)` — which the including file defines, and
// which may throw std::bad_alloc — then malloc (aligned_alloc for the aligned forms); every form of
// delete frees. Include it from exactly one source file of the binary.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

namespace kvsnap::testing {
void on_allocation(std::size_t bytes);
}  // namespace kvsnap::testing

void* operator new(std::size_t size) {
  kvsnap::testing::on_allocation(size);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void* operator new(std::size_t size, std::align_val_t align) {
  kvsnap::testing::on_allocation(size);
  const auto alignment = static_cast<std::size_t>(align);
  if (void* p = std::aligned_alloc(alignment, (size + alignment - 1) / alignment * alignment)) {
    return p;
  }
  throw std::bad_alloc();
}
void* operator new[](std::size_t size, std::align_val_t align) {
  return ::operator new(size, align);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
