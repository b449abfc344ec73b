// A tiny recurrent layer (causal conv + gated delta rule) driven through a RecurrentCache,
// with inputs that are a fixed function of token ids, and its from-scratch reference.
#pragma once

#include <kvsnap/kvsnap.h>

#include <cmath>
#include <span>
#include <vector>

namespace kvsnap::testing {

struct RecurrentLayer {
  int conv_tail = 3, conv_dim = 6, key_heads = 1, value_heads = 2, key_depth = 4, value_depth = 3;
  DType activation = DType::f32;

  RecurrentCache make_cache() const {
    return RecurrentCache(conv_tail, conv_dim, value_heads, value_depth, key_depth);
  }

  static float wave(int64_t id, int64_t i, float a, float b) {
    return std::sin(static_cast<float>(id) * a + static_cast<float>(i) * b);
  }
  Array per_token(std::span<const int64_t> ids, Shape tail, float a, float b, float scale,
                  float bias, DType dtype = DType::f32) const {
    int64_t width = 1;
    for (int64_t extent : tail) width *= extent;
    std::vector<float> data;
    for (int64_t id : ids)
      for (int64_t i = 0; i < width; ++i) data.push_back(bias + scale * wave(id, i, a, b));
    Shape shape{1, static_cast<int64_t>(ids.size())};
    shape.insert(shape.end(), tail.begin(), tail.end());
    return Array::from_floats(data, shape, dtype);
  }
  Array weight() const {
    std::vector<float> w;
    for (int c = 0; c < conv_dim; ++c)
      for (int i = 0; i <= conv_tail; ++i) w.push_back(0.3f * wave(c, i, 0.7f, 1.9f));
    return Array::from_floats(w, {conv_dim, conv_tail + 1});
  }

  struct Output {
    Array conv;   // [1, L, conv_dim]
    Array delta;  // [1, L, Hv, Dv]
  };

  Output run(std::span<const int64_t> ids, const Array& conv_tail_state, const Array& state,
             std::span<const int64_t> splits, Conv1dResult* conv_out,
             GatedDeltaResult* delta_out) const {
    const auto x = per_token(ids, {conv_dim}, 0.37f, 0.91f, 1.0f, 0.0f, activation);
    const auto q = per_token(ids, {key_heads, key_depth}, 0.53f, 0.29f, 0.5f, 0.0f);
    const auto k = per_token(ids, {key_heads, key_depth}, 0.61f, 0.47f, 0.4f, 0.0f);
    const auto v = per_token(ids, {value_heads, value_depth}, 0.71f, 0.83f, 1.0f, 0.0f);
    const auto g = per_token(ids, {value_heads}, 0.43f, 0.11f, 0.05f, 0.93f);
    const auto beta = per_token(ids, {value_heads}, 0.97f, 0.37f, 0.3f, 0.5f);
    *conv_out = causal_conv1d(x, weight(), conv_tail_state, splits);
    *delta_out = gated_delta(q, k, v, g, beta, state, splits);
    return {conv_out->output, delta_out->output};
  }

  // One forward of `ids` through the cache: get, kernels (stopping at the scheduled splits),
  // put.
  Output forward(RecurrentCache& cache, std::span<const int64_t> ids, SeqId seq = 0) const {
    const auto length = static_cast<int64_t>(ids.size());
    Batch batch = Batch::uniform(1, length, cache.offset(seq));
    batch.seq_ids = {seq};
    const std::vector<int64_t> splits = cache.snapshot_splits(seq, length);
    const RecurrentHistory history = cache.get(batch, activation);
    Conv1dResult conv;
    GatedDeltaResult delta;
    Output out = run(ids, history.conv_state(), history.delta_state(), splits, &conv, &delta);
    cache.put(batch, conv.tails, delta.states);
    return out;
  }

  // The whole sequence from zero state; `states` gets the (conv, delta) state after it.
  Output reference(std::span<const int64_t> ids, std::pair<Array, Array>* states = nullptr) const {
    Conv1dResult conv;
    GatedDeltaResult delta;
    Output out = run(ids, Array(), Array(), {}, &conv, &delta);
    if (states != nullptr) *states = {conv.tails.back(), delta.states.back()};
    return out;
  }
};

}  // namespace kvsnap::testing
