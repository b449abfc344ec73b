#include "kvsnap/ops.h"
#include "ops/checks.h"
#include "ops/float_source.h"

namespace kvsnap {

Conv1dResult causal_conv1d(const Array& x, const Array& weight, const Array& tail,
                           std::span<const int64_t> boundaries) {
  constexpr const char* kCall = "causal_conv1d";
  detail::require_ndim(x, 3, kCall, "x", "[B, L, C]");
  detail::require_ndim(weight, 2, kCall, "weight", "[C, W]");
  detail::require_float(x, kCall, "x");
  detail::require_float(weight, kCall, "weight");
  const int64_t rows = x.dim(0), length = x.dim(1), channels = x.dim(2);
  detail::require_extent(weight, 0, channels, kCall, "weight");
  const int64_t width = weight.dim(1);
  if (width < 1)
    throw Error(fmt::format("causal_conv1d: weight {} has no taps", weight.describe()));
  const int64_t tail_rows = width - 1;
  if (!tail.empty()) {
    detail::require_ndim(tail, 3, kCall, "tail", "[B, W-1, C]");
    detail::require_extent(tail, 0, rows, kCall, "tail");
    detail::require_extent(tail, 1, tail_rows, kCall, "tail");
    detail::require_extent(tail, 2, channels, kCall, "tail");
    if (tail.dtype() != x.dtype()) {
      throw Error(fmt::format("causal_conv1d: tail {} must have x's dtype {}", tail.describe(),
                              dtype_name(x.dtype())));
    }
  }
  detail::require_boundaries(boundaries, length, kCall);

  // xx = concat(tail, x) along time, kept in x's dtype so tails are exact copies of inputs.
  const int64_t total = tail_rows + length;
  Array extended = Array::zeros(x.dtype(), {rows, total, channels});
  if (!tail.empty() && tail_rows > 0) extended.slice(1, 0, tail_rows).assign(tail);
  if (length > 0) extended.slice(1, tail_rows, total).assign(x);

  const detail::FloatSource xx(extended), w(weight);
  Conv1dResult result;
  result.output = Array::uninitialized(DType::f32, {rows, length, channels});
  float* out = result.output.mutable_data<float>();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t t = 0; t < length; ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        float sum = 0.0f;
        for (int64_t i = 0; i < width; ++i) {
          sum += w[static_cast<size_t>(c * width + i)] *
                 xx[static_cast<size_t>((b * total + t + i) * channels + c)];
        }
        out[(b * length + t) * channels + c] = sum;
      }
    }
  }
  for (int64_t boundary : boundaries) {
    result.tails.push_back(extended.slice(1, boundary, boundary + tail_rows).contiguous());
  }
  result.tails.push_back(extended.slice(1, length, length + tail_rows).contiguous());
  return result;
}

}  // namespace kvsnap
