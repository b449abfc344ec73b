// Internal: the one routine that moves array elements between strided layouts.
#pragma once

#include <cstdint>

namespace kvsnap::detail {

// Copies the elements of `shape` (ndim axes) from `source` to `destination`; strides are in
// elements. Axes contiguous in both layouts are collapsed first so each memcpy moves a whole
// contiguous run. Source and destination may overlap only within one run (each run is moved
// with memmove), e.g. shifting tokens along the token axis of every head. Long runs into a
// destination larger than a last-level cache bypass the caches (streaming stores, fenced before
// the return). Returns the number of runs moved.
int64_t strided_copy(void* destination, const int64_t* destination_strides, const void* source,
                     const int64_t* source_strides, const int64_t* shape, int ndim,
                     int64_t element_size);

// memcpy calls made by strided_copy on this thread (monotonic), so tests can check that a copy
// moved whole runs rather than single elements.
int64_t strided_copy_calls();

// Runs strided_copy wrote with streaming stores on this thread (monotonic): runs longer than a
// kilobyte into a destination spanning strided_copy_stream_span() bytes or more, which the
// last-level cache would not keep anyway.
int64_t strided_copy_streamed_runs();
// The destination span from which long runs stream: the last-level cache's size (sysfs), else
// 32 MiB; 0 where this build never streams (no SSE2, or under a sanitizer, which would not see
// the streaming stores: memcpy instead).
int64_t strided_copy_stream_span();

}  // namespace kvsnap::detail
