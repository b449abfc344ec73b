#include "kvsnap/array.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "array/strided_copy.h"

namespace kvsnap {

namespace detail {

// One buffer, released when the last Array naming it goes away: from an Allocator, or memory
// kvsnap does not own (Array::wrap), handed back through its owner's release callback.
struct Storage {
  Storage(Allocator& allocator, int64_t bytes)
      : allocator(&allocator), bytes(bytes), data(allocator.allocate(bytes)) {}
  Storage(void* external, std::function<void()> release)
      : data(external), release(std::move(release)) {}
  ~Storage() {
    if (allocator != nullptr) {
      allocator->deallocate(data, bytes);
    } else if (release) {
      release();
    }
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // Where copies of this buffer come from: its own allocator, the default one for wrapped memory.
  Allocator& copy_allocator() const {
    return allocator != nullptr ? *allocator : default_allocator();
  }

  Allocator* allocator = nullptr;  // null for wrapped memory
  int64_t bytes = 0;               // allocated bytes (0 for wrapped memory)
  void* data = nullptr;
  std::function<void()> release;  // wrapped memory only
};

}  // namespace detail

namespace {

Shape row_major_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}

int64_t element_count(const Shape& shape) {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  return count;
}

void check_shape(const Shape& shape, const char* call) {
  if (shape.size() > static_cast<size_t>(Array::kMaxDims)) {
    throw Error(fmt::format("{}: shape {} has {} axes; at most {} are supported", call,
                            shape_string(shape), shape.size(), Array::kMaxDims));
  }
  for (int64_t extent : shape) {
    if (extent < 0) {
      throw Error(fmt::format("{}: shape {} has a negative extent", call, shape_string(shape)));
    }
  }
  // Byte counts and strides stay far from overflow: at most 2^60 elements (of at most 8 bytes)
  // in the shape's non-zero extents. An empty array counts them too: its row-major strides
  // are their products all the same.
  constexpr int64_t kMaxElements = int64_t{1} << 60;
  int64_t count = 1;
  for (int64_t extent : shape) {
    if (extent == 0) continue;
    if (__builtin_mul_overflow(count, extent, &count) || count > kMaxElements) {
      throw Error(fmt::format(
          "{}: shape {} holds more than 2^60 elements{}, the most supported", call,
          shape_string(shape),
          std::ranges::find(shape, 0) != shape.end() ? " in its non-zero extents" : ""));
    }
  }
}

float load_float(const char* element, DType dtype) {
  switch (dtype) {
    case DType::f32: {
      float value;
      std::memcpy(&value, element, sizeof value);
      return value;
    }
    case DType::f16: {
      uint16_t bits;
      std::memcpy(&bits, element, sizeof bits);
      return f16_to_float(bits);
    }
    case DType::bf16: {
      uint16_t bits;
      std::memcpy(&bits, element, sizeof bits);
      return bf16_to_float(bits);
    }
    case DType::i32: {
      int32_t value;
      std::memcpy(&value, element, sizeof value);
      return static_cast<float>(value);
    }
  }
  return 0.0f;
}

void store_float(char* element, DType dtype, float value) {
  switch (dtype) {
    case DType::f32:
      std::memcpy(element, &value, sizeof value);
      return;
    case DType::f16: {
      const uint16_t bits = float_to_f16(value);
      std::memcpy(element, &bits, sizeof bits);
      return;
    }
    case DType::bf16: {
      const uint16_t bits = float_to_bf16(value);
      std::memcpy(element, &bits, sizeof bits);
      return;
    }
    case DType::i32: {
      const auto integer = static_cast<int32_t>(value);
      std::memcpy(element, &integer, sizeof integer);
      return;
    }
  }
}

// Calls visit(byte offset of element) for each element in row-major order.
template <class Visit>
void for_each_element(const Shape& shape, const Shape& strides, int64_t element_size,
                      Visit&& visit) {
  const int ndim = static_cast<int>(shape.size());
  if (element_count(shape) == 0) return;
  int64_t index[Array::kMaxDims] = {};
  int64_t offset = 0;
  while (true) {
    visit(offset * element_size);
    int axis = ndim - 1;
    for (; axis >= 0; --axis) {
      offset += strides[axis];
      if (++index[axis] < shape[axis]) break;
      offset -= strides[axis] * shape[axis];
      index[axis] = 0;
    }
    if (axis < 0) return;
  }
}

}  // namespace

std::string shape_string(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Array::Array() = default;

Array Array::uninitialized(DType dtype, Shape shape, Allocator& allocator) {
  check_shape(shape, "Array::uninitialized");
  Array array;
  array.dtype_ = dtype;
  array.strides_ = row_major_strides(shape);
  const int64_t bytes = element_count(shape) * dtype_size(dtype);
  array.shape_ = std::move(shape);
  array.storage_ = std::make_shared<detail::Storage>(allocator, bytes);
  return array;
}

Array Array::zeros(DType dtype, Shape shape, Allocator& allocator) {
  check_shape(shape, "Array::zeros");
  Array array = uninitialized(dtype, std::move(shape), allocator);
  std::memset(array.storage_->data, 0, static_cast<size_t>(array.storage_->bytes));
  return array;
}

Array Array::from_floats(std::span<const float> values, Shape shape, DType dtype) {
  check_shape(shape, "Array::from_floats");
  if (dtype == DType::i32) {  // float -> int has no single right rounding (as astype)
    throw Error("Array::from_floats: dtype i32 is not supported (use from_ints)");
  }
  if (element_count(shape) != static_cast<int64_t>(values.size())) {
    throw Error(fmt::format("Array::from_floats: {} values do not fill shape {} ({} elements)",
                            values.size(), shape_string(shape), element_count(shape)));
  }
  Array array = uninitialized(dtype, std::move(shape));
  auto* out = static_cast<char*>(array.storage_->data);
  if (dtype == DType::f32) {  // no conversion: one copy
    if (!values.empty()) std::memcpy(out, values.data(), values.size() * sizeof(float));
    return array;
  }
  const int64_t step = dtype_size(dtype);
  for (size_t i = 0; i < values.size(); ++i) {
    store_float(out + static_cast<int64_t>(i) * step, dtype, values[i]);
  }
  return array;
}

Array Array::from_ints(std::span<const int32_t> values, Shape shape) {
  check_shape(shape, "Array::from_ints");
  if (element_count(shape) != static_cast<int64_t>(values.size())) {
    throw Error(fmt::format("Array::from_ints: {} values do not fill shape {} ({} elements)",
                            values.size(), shape_string(shape), element_count(shape)));
  }
  Array array = uninitialized(DType::i32, std::move(shape));
  if (!values.empty()) std::memcpy(array.storage_->data, values.data(), values.size_bytes());
  return array;
}

Array Array::wrap(void* data, DType dtype, Shape shape, Shape strides,
                  std::function<void()> release) {
  check_shape(shape, "Array::wrap");
  if (strides.empty()) strides = row_major_strides(shape);
  if (strides.size() != shape.size()) {
    throw Error(fmt::format("Array::wrap: {} strides given for shape {} (need one per axis)",
                            strides.size(), shape_string(shape)));
  }
  for (int64_t stride : strides) {
    if (stride < 0) {
      throw Error(fmt::format("Array::wrap: strides {} include a negative one (not supported)",
                              shape_string(strides)));
    }
  }
  // Every element within 2^62 bytes of `data`, so that no offset computed from the strides (a
  // copy's, a slice's) can overflow. An array of no elements reaches none.
  if (element_count(shape) > 0) {
    const int64_t most = (int64_t{1} << 62) / dtype_size(dtype);
    int64_t reach = 0;  // elements
    for (size_t axis = 0; axis < shape.size(); ++axis) {
      if (shape[axis] < 2) continue;
      if (strides[axis] > (most - reach) / (shape[axis] - 1)) {
        throw Error(fmt::format(
            "Array::wrap: strides {} over shape {} reach more than 2^62 bytes from the data",
            shape_string(strides), shape_string(shape)));
      }
      reach += strides[axis] * (shape[axis] - 1);
    }
  }
  if (data == nullptr && element_count(shape) > 0) {
    throw Error(fmt::format("Array::wrap: null data for shape {}", shape_string(shape)));
  }
  if (reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(dtype_size(dtype)) != 0) {
    throw Error(fmt::format("Array::wrap: data {} is not aligned to {} bytes ({} elements)",
                            fmt::ptr(data), dtype_size(dtype), dtype_name(dtype)));
  }
  Array array;
  array.dtype_ = dtype;
  array.shape_ = std::move(shape);
  array.strides_ = std::move(strides);
  array.storage_ = std::make_shared<detail::Storage>(data, std::move(release));
  return array;
}

void Array::bad_axis(int axis, const char* call) const {
  throw Error(
      fmt::format("{}: axis {} out of range for {}-d array {}", call, axis, ndim(), describe()));
}

int64_t Array::size() const { return empty() ? 0 : element_count(shape_); }

bool Array::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

Array Array::slice(int axis, int64_t start, int64_t stop) const {
  const int a = normalize_axis(axis, "Array::slice");
  if (start < 0 || start > stop || stop > shape_[a]) {
    throw Error(
        fmt::format("Array::slice: range [{}, {}) out of range for axis {} of {} (need 0 <= start "
                    "<= stop <= {})",
                    start, stop, axis, describe(), shape_[a]));
  }
  Array view = *this;
  view.offset_ += start * strides_[a];
  view.shape_[a] = stop - start;
  return view;
}

Array Array::transpose(int axis_a, int axis_b) const {
  const int a = normalize_axis(axis_a, "Array::transpose");
  const int b = normalize_axis(axis_b, "Array::transpose");
  Array view = *this;
  std::swap(view.shape_[a], view.shape_[b]);
  std::swap(view.strides_[a], view.strides_[b]);
  return view;
}

Array Array::reshape(Shape shape) const {
  check_shape(shape, "Array::reshape");
  if (empty()) throw Error("Array::reshape: the array is empty (no storage)");
  if (element_count(shape) != size()) {
    throw Error(fmt::format("Array::reshape: cannot reshape {} ({} elements) to {} ({} elements)",
                            describe(), size(), shape_string(shape), element_count(shape)));
  }
  if (!is_contiguous()) {
    throw Error(
        fmt::format("Array::reshape: {} is a strided view; call contiguous() first", describe()));
  }
  Array view = *this;
  view.strides_ = row_major_strides(shape);
  view.shape_ = std::move(shape);
  return view;
}

Array Array::contiguous() const {
  if (empty()) return Array();
  Array copy = uninitialized(dtype_, shape_, storage_->copy_allocator());
  copy.assign(*this);
  return copy;
}

Array Array::astype(DType dtype) const {
  if (empty()) return Array();
  if (dtype == dtype_) return contiguous();
  if (dtype == DType::i32) {  // float -> int has no single right rounding; make callers choose
    throw Error(
        fmt::format("Array::astype: conversion {} -> i32 is not supported", dtype_name(dtype_)));
  }
  Array copy = uninitialized(dtype, shape_, storage_->copy_allocator());
  const char* in = static_cast<const char*>(raw_data(dtype_size(dtype_)));
  char* out = static_cast<char*>(copy.storage_->data);
  const int64_t out_step = dtype_size(dtype);
  int64_t index = 0;
  for_each_element(shape_, strides_, dtype_size(dtype_), [&](int64_t byte_offset) {
    store_float(out + index++ * out_step, dtype, load_float(in + byte_offset, dtype_));
  });
  return copy;
}

std::vector<float> Array::to_floats() const {
  std::vector<float> values;
  if (empty()) return values;
  if (dtype_ == DType::f32) {  // no conversion: one (strided) copy
    values.resize(static_cast<size_t>(size()));
    const Shape compact = row_major_strides(shape_);
    detail::strided_copy(values.data(), compact.data(), raw_data(4), strides_.data(), shape_.data(),
                         ndim(), 4);
    return values;
  }
  values.reserve(static_cast<size_t>(size()));
  const char* in = static_cast<const char*>(raw_data(dtype_size(dtype_)));
  for_each_element(shape_, strides_, dtype_size(dtype_), [&](int64_t byte_offset) {
    values.push_back(load_float(in + byte_offset, dtype_));
  });
  return values;
}

std::vector<int32_t> Array::to_ints() const {
  if (!empty() && dtype_ != DType::i32) {
    throw Error(fmt::format("Array::to_ints: array is {}, not i32", describe()));
  }
  std::vector<int32_t> values(static_cast<size_t>(size()));
  if (values.empty()) return values;
  Shape compact = row_major_strides(shape_);
  detail::strided_copy(values.data(), compact.data(), raw_data(4), strides_.data(), shape_.data(),
                       ndim(), 4);
  return values;
}

void Array::assign(const Array& source) const {
  if (empty() || source.empty()) {
    throw Error(fmt::format("Array::assign: cannot copy {} into {} (empty array)",
                            source.describe(), describe()));
  }
  if (source.dtype_ != dtype_ || source.shape_ != shape_) {
    throw Error(
        fmt::format("Array::assign: source {} does not match destination {} (shape and "
                    "dtype must be equal)",
                    source.describe(), describe()));
  }
  detail::strided_copy(raw_data(dtype_size(dtype_)), strides_.data(),
                       source.raw_data(dtype_size(dtype_)), source.strides_.data(), shape_.data(),
                       ndim(), dtype_size(dtype_));
}

void Array::assign_slice(int axis, int64_t start, const Array& source) const {
  const int a = normalize_axis(axis, "Array::assign_slice");
  bool fits = !source.empty() && source.dtype_ == dtype_ && source.ndim() == ndim() && start >= 0;
  for (int i = 0; fits && i < ndim(); ++i) {
    // start <= extent - length: start + length could overflow for a start near INT64_MAX.
    fits = i == a ? source.shape_[i] <= shape_[i] && start <= shape_[i] - source.shape_[i]
                  : source.shape_[i] == shape_[i];
  }
  if (!fits) {
    throw Error(
        fmt::format("Array::assign_slice: source {} does not fit at {} along axis {} of {} "
                    "(dtype and other extents must match)",
                    source.describe(), start, axis, describe()));
  }
  char* destination =
      static_cast<char*>(raw_data(dtype_size(dtype_))) + start * strides_[a] * dtype_size(dtype_);
  detail::strided_copy(destination, strides_.data(), source.raw_data(dtype_size(dtype_)),
                       source.strides_.data(), source.shape_.data(), ndim(), dtype_size(dtype_));
}

bool Array::shares_storage(const Array& other) const {
  return storage_ != nullptr && storage_ == other.storage_;
}

void* Array::raw_data(std::size_t element_size) const {
  if (empty()) throw Error("Array::data: the array is empty (no storage)");
  if (static_cast<int64_t>(element_size) != dtype_size(dtype_)) {
    throw Error(fmt::format("Array::data: element type of {} bytes requested from {}", element_size,
                            describe()));
  }
  return static_cast<char*>(storage_->data) + offset_ * dtype_size(dtype_);
}

std::string Array::describe() const {
  if (empty()) return "empty";
  return fmt::format("{}{}", dtype_name(dtype_), shape_string(shape_));
}

}  // namespace kvsnap
