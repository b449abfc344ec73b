// Internal: the one routine that moves array elements between strided layouts.
#pragma once

#include <cstdint>

#include "array/streaming.h"

namespace kvsnap::detail {

// Copies the elements of `shape` (ndim axes) from `source` to `destination`; strides are in
// elements. Axes contiguous in both layouts are collapsed first so each memcpy moves a whole
// contiguous run. Source and destination may overlap only within one run (each run is moved
// with memmove), e.g. shifting tokens along the token axis of every head. Long runs of a copy
// larger than the last-level cache bypass the caches (streaming stores, fenced before the
// return; see strided_copy_stream_span). Returns the number of runs moved.
int64_t strided_copy(void* destination, const int64_t* destination_strides, const void* source,
                     const int64_t* source_strides, const int64_t* shape, int ndim,
                     int64_t element_size);

// memcpy calls made by strided_copy on this thread (monotonic), so tests can check that a copy
// moved whole runs rather than single elements.
int64_t strided_copy_calls();

// Runs strided_copy wrote with streaming stores on this thread (monotonic).
int64_t strided_copy_streamed_runs();

}  // namespace kvsnap::detail
