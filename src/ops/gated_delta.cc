#include <cstring>

#include "kvsnap/ops.h"
#include "ops/checks.h"
#include "ops/float_source.h"

namespace kvsnap {

namespace {

// Throws Error naming gated_delta unless the inputs have the documented shapes.
void check_inputs(const Array& q, const Array& k, const Array& v, const Array& g, const Array& beta,
                  const Array& state, std::span<const int64_t> boundaries) {
  constexpr const char* kCall = "gated_delta";
  detail::require_ndim(q, 4, kCall, "q", "[B, L, Hk, Dk]");
  detail::require_ndim(k, 4, kCall, "k", "[B, L, Hk, Dk]");
  detail::require_ndim(v, 4, kCall, "v", "[B, L, Hv, Dv]");
  detail::require_ndim(g, 3, kCall, "g", "[B, L, Hv]");
  detail::require_ndim(beta, 3, kCall, "beta", "[B, L, Hv]");
  for (const Array* a : {&q, &k, &v, &g, &beta}) detail::require_float(*a, kCall, "input");
  const int64_t rows = q.dim(0), length = q.dim(1), key_heads = q.dim(2), key_depth = q.dim(3);
  const int64_t value_heads = v.dim(2), value_depth = v.dim(3);
  if (k.shape() != q.shape()) {
    throw Error(fmt::format("gated_delta: k {} must have q's shape {}", k.describe(),
                            shape_string(q.shape())));
  }
  detail::require_extent(v, 0, rows, kCall, "v");
  detail::require_extent(v, 1, length, kCall, "v");
  if (key_heads == 0 || value_heads % key_heads != 0) {
    throw Error(fmt::format("gated_delta: {} value heads is not a multiple of {} key heads",
                            value_heads, key_heads));
  }
  const Shape gate_shape{rows, length, value_heads};
  if (g.shape() != gate_shape || beta.shape() != gate_shape) {
    throw Error(fmt::format("gated_delta: g {} and beta {} must both be {}", g.describe(),
                            beta.describe(), shape_string(gate_shape)));
  }
  const Shape state_shape{rows, value_heads, value_depth, key_depth};
  if (!state.empty() && (state.shape() != state_shape || state.dtype() != DType::f32)) {
    throw Error(fmt::format("gated_delta: state {} must be f32{}", state.describe(),
                            shape_string(state_shape)));
  }
  detail::require_boundaries(boundaries, length, kCall);
}

// Sums of products over 16 interleaved lanes (four 4-float vectors, what every x86-64 CPU
// holds in a register: lane l takes elements l, l + 16, …; a tail past the last 16 goes to a
// scalar), added in a fixed tree at the end: the order of every sum is the same whatever the
// CPU, the batch or the thread, so a state restored from a snapshot continues exactly as the
// uninterrupted run.
using Vec = float __attribute__((vector_size(16)));
constexpr int64_t kVec = 4, kLanes = 4 * kVec;

struct Lanes {
  Vec v[4] = {};
  float tail = 0.0f;
  float total() const {
    const Vec s = (v[0] + v[2]) + (v[1] + v[3]);
    return ((s[0] + s[2]) + (s[1] + s[3])) + tail;
  }
};
Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// Rewrites each element of a state row as update(row[j], k[j]) — `update` takes four-float
// vectors and single floats alike — and returns the sum of the new row times x.
template <class Update>
float update_and_dot(float* __restrict row, const float* __restrict k, const float* __restrict x,
                     int64_t depth, Update update) {
  const int64_t whole = depth - depth % kLanes;
  Lanes sum;
  for (int64_t j = 0; j < whole; j += kLanes) {
    for (int64_t l = 0; l < 4; ++l) {
      const int64_t at = j + l * kVec;
      const Vec s = update(load(row + at), load(k + at));
      store(row + at, s);
      sum.v[l] += s * load(x + at);
    }
  }
  for (int64_t j = whole; j < depth; ++j) {
    row[j] = update(row[j], k[j]);
    sum.tail += row[j] * x[j];
  }
  return sum.total();
}

// One time step of one value head: decay S ([Dv, Dk]), the delta-rule write of v for k, and the
// output S q into `out` ([Dv]).
void delta_step(float* S, const float* q, const float* k, const float* v, float decay, float rate,
                int64_t value_depth, int64_t key_depth, float* out) {
  for (int64_t i = 0; i < value_depth; ++i) {
    float* Si = S + i * key_depth;
    const float u =
        update_and_dot(Si, k, k, key_depth, [decay](auto s, auto) { return s * decay; });
    const float write = rate * (v[i] - u);
    out[i] =
        update_and_dot(Si, k, q, key_depth, [write](auto s, auto kj) { return s + write * kj; });
  }
}

}  // namespace

GatedDeltaResult gated_delta(const Array& q, const Array& k, const Array& v, const Array& g,
                             const Array& beta, const Array& state,
                             std::span<const int64_t> boundaries) {
  check_inputs(q, k, v, g, beta, state, boundaries);
  const int64_t rows = q.dim(0), length = q.dim(1), key_heads = q.dim(2), key_depth = q.dim(3);
  const int64_t value_heads = v.dim(2), value_depth = v.dim(3);
  const Shape state_shape{rows, value_heads, value_depth, key_depth};
  const detail::FloatSource qf(q), kf(k), vf(v), gf(g), bf(beta);
  // The state evolves in the array the last capture returns; earlier captures are copies.
  Array current = state.empty() ? Array::zeros(DType::f32, state_shape) : state.contiguous();
  float* s = current.mutable_data<float>();
  GatedDeltaResult result;
  result.output = Array::uninitialized(DType::f32, {rows, length, value_heads, value_depth});
  float* out = result.output.mutable_data<float>();
  const int64_t group = value_heads / key_heads;

  auto capture = [&] { result.states.push_back(current.contiguous()); };
  size_t next_boundary = 0;
  for (int64_t t = 0; t < length; ++t) {
    for (int64_t b = 0; b < rows; ++b) {
      for (int64_t h = 0; h < value_heads; ++h) {
        const int64_t kh = h / group;
        const int64_t gate = (b * length + t) * value_heads + h;
        delta_step(s + ((b * value_heads + h) * value_depth) * key_depth,
                   qf.data() + ((b * length + t) * key_heads + kh) * key_depth,
                   kf.data() + ((b * length + t) * key_heads + kh) * key_depth,
                   vf.data() + gate * value_depth, gf[static_cast<size_t>(gate)],
                   bf[static_cast<size_t>(gate)], value_depth, key_depth, out + gate * value_depth);
      }
    }
    if (next_boundary < boundaries.size() && boundaries[next_boundary] == t + 1) {
      capture();
      ++next_boundary;
    }
  }
  result.states.push_back(std::move(current));
  return result;
}

}  // namespace kvsnap
