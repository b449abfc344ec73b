// DLPack interop: kvsnap arrays to and from DLManagedTensor (dlpack/dlpack.h, v0.6), the
// exchange format of numpy, PyTorch, JAX and many engines — without copying.
//
//   DLManagedTensor* t = kvsnap::to_dlpack(history.keys());  // a view that keeps the buffer alive
//   kvsnap::Array same = kvsnap::from_dlpack(t);             // wraps it; t->deleter runs when
//                                                            // the last Array naming it goes away
//
// Include <dlpack/dlpack.h> (Debian: libdlpack-dev) to read the tensor's fields.
#pragma once

#include "kvsnap/array.h"
#include "kvsnap/export.h"

struct DLManagedTensor;

namespace kvsnap {

// An Array over `tensor`'s memory (Array::wrap: no copy, not counted in live_bytes()). The tensor
// must be in CPU memory (kDLCPU, or host memory a GPU runtime pinned: kDLCUDAHost, kDLROCMHost), of
// dtype f32, f16, bf16 or i32 (one lane), with at most 4 axes and non-negative strides (none:
// row-major). Takes ownership: tensor->deleter(tensor) runs once, when the last Array naming the
// memory goes away. Throws Error naming what is unsupported; then the tensor is not consumed (the
// caller still owns it).
[[nodiscard]] KVSNAP_EXPORT Array from_dlpack(DLManagedTensor* tensor);

// A tensor viewing `array` (CPU; its dtype, shape and element strides; no copy) that keeps the
// array's buffer alive until its deleter runs. Throws Error for an empty array.
[[nodiscard]] KVSNAP_EXPORT DLManagedTensor* to_dlpack(const Array& array);

}  // namespace kvsnap
