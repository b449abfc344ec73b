#include "kvsnap/dlpack.h"

#include <dlpack/dlpack.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <memory>

namespace kvsnap {
namespace {

struct DTypeCode {
  DType dtype;
  DLDataTypeCode code;
};
constexpr DTypeCode kCodes[] = {
    {DType::f32, kDLFloat}, {DType::f16, kDLFloat}, {DType::bf16, kDLBfloat}, {DType::i32, kDLInt}};

DLDataType dlpack_dtype(DType dtype) {
  for (const DTypeCode& entry : kCodes) {
    if (entry.dtype == dtype) {
      return {static_cast<uint8_t>(entry.code), static_cast<uint8_t>(dtype_size(dtype) * 8), 1};
    }
  }
  throw Error(fmt::format("to_dlpack: dtype {} has no DLPack code", dtype_name(dtype)));
}

DType kvsnap_dtype(DLDataType type) {
  for (const DTypeCode& entry : kCodes) {
    if (type.code == entry.code && type.bits == dtype_size(entry.dtype) * 8 && type.lanes == 1) {
      return entry.dtype;
    }
  }
  throw Error(fmt::format(
      "from_dlpack: dtype (code {}, {} bits, {} lanes) is not supported (f32, f16, bf16, i32)",
      type.code, type.bits, type.lanes));
}

// What an exported tensor owns: the array (so its buffer lives) and the extents it points at.
struct Exported {
  DLManagedTensor tensor{};
  Array array;
  int64_t shape[Array::kMaxDims] = {};
  int64_t strides[Array::kMaxDims] = {};
};

}  // namespace

Array from_dlpack(DLManagedTensor* tensor) {
  if (tensor == nullptr) throw Error("from_dlpack: the tensor is null");
  const DLTensor& t = tensor->dl_tensor;
  // Host memory a GPU runtime pinned is CPU memory too.
  const DLDeviceType device = t.device.device_type;
  if (device != kDLCPU && device != kDLCUDAHost && device != kDLROCMHost) {
    throw Error(fmt::format(
        "from_dlpack: the tensor is on device type {}; only CPU memory (kDLCPU, or host memory "
        "a GPU runtime pinned: kDLCUDAHost, kDLROCMHost) is supported",
        static_cast<int>(device)));
  }
  const DType dtype = kvsnap_dtype(t.dtype);
  if (t.ndim < 0 || t.ndim > Array::kMaxDims) {
    throw Error(fmt::format("from_dlpack: the tensor has {} axes; at most {} are supported", t.ndim,
                            Array::kMaxDims));
  }
  if (t.ndim > 0 && t.shape == nullptr) {
    throw Error(fmt::format("from_dlpack: the tensor has {} axes and a null shape", t.ndim));
  }
  const Shape shape(t.shape, t.shape + t.ndim);
  const Shape strides = t.strides != nullptr ? Shape(t.strides, t.strides + t.ndim) : Shape();
  // Null data is refused before the offset is added (null + offset would pass wrap's check).
  if (t.data == nullptr && std::ranges::find(shape, 0) == shape.end()) {
    throw Error(
        fmt::format("from_dlpack: the tensor of shape [{}] has null data", fmt::join(shape, ", ")));
  }
  if (t.byte_offset > (uint64_t{1} << 62)) {
    throw Error(fmt::format("from_dlpack: byte_offset {} is more than 2^62", t.byte_offset));
  }
  void* data = t.data == nullptr ? nullptr : static_cast<char*>(t.data) + t.byte_offset;
  return Array::wrap(data, dtype, shape, strides, [tensor] {
    if (tensor->deleter != nullptr) tensor->deleter(tensor);
  });
}

DLManagedTensor* to_dlpack(const Array& array) {
  if (array.empty()) throw Error("to_dlpack: the array is empty (no storage)");
  auto exported = std::make_unique<Exported>();
  exported->array = array;
  for (int axis = 0; axis < array.ndim(); ++axis) {
    exported->shape[axis] = array.shape()[static_cast<size_t>(axis)];
    exported->strides[axis] = array.strides()[static_cast<size_t>(axis)];
  }
  DLTensor& t = exported->tensor.dl_tensor;
  t.data = array.mutable_bytes();
  t.device = {kDLCPU, 0};
  t.ndim = array.ndim();
  t.dtype = dlpack_dtype(array.dtype());
  t.shape = exported->shape;
  t.strides = exported->strides;
  t.byte_offset = 0;
  exported->tensor.manager_ctx = exported.get();
  exported->tensor.deleter = [](DLManagedTensor* self) {
    delete static_cast<Exported*>(self->manager_ctx);
  };
  return &exported.release()->tensor;
}

}  // namespace kvsnap
