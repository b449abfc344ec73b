#include "kvsnap/allocator.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "array/sanitizers.h"
#include "kvsnap/error.h"

namespace kvsnap {
namespace {

using Clock = std::chrono::steady_clock;

// Under AddressSanitizer every buffer comes from operator new, so the sanitizer sees (and puts
// red zones around) each one.
#if defined(KVSNAP_ADDRESS_SANITIZER)
constexpr bool kPooling = false;
#else
constexpr bool kPooling = true;
#endif

// Size classes of pooled buffers: four per power of two (at most 25% rounding), so a buffer
// released by one array fits the next array of about the same size.
// Sizes no machine can map (2^60 bytes and up) fail here, before the rounding could overflow.
int64_t size_class(int64_t bytes) {
  if (bytes >= (int64_t{1} << 60)) throw std::bad_alloc();
  const auto power = static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(bytes)));
  const int64_t quarter = std::max<int64_t>(power / 4, 1);
  return (bytes + quarter - 1) / quarter * quarter;
}

// KVSNAP_POOL_BYTES: decimal digits, then optionally K, M or G (powers of 1024), each with an
// optional "B" or "iB" ("512MiB"), or a plain "B"; nullopt for anything else or past int64.
std::optional<int64_t> byte_count(std::string_view text) {
  size_t digits = 0;
  int64_t value = 0;
  for (; digits < text.size() && text[digits] >= '0' && text[digits] <= '9'; ++digits) {
    const int digit = text[digits] - '0';
    if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  if (digits == 0) return std::nullopt;
  std::string unit(text.substr(digits));
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.ends_with('B')) unit.pop_back();                     // "B", "KB", "KIB"
  if (unit.size() == 2 && unit.back() == 'I') unit.pop_back();  // "KI" (not "I" alone)
  const int shift = unit.empty() ? 0 : unit == "K" ? 10 : unit == "M" ? 20 : unit == "G" ? 30 : -1;
  if (shift < 0 || value > (std::numeric_limits<int64_t>::max() >> shift)) return std::nullopt;
  return value << shift;
}

// `size` bytes (a multiple of the page size) from the kernel, pre-faulted.
void* map_plain(size_t bytes) {
  void* buffer = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (buffer == MAP_FAILED) throw std::bad_alloc();
  return buffer;
}

// map_plain's bytes aligned to kHugePageBytes and advised to be huge pages before they are
// faulted in (MAP_POPULATE would fault 4 KB pages first): the kernel backs every whole huge page
// of them so where transparent huge pages are on, and ignores the advice where not. Null when the
// 2 MiB more of address space this maps at first is not there (the caller maps plainly).
void* map_huge(size_t bytes) {
  constexpr auto kHuge = static_cast<size_t>(kHugePageBytes);
  const size_t reach = bytes + kHuge;
  void* mapped = ::mmap(nullptr, reach, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  // Keep the aligned `bytes` of the mapping; the rest goes back.
  char* const raw = static_cast<char*>(mapped);
  const size_t head = (kHuge - reinterpret_cast<uintptr_t>(raw) % kHuge) % kHuge;
  char* const buffer = raw + head;
  if (head > 0) ::munmap(raw, head);
  if (reach - head > bytes) ::munmap(buffer + bytes, reach - head - bytes);
  (void)::madvise(buffer, bytes, MADV_HUGEPAGE);  // advice: fails harmlessly where THP is off
  bool populated = false;
#ifdef MADV_POPULATE_WRITE
  if (::madvise(buffer, bytes, MADV_POPULATE_WRITE) == 0) {
    populated = true;
  } else if (errno != EINVAL) {  // no memory, or pages that cannot be had: not a buffer
    ::munmap(buffer, bytes);
    throw std::bad_alloc();
  }
#endif
  if (!populated) {  // kernels before 5.14: fault each page in by touching it (reads as zeros)
    for (size_t at = 0; at < bytes; at += 4096) static_cast<volatile char*>(buffer)[at] = 0;
  }
  return buffer;
}

// `size` bytes (a multiple of the page size), on huge pages when `huge` and it is large enough.
void* map_buffer(int64_t size, bool huge) {
  const auto bytes = static_cast<size_t>(size);
  if (huge && size >= kHugePageBytes) {
    if (void* buffer = map_huge(bytes)) return buffer;
  }
  return map_plain(bytes);
}

// Large buffers come straight from the kernel, pre-faulted (faulting them in one call is about
// twice as fast as page by page on first touch), and are kept for reuse when released: a
// recycled buffer is warm, written at memory bandwidth instead of page-fault speed (measured
// here: 0.4 GB/s into fresh memory, 28 GB/s into warm).
class PooledHeapAllocator final : public Allocator {
 public:
  PooledHeapAllocator() {
    if (const char* limit = std::getenv("KVSNAP_POOL_BYTES")) {
      if (const std::optional<int64_t> bytes = byte_count(limit)) {
        options_.max_bytes = *bytes;
      } else {  // at startup, nobody to throw to: said once, the default kept
        const std::string line = fmt::format(
            "kvsnap: KVSNAP_POOL_BYTES=\"{}\" is not a byte count (digits, then optionally K, M "
            "or G); the pool keeps at most {} bytes\n",
            std::string_view(limit).substr(0, 64), options_.max_bytes);
        (void)std::fwrite(line.data(), 1, line.size(), stderr);
      }
    }
    if (const char* huge = std::getenv("KVSNAP_HUGE_PAGES")) {
      options_.huge_pages = std::string_view(huge) != "0";
    }
  }

  int64_t pooled() const {
    std::lock_guard lock(mutex_);
    return pooled_bytes_;
  }
  void trim() {
    Released released;  // unmapped once the lock is let go
    std::lock_guard lock(mutex_);
    release_older_than(Clock::now() + std::chrono::hours(1), released);
  }
  // New limits apply to what the pool holds: the oldest buffers go until it is within the new
  // max_bytes, and those idle for longer than the new idle_seconds (none when they rise).
  void configure(const PoolOptions& options) {
    Released released;
    std::lock_guard lock(mutex_);
    options_ = options;
    while (pooled_bytes_ > options_.max_bytes) release_oldest(released);
    last_trim_ = {};
    trim_idle(released);
  }
  PoolOptions options() const {
    std::lock_guard lock(mutex_);
    return options_;
  }

 protected:
  void* do_allocate(int64_t bytes) override {
    if (!kPooling || bytes < kPooledBytes) return small(bytes);
    const int64_t size = size_class(bytes);
    bool huge = false;
    {
      Released released;
      std::lock_guard lock(mutex_);
      trim_idle(released);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        void* buffer = it->second.back().pointer;
        it->second.pop_back();
        pooled_bytes_ -= size;
        return buffer;
      }
      huge = options_.huge_pages;
    }
    return map_buffer(size, huge);
  }

  void do_deallocate(void* pointer, int64_t bytes) noexcept override {
    if (!kPooling || bytes < kPooledBytes) {
      ::operator delete (pointer, std::align_val_t{kAlignment});
      return;
    }
    const int64_t size = size_class(bytes);
    Released released;
    std::lock_guard lock(mutex_);
    trim_idle(released);
    if (size > options_.max_bytes) {
      released.add(pointer, size);
      return;
    }
    // Room is made by releasing the buffers that waited longest.
    while (pooled_bytes_ + size > options_.max_bytes) release_oldest(released);
    try {
      free_[size].push_back({pointer, Clock::now()});
      pooled_bytes_ += size;
    } catch (...) {  // no memory for the bookkeeping: give the buffer back instead
      released.add(pointer, size);
    }
  }

 private:
  struct Entry {
    void* pointer;
    Clock::time_point released;
  };

  static void* small(int64_t bytes) {
    // Zero-byte arrays still get a unique, freeable pointer.
    return ::operator new (static_cast<std::size_t>(bytes > 0 ? bytes : 1),
                           std::align_val_t{kAlignment});
  }

  // Buffers taken out of the pool under its lock, unmapped when this goes (after the lock is let
  // go: unmapping hundreds of MB of pages would hold up every other thread's large allocation).
  class Released {
   public:
    Released() = default;
    Released(const Released&) = delete;
    Released& operator=(const Released&) = delete;
    ~Released() {
      for (const auto& [pointer, size] : buffers_) ::munmap(pointer, size);
    }
    void add(void* pointer, int64_t size) noexcept {
      try {
        buffers_.emplace_back(pointer, static_cast<size_t>(size));
      } catch (...) {  // no memory to note it: unmapped now, under the lock
        ::munmap(pointer, static_cast<size_t>(size));
      }
    }

   private:
    std::vector<std::pair<void*, size_t>> buffers_;
  };

  // Buffers idle in the pool for longer than options_.idle_seconds go back to the system
  // (looked at most every 100 ms).
  void trim_idle(Released& released) {
    const auto now = Clock::now();
    if (now - last_trim_ < std::chrono::milliseconds(100)) return;
    last_trim_ = now;
    release_older_than(now - std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(options_.idle_seconds)),
                       released);
  }
  void release_older_than(Clock::time_point cutoff, Released& released) {
    for (auto& [size, entries] : free_) {
      // Entries are pushed in release order: the oldest are at the front.
      auto end = entries.begin();
      while (end != entries.end() && end->released < cutoff) {
        released.add(end->pointer, size);
        pooled_bytes_ -= size;
        ++end;
      }
      entries.erase(entries.begin(), end);
    }
  }
  void release_oldest(Released& released) {
    std::vector<Entry>* oldest = nullptr;
    int64_t oldest_size = 0;
    for (auto& [size, entries] : free_) {
      if (!entries.empty() &&
          (oldest == nullptr || entries.front().released < oldest->front().released)) {
        oldest = &entries;
        oldest_size = size;
      }
    }
    if (oldest == nullptr) return;
    released.add(oldest->front().pointer, oldest_size);
    oldest->erase(oldest->begin());
    pooled_bytes_ -= oldest_size;
  }

  mutable std::mutex mutex_;
  PoolOptions options_;
  std::map<int64_t, std::vector<Entry>> free_;  // size class -> released buffers, oldest first
  int64_t pooled_bytes_ = 0;
  Clock::time_point last_trim_;
};

PooledHeapAllocator& heap() {
  // Never destroyed: Arrays in static storage may outlive any ordinary static.
  static PooledHeapAllocator* const allocator = new PooledHeapAllocator();
  return *allocator;
}

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

Allocator& default_allocator() { return heap(); }

int64_t live_bytes() { return default_allocator().live_bytes(); }
int64_t allocation_count() { return default_allocator().allocation_count(); }
int64_t pool_bytes() { return heap().pooled(); }
void trim_pool() { heap().trim(); }
void set_pool_options(const PoolOptions& options) {
  if (options.max_bytes < 0 || std::isnan(options.idle_seconds) || options.idle_seconds < 0) {
    throw Error(fmt::format("set_pool_options: max_bytes {} and idle_seconds {}: both must be >= 0",
                            options.max_bytes, options.idle_seconds));
  }
  PoolOptions kept = options;
  // Longer than ~30 years (infinity included) is never: the clock's ticks must hold it.
  kept.idle_seconds = std::min(kept.idle_seconds, 1e9);
  heap().configure(kept);
}
PoolOptions pool_options() { return heap().options(); }

}  // namespace kvsnap
