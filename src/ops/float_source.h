// Internal: reading a kernel's input arrays as floats.
#pragma once

#include <vector>

#include "kvsnap/array.h"

namespace kvsnap::detail {

// An array's elements as floats, read in place when it is compact f32 (the built-in model's
// case: no copy per call) and converted into a buffer otherwise.
class FloatSource {
 public:
  explicit FloatSource(const Array& array) {
    if (array.dtype() == DType::f32 && array.is_contiguous()) {
      data_ = array.size() > 0 ? array.data<float>() : nullptr;
    } else {
      copy_ = array.to_floats();
      data_ = copy_.data();
    }
  }
  FloatSource(const FloatSource&) = delete;
  FloatSource& operator=(const FloatSource&) = delete;
  const float* data() const { return data_; }
  float operator[](size_t i) const { return data_[i]; }

 private:
  std::vector<float> copy_;
  const float* data_ = nullptr;
};

}  // namespace kvsnap::detail
