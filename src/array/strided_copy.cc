#include "array/strided_copy.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "array/sanitizers.h"

// Streaming stores where SSE2 has them; not under the sanitizers, whose GCC instrumentation does
// not see them (memcpy is checked instead).
#if defined(__SSE2__) && !defined(KVSNAP_ADDRESS_SANITIZER) && !defined(KVSNAP_THREAD_SANITIZER)
#define KVSNAP_STREAMING_STORES 1
#include <emmintrin.h>
#endif

namespace kvsnap::detail {
namespace {

// Per thread: a process-wide atomic was a locked add on one shared line per copy, on every
// token's write.
thread_local int64_t memcpy_calls = 0;
thread_local int64_t streamed_runs = 0;
thread_local int streaming_scopes = 0;  // StreamingWrites alive on this thread

constexpr int kMaxAxes = 8;
// Runs of whole cache lines up to this many bytes are copied inline (see strided_copy).
constexpr size_t kLine = 64, kInlineRun = 1024;

// The last-level cache of CPU 0, as Linux names it (sysfs: "32768K" on a Zen 3 CCD, the share one
// core can use; the CPUs of one machine have the same), else 32 MiB: a copy of runs longer than
// kInlineRun that moves this many bytes or more goes by streaming stores (stream_run), as does any
// such copy inside a StreamingWrites.
[[maybe_unused]] int64_t last_level_cache_bytes() {  // unused without streaming stores
  // Read with a stack buffer, not a stream: the first copy that asks may run where allocation
  // fails (out-of-memory tests), and must not fail or allocate for this.
  char text[32] = {};
  const int fd = ::open("/sys/devices/system/cpu/cpu0/cache/index3/size", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    const ssize_t got = ::read(fd, text, sizeof text - 1);
    ::close(fd);
    char* unit = nullptr;
    const long long size = got > 0 ? std::strtoll(text, &unit, 10) : 0;
    const int64_t scale = unit == nullptr ? 0
                          : *unit == 'K'  ? int64_t{1} << 10
                          : *unit == 'M'  ? int64_t{1} << 20
                          : *unit == 'G'  ? int64_t{1} << 30
                                          : 1;
    if (size > 0 && scale > 0 && size <= (int64_t{1} << 40) / scale) return size * scale;
  }
  return int64_t{32} << 20;
}

int64_t stream_span() {
#if defined(KVSNAP_STREAMING_STORES)
  static const int64_t span = last_level_cache_bytes();
  return span;
#else
  return 0;
#endif
}

// Only the first ndim entries are ever read: the arrays are left uninitialized (zeroing them
// cost a `rep stos` of 200 bytes per copy, about a sixth of a one-token write).
struct Layout {
  int ndim = 0;
  std::array<int64_t, kMaxAxes> shape;
  std::array<int64_t, kMaxAxes> source;
  std::array<int64_t, kMaxAxes> destination;
};

// Drops unit axes and merges neighbours that are contiguous in both layouts, into `out` (filled
// in place: its unwritten entries are never copied).
void collapse(const int64_t* destination_strides, const int64_t* source_strides,
              const int64_t* shape, int ndim, Layout& out) {
  out.ndim = 0;
  for (int axis = 0; axis < ndim; ++axis) {
    if (shape[axis] == 1) continue;
    if (out.ndim > 0) {
      const int last = out.ndim - 1;
      if (out.source[last] == source_strides[axis] * shape[axis] &&
          out.destination[last] == destination_strides[axis] * shape[axis]) {
        out.shape[last] *= shape[axis];
        out.source[last] = source_strides[axis];
        out.destination[last] = destination_strides[axis];
        continue;
      }
    }
    out.shape[out.ndim] = shape[axis];
    out.source[out.ndim] = source_strides[axis];
    out.destination[out.ndim] = destination_strides[axis];
    ++out.ndim;
  }
}

// The runs of a collapsed layout in order, each given to `copy` (an odometer over the axes
// before `outer`); returns how many.
template <class Copy>
[[gnu::always_inline]] inline int64_t each_run(const Layout& layout, int outer, char* out,
                                               const char* in, int64_t element_size, Copy copy) {
  std::array<int64_t, kMaxAxes> index{};
  int64_t calls = 0, in_offset = 0, out_offset = 0;
  while (true) {
    copy(out + out_offset * element_size, in + in_offset * element_size);
    ++calls;
    int axis = outer - 1;
    for (; axis >= 0; --axis) {
      in_offset += layout.source[axis];
      out_offset += layout.destination[axis];
      if (++index[axis] < layout.shape[axis]) break;
      in_offset -= layout.source[axis] * layout.shape[axis];
      out_offset -= layout.destination[axis] * layout.shape[axis];
      index[axis] = 0;
    }
    if (axis < 0) return calls;
  }
}

// Runs of whole cache lines (a token's head: a few hundred bytes), copied inline a line at a
// time rather than by a call to memcpy per run, which cost a token's write about a sixth of its
// time. Built for each vector width (one 64-byte move a line with AVX-512, two with AVX2),
// chosen once by what the CPU runs.
using LineRuns = int64_t (*)(const Layout&, int, char*, const char*, int64_t, size_t);
[[gnu::always_inline]] inline int64_t line_runs(const Layout& layout, int outer, char* out,
                                                const char* in, int64_t element_size,
                                                size_t run_bytes) {
  return each_run(layout, outer, out, in, element_size, [run_bytes](char* to, const char* from) {
    for (size_t at = 0; at < run_bytes; at += kLine) __builtin_memcpy(to + at, from + at, kLine);
  });
}
int64_t line_runs_default(const Layout& layout, int outer, char* out, const char* in,
                          int64_t element_size, size_t run_bytes) {
  return line_runs(layout, outer, out, in, element_size, run_bytes);
}
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
[[gnu::target("avx2")]] int64_t line_runs_avx2(const Layout& layout, int outer, char* out,
                                               const char* in, int64_t element_size,
                                               size_t run_bytes) {
  return line_runs(layout, outer, out, in, element_size, run_bytes);
}
[[gnu::target("avx512f")]] int64_t line_runs_avx512(const Layout& layout, int outer, char* out,
                                                    const char* in, int64_t element_size,
                                                    size_t run_bytes) {
  return line_runs(layout, outer, out, in, element_size, run_bytes);
}
#endif
LineRuns chosen_line_runs() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return line_runs_avx512;
  if (__builtin_cpu_supports("avx2")) return line_runs_avx2;
#endif
  return line_runs_default;
}

// One run written with streaming (non-temporal) stores, whole lines only: the lines go to memory
// without being read first and without evicting what the caches hold. Lines that will not be
// read from the cache anyway — a copy larger than the last-level cache (32 MB per AMD CCD; less
// per core elsewhere), or a write into a history larger than it, which attention reads from its
// first column on, pushing the new ones out before it reaches them — gain nothing from a normal
// store's read of each line before it is written (half the memory traffic of a copy) and its
// eviction of useful lines: a 128k-token prefill's chunk writes and growth copies run ~1.6x
// faster this way. The partial lines at either end go by memcpy. The caller fences (sfence)
// after its last run, before anything may read them.
void stream_run(char* to, const char* from, size_t bytes) {
#if defined(KVSNAP_STREAMING_STORES)
  const size_t misaligned = reinterpret_cast<uintptr_t>(to) % kLine;
  const size_t head = std::min(bytes, misaligned == 0 ? 0 : kLine - misaligned);
  std::memcpy(to, from, head);
  to += head;
  from += head;
  bytes -= head;
  const size_t lines = bytes / kLine * kLine;
  for (size_t at = 0; at < lines; at += kLine) {
    const auto* in = reinterpret_cast<const __m128i*>(from + at);
    auto* out = reinterpret_cast<__m128i*>(to + at);
    const __m128i a = _mm_loadu_si128(in), b = _mm_loadu_si128(in + 1);
    const __m128i c = _mm_loadu_si128(in + 2), d = _mm_loadu_si128(in + 3);
    _mm_stream_si128(out, a);
    _mm_stream_si128(out + 1, b);
    _mm_stream_si128(out + 2, c);
    _mm_stream_si128(out + 3, d);
  }
  std::memcpy(to + lines, from + lines, bytes - lines);
#else
  std::memcpy(to, from, bytes);
#endif
}

// Whether a copy of runs longer than kInlineRun streams: one larger than the last-level cache
// (its own first lines are gone before its last are written), or any inside a StreamingWrites.
bool streams(const Layout& layout, int outer, size_t run_bytes) {
  const int64_t span = stream_span();
  if (span == 0) return false;
  if (streaming_scopes > 0) return true;
  int64_t runs = 1;
  for (int axis = 0; axis < outer; ++axis) {
    if (__builtin_mul_overflow(runs, layout.shape[axis], &runs)) return true;
  }
  return runs >= (span + static_cast<int64_t>(run_bytes) - 1) / static_cast<int64_t>(run_bytes);
}

}  // namespace

int64_t strided_copy(void* destination, const int64_t* destination_strides, const void* source,
                     const int64_t* source_strides, const int64_t* shape, int ndim,
                     int64_t element_size) {
  for (int axis = 0; axis < ndim; ++axis) {
    if (shape[axis] == 0) return 0;
  }
  Layout layout;
  collapse(destination_strides, source_strides, shape, ndim, layout);
  auto* out = static_cast<char*>(destination);
  const auto* in = static_cast<const char*>(source);

  // The innermost axis is one memcpy when unit-strided in both layouts, else element copies.
  int64_t run_elements = 1;
  int outer = layout.ndim;
  if (layout.ndim > 0 && layout.source[layout.ndim - 1] == 1 &&
      layout.destination[layout.ndim - 1] == 1) {
    run_elements = layout.shape[layout.ndim - 1];
    outer = layout.ndim - 1;
  }
  const auto run_bytes = static_cast<size_t>(run_elements * element_size);

  // memmove only when the two layouts' spans overlap (shifting tokens inside one buffer);
  // memcpy is faster for the small runs of per-token writes.
  int64_t in_span = 0, out_span = 0;
  for (int axis = 0; axis < layout.ndim; ++axis) {
    in_span += (layout.shape[axis] - 1) * layout.source[axis];
    out_span += (layout.shape[axis] - 1) * layout.destination[axis];
  }
  const char* in_end = in + (in_span + run_elements) * element_size;
  const char* out_end = out + (out_span + run_elements) * element_size;
  const bool overlap = in < out_end && out < in_end;

  int64_t calls = 0;
  if (overlap) {
    calls = each_run(layout, outer, out, in, element_size, [run_bytes](char* to, const char* from) {
      std::memmove(to, from, run_bytes);
    });
  } else if (run_bytes % kLine == 0 && run_bytes <= kInlineRun) {
    static const LineRuns lines = chosen_line_runs();
    calls = lines(layout, outer, out, in, element_size, run_bytes);
  } else if (run_bytes > kInlineRun && streams(layout, outer, run_bytes)) {
    calls = each_run(layout, outer, out, in, element_size,
                     [run_bytes](char* to, const char* from) { stream_run(to, from, run_bytes); });
#if defined(KVSNAP_STREAMING_STORES)
    _mm_sfence();  // streaming stores are weakly ordered: visible before anything that follows
#endif
    streamed_runs += calls;
  } else {
    calls = each_run(layout, outer, out, in, element_size,
                     [run_bytes](char* to, const char* from) { std::memcpy(to, from, run_bytes); });
  }
  memcpy_calls += calls;
  return calls;
}

int64_t strided_copy_calls() { return memcpy_calls; }

int64_t strided_copy_streamed_runs() { return streamed_runs; }

int64_t strided_copy_stream_span() { return stream_span(); }

StreamingWrites::StreamingWrites(bool on) : on_(on) {
  if (on_) ++streaming_scopes;
}
StreamingWrites::~StreamingWrites() {
  if (on_) --streaming_scopes;
}

}  // namespace kvsnap::detail
