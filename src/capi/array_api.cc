// The C API for arrays: creation, wrapping of memory kvsnap does not own, DLPack, inspection.
#include <cstring>

#include "capi/handles.h"
#include "kvsnap/dlpack.h"

using namespace kvsnap;
using namespace kvsnap::capi;

extern "C" {

kvsnap_status kvsnap_array_zeros(kvsnap_dtype dtype, int ndim, const int64_t* shape,
                                 kvsnap_array** out) {
  constexpr const char* call = "kvsnap_array_zeros";
  return guard(call, [&] {
    require(out, call, "out");
    *out = new_array(Array::zeros(to_dtype(dtype, call), to_shape(ndim, shape, call, "shape")));
  });
}

kvsnap_status kvsnap_array_from_data(kvsnap_dtype dtype, int ndim, const int64_t* shape,
                                     const void* data, kvsnap_array** out) {
  constexpr const char* call = "kvsnap_array_from_data";
  return guard(call, [&] {
    require(out, call, "out");
    Array array = Array::uninitialized(to_dtype(dtype, call), to_shape(ndim, shape, call, "shape"));
    if (array.nbytes() > 0) {
      require_data(data, call, "data");
      std::memcpy(array.mutable_bytes(), data, static_cast<size_t>(array.nbytes()));
    }
    *out = new_array(std::move(array));
  });
}

kvsnap_status kvsnap_array_wrap(void* data, kvsnap_dtype dtype, int ndim, const int64_t* shape,
                                const int64_t* strides, void (*release)(void* context),
                                void* context, kvsnap_array** out) {
  constexpr const char* call = "kvsnap_array_wrap";
  return guard(call, [&] {
    require(out, call, "out");
    const Shape extents = to_shape(ndim, shape, call, "shape");
    const Shape steps = strides != nullptr ? to_shape(ndim, strides, call, "strides") : Shape();
    auto handle = std::make_unique<kvsnap_array>();
    std::function<void()> on_release;
    if (release != nullptr) on_release = [release, context] { release(context); };
    handle->array = Array::wrap(data, to_dtype(dtype, call), extents, steps, std::move(on_release));
    *out = handle.release();
  });
}

kvsnap_status kvsnap_array_get_info(const kvsnap_array* array, kvsnap_array_info* out) {
  constexpr const char* call = "kvsnap_array_get_info";
  return guard(call, [&] {
    const Array& a = require(array, call, "array").array;
    kvsnap_array_info& info = require(out, call, "out");
    info = {};
    info.dtype = static_cast<kvsnap_dtype>(a.dtype());
    info.ndim = a.ndim();
    for (int axis = 0; axis < a.ndim(); ++axis) {
      info.shape[axis] = a.shape()[static_cast<size_t>(axis)];
      info.strides[axis] = a.strides()[static_cast<size_t>(axis)];
    }
    info.data = a.empty() ? nullptr : a.mutable_bytes();
  });
}

kvsnap_status kvsnap_array_slice(const kvsnap_array* array, int axis, int64_t start, int64_t stop,
                                 kvsnap_array** out) {
  constexpr const char* call = "kvsnap_array_slice";
  return guard(call, [&] {
    const Array& a = require(array, call, "array").array;
    require(out, call, "out");
    *out = new_array(a.slice(axis, start, stop));
  });
}

kvsnap_status kvsnap_array_copy_to(const kvsnap_array* array, void* destination, size_t capacity) {
  constexpr const char* call = "kvsnap_array_copy_to";
  return guard(call, [&] {
    const Array& a = require(array, call, "array").array;
    const auto bytes = static_cast<size_t>(a.nbytes());
    if (bytes == 0) return;
    require_data(destination, call, "destination");
    if (capacity < bytes) {
      throw InvalidArgument(fmt::format("{}: capacity {} bytes is less than the {} bytes of {}",
                                        call, capacity, bytes, a.describe()));
    }
    // Byte by byte: the destination need not be aligned to the element size.
    const Array compact = a.is_contiguous() ? a : a.contiguous();
    std::memcpy(destination, compact.bytes(), bytes);
  });
}

bool kvsnap_array_shares_storage(const kvsnap_array* a, const kvsnap_array* b) {
  return a != nullptr && b != nullptr && a->array.shares_storage(b->array);
}

void kvsnap_array_destroy(kvsnap_array* array) { delete array; }

kvsnap_status kvsnap_array_from_dlpack(struct DLManagedTensor* tensor, kvsnap_array** out) {
  constexpr const char* call = "kvsnap_array_from_dlpack";
  return guard(call, [&] {
    require(out, call, "out");
    require_data(tensor, call, "tensor");
    auto handle = std::make_unique<kvsnap_array>();
    handle->array = from_dlpack(tensor);
    *out = handle.release();
  });
}

kvsnap_status kvsnap_array_to_dlpack(const kvsnap_array* array, struct DLManagedTensor** out) {
  constexpr const char* call = "kvsnap_array_to_dlpack";
  return guard(call, [&] {
    const Array& a = require(array, call, "array").array;
    require(out, call, "out");
    *out = to_dlpack(a);
  });
}

}  // extern "C"
