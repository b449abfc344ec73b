// Shape — the extents (or element strides) of an Array: a small vector held inline.
//
// It reads like the std::vector<int64_t> it replaces (brace construction, size(), operator[],
// iteration, ==, push_back, construction from and conversion to std::vector) but never touches
// the heap, so making array views — the histories a cache hands back every decode step —
// allocates nothing.
//
//   kvsnap::Shape shape{2, 8, 128};
//   shape.push_back(64);                       // [2, 8, 128, 64]
//   std::vector<int64_t> extents = shape;      // converts where a vector is wanted
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <vector>

#include "kvsnap/export.h"

namespace kvsnap {

class KVSNAP_EXPORT Shape {
 public:
  using value_type = int64_t;
  using size_type = std::size_t;
  using reference = int64_t&;
  using const_reference = const int64_t&;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;

  // Extents a Shape can hold; Array itself accepts at most Array::kMaxDims (4) of them.
  static constexpr size_type kCapacity = 8;

  Shape() = default;
  Shape(std::initializer_list<int64_t> extents) { assign(extents.begin(), extents.end()); }
  Shape(const std::vector<int64_t>& extents) {  // NOLINT: implicit, as the vector form allowed
    assign(extents.begin(), extents.end());
  }
  explicit Shape(size_type count, int64_t value = 0) { resize(count, value); }
  template <std::input_iterator Iterator>
  Shape(Iterator first, Iterator last) {
    assign(first, last);
  }

  // Where a std::vector<int64_t> is wanted.
  operator std::vector<int64_t>() const { return {begin(), end()}; }  // NOLINT: implicit

  size_type size() const { return size_; }
  bool empty() const { return size_ == 0; }
  static constexpr size_type max_size() { return kCapacity; }
  int64_t& operator[](size_type i) { return extents_[i]; }
  const int64_t& operator[](size_type i) const { return extents_[i]; }
  int64_t& front() { return extents_[0]; }
  const int64_t& front() const { return extents_[0]; }
  int64_t& back() { return extents_[size_ - 1]; }
  const int64_t& back() const { return extents_[size_ - 1]; }
  int64_t* data() { return extents_; }
  const int64_t* data() const { return extents_; }
  iterator begin() { return extents_; }
  iterator end() { return extents_ + size_; }
  const_iterator begin() const { return extents_; }
  const_iterator end() const { return extents_ + size_; }
  const_iterator cbegin() const { return begin(); }
  const_iterator cend() const { return end(); }

  // Throw kvsnap::Error when the result would exceed kCapacity extents.
  void push_back(int64_t extent) {
    require(size_ + 1);
    extents_[size_++] = extent;
  }
  void pop_back() { --size_; }
  void clear() { size_ = 0; }
  void resize(size_type count, int64_t value = 0) {
    require(count);
    for (size_type i = size_; i < count; ++i) extents_[i] = value;
    size_ = count;
  }
  template <std::input_iterator Iterator>
  void assign(Iterator first, Iterator last) {
    size_ = 0;
    for (; first != last; ++first) push_back(static_cast<int64_t>(*first));
  }
  // Inserts [first, last) before `position`.
  template <std::input_iterator Iterator>
  iterator insert(const_iterator position, Iterator first, Iterator last) {
    const auto at = static_cast<size_type>(position - begin());
    Shape tail(begin() + at, end());
    size_ = at;
    for (; first != last; ++first) push_back(static_cast<int64_t>(*first));
    for (int64_t extent : tail) push_back(extent);
    return begin() + at;
  }
  iterator insert(const_iterator position, int64_t extent) {
    const int64_t one[] = {extent};
    return insert(position, one, one + 1);
  }

  friend bool operator==(const Shape& a, const Shape& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  // Throws kvsnap::Error unless `count` extents fit.
  static void require(size_type count);

  int64_t extents_[kCapacity] = {};
  size_type size_ = 0;
};

}  // namespace kvsnap
