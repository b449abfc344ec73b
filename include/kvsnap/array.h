// Array — a small eager n-d array (up to 4-d) over reference-counted, accounted storage.
//
// An Array is a cheap handle: copying it shares the buffer. `slice` returns a strided view of
// the same buffer; `contiguous`/`clone` make a compact copy. Storage comes from an Allocator
// that counts bytes, so `live_bytes()` proves what an operation allocated.
//
//   auto a = kvsnap::Array::from_floats(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
//   auto col = a.slice(1, 1, 2);                // [[2], [5]], shares a's storage
//   auto half = col.astype(kvsnap::DType::f16); // converted, compact copy
//   std::vector<float> v = half.to_floats();    // {2, 5}
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvsnap/allocator.h"
#include "kvsnap/dtype.h"
#include "kvsnap/error.h"
#include "kvsnap/export.h"
#include "kvsnap/shape.h"

namespace kvsnap {

namespace detail {
struct Storage;
}

class KVSNAP_EXPORT Array {
 public:
  // The most axes an Array may have.
  static constexpr int kMaxDims = 4;

  // An empty handle: no storage, no shape. Most calls on it throw.
  Array();

  // A compact array of zeros. Throws on a negative extent or more than kMaxDims axes.
  [[nodiscard]] static Array zeros(DType, Shape, Allocator& = default_allocator());
  // A compact array whose contents are unspecified: for buffers about to be overwritten, where
  // zeroing would be a wasted pass over memory.
  [[nodiscard]] static Array uninitialized(DType, Shape, Allocator& = default_allocator());
  // A compact array holding `values` (row-major) converted to `dtype` (a float dtype: i32 is
  // refused, as by astype; from_ints makes one); sizes must agree.
  [[nodiscard]] static Array from_floats(std::span<const float> values, Shape,
                                         DType dtype = DType::f32);
  // A compact i32 array holding `values` (row-major); sizes must agree.
  [[nodiscard]] static Array from_ints(std::span<const int32_t> values, Shape);
  // An array over memory kvsnap does not own, without copying it. `data` points at element
  // [0, ..., 0]; `strides` are in elements, one per axis, non-negative (empty: row-major). The
  // memory must stay valid until `release` runs: once, when the last Array naming it (views,
  // snapshots, a cache that adopted it) goes away, on the thread that drops it; it must not
  // throw. Wrapped bytes count in no Allocator (live_bytes() is unchanged); copies made from it
  // (contiguous, astype) come from the default allocator. Throws Error on a bad shape or strides,
  // or null data with elements; then `release` is not called (the caller keeps the memory).
  [[nodiscard]] static Array wrap(void* data, DType, Shape shape, Shape strides = {},
                                  std::function<void()> release = {});

  bool empty() const { return storage_ == nullptr; }
  DType dtype() const { return dtype_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  // Extent of `axis`; a negative axis counts from the end. Throws when out of range.
  int64_t dim(int axis) const { return shape_[normalize_axis(axis, "Array::dim")]; }
  const Shape& shape() const { return shape_; }
  // Element strides (not bytes), one per axis.
  const Shape& strides() const { return strides_; }
  int64_t size() const;  // element count
  int64_t nbytes() const { return size() * dtype_size(dtype_); }
  // True when elements are laid out row-major with no gaps (views can be).
  bool is_contiguous() const;

  // View of [start, stop) along `axis`, sharing storage; allocates no storage.
  // Throws unless 0 <= start <= stop <= dim(axis).
  [[nodiscard]] Array slice(int axis, int64_t start, int64_t stop) const;
  // View with two axes exchanged, sharing storage.
  [[nodiscard]] Array transpose(int axis_a, int axis_b) const;
  // View with a new shape of the same element count; requires is_contiguous().
  [[nodiscard]] Array reshape(Shape) const;
  // Compact row-major copy in a new buffer (always allocates). Copies move whole contiguous runs.
  [[nodiscard]] Array contiguous() const;
  // Same as contiguous().
  [[nodiscard]] Array clone() const { return contiguous(); }
  // Compact copy converted to `dtype` (a plain copy when the dtype is the same).
  [[nodiscard]] Array astype(DType dtype) const;
  // Elements in logical (row-major) order, converted to float.
  std::vector<float> to_floats() const;
  // Elements in logical order of an i32 array.
  std::vector<int32_t> to_ints() const;

  // Writes `source`'s elements into the storage this view names (same shape and dtype). Where
  // the two overlap, each contiguous run moves as memmove: where each run's source and
  // destination overlap only each other (tokens shifted along the token axis of every head
  // inside one buffer, as a window cache does) the result is exact; a run's write that reaches
  // another run's source is not supported.
  void assign(const Array& source) const;

  // Writes `source` into [start, start + source.dim(axis)) along `axis` of this array; the other
  // extents and the dtype must match. Same as slice(axis, ...).assign(source) without making the
  // view (no allocation at all: for per-token hot paths).
  void assign_slice(int axis, int64_t start, const Array& source) const;

  // True when both handles name the same underlying buffer.
  bool shares_storage(const Array& other) const;

  // Pointer to the first element (the view's offset applied). T must match dtype's size.
  template <class T>
  const T* data() const {
    return static_cast<const T*>(raw_data(sizeof(T)));
  }
  template <class T>
  T* mutable_data() const {
    return static_cast<T*>(raw_data(sizeof(T)));
  }

  // Untyped pointer to the first element (the view's offset applied).
  const void* bytes() const { return raw_data(dtype_size(dtype_)); }
  void* mutable_bytes() const { return raw_data(dtype_size(dtype_)); }

  // "f16[2, 8, 4]" — for error messages and debugging.
  std::string describe() const;

 private:
  void* raw_data(std::size_t element_size) const;
  // `axis` counted from the front; throws naming `call` when out of range (inline: the checks of
  // every hot path ask it many times per token).
  int normalize_axis(int axis, const char* call) const {
    const int normalized = axis < 0 ? axis + ndim() : axis;
    if (normalized < 0 || normalized >= ndim()) [[unlikely]] {
      bad_axis(axis, call);
    }
    return normalized;
  }
  [[noreturn]] void bad_axis(int axis, const char* call) const;

  std::shared_ptr<detail::Storage> storage_;
  DType dtype_ = DType::f32;
  Shape shape_;
  Shape strides_;
  int64_t offset_ = 0;  // in elements
};

// "[2, 8, 4]"
KVSNAP_EXPORT std::string shape_string(const Shape&);

}  // namespace kvsnap
