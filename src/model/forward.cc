// The built-in model's forward over a batch of sequence chunks: embedding, the layers' blocks,
// the output head. Rows of equal length form one group and share each layer's cache call;
// activations are packed group after group, row after row, token after token (no padding).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <unordered_map>

#include "kvsnap/ops.h"
#include "kvsnap/recurrent_cache.h"
#include "kvsnap/rotating_kv_cache.h"
#include "model/model.h"
#include "model/weights.h"
#include "ops/activations.h"

namespace kvsnap {
namespace detail {
namespace {

float silu(float v) { return v / (1.0f + std::exp(-v)); }
float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// Rotates pairs (d, d + D/2) of every head of the group's tokens by position * theta^(-2d/D)
// (rotate-half RoPE); token t of row b sits at position offset_b + t.
void rope(Floats& x, const RowGroup& group, int64_t heads, int64_t depth, float theta) {
  const int64_t half = depth / 2, length = group.length();
  std::vector<float> inverse(static_cast<size_t>(half));
  for (int64_t d = 0; d < half; ++d) {
    inverse[static_cast<size_t>(d)] =
        std::pow(theta, -2.0f * static_cast<float>(d) / static_cast<float>(depth));
  }
  for (int64_t b = 0; b < group.rows(); ++b) {
    for (int64_t t = 0; t < length; ++t) {
      const auto position = static_cast<float>(group.batch.seq_offsets[b] + t);
      for (int64_t d = 0; d < half; ++d) {
        const float angle = position * inverse[static_cast<size_t>(d)];
        const float c = std::cos(angle), s = std::sin(angle);
        for (int64_t h = 0; h < heads; ++h) {
          float* v = x.data() + ((b * length + t) * heads + h) * depth;
          const float a = v[d], e = v[d + half];
          v[d] = a * c - e * s;
          v[d + half] = e * c + a * s;
        }
      }
    }
  }
}

// [B*L, H*D] tokens to an Array [B, H, L, D] and back.
Array to_heads(const Floats& x, int64_t rows, int64_t length, int64_t heads, int64_t depth) {
  Array out = Array::uninitialized(DType::f32, {rows, heads, length, depth});
  float* o = out.mutable_data<float>();
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < length; ++t)
        std::copy_n(x.data() + ((b * length + t) * heads + h) * depth, depth,
                    o + ((b * heads + h) * length + t) * depth);
  return out;
}
Floats from_heads(const Array& a) {
  const int64_t rows = a.dim(0), heads = a.dim(1), length = a.dim(2), depth = a.dim(3);
  const float* in = a.data<float>();
  Floats out(static_cast<size_t>(rows * heads * length * depth));
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < length; ++t)
        std::copy_n(in + ((b * heads + h) * length + t) * depth, depth,
                    out.data() + ((b * length + t) * heads + h) * depth);
  return out;
}

// The gated-delta inputs of one row's L tokens, from its convolved channels [L, conv_dim]:
// SiLU, then q and k normalized per head (q also scaled by 1/sqrt(Dk)), v as is.
struct DeltaInputs {
  Floats q, k, v;
};
DeltaInputs delta_inputs(const ModelConfig& c, const float* convolved, int64_t length,
                         int64_t channels) {
  const int64_t depth = c.delta_head_dim, key_width = c.delta_key_heads * depth,
                value_width = c.delta_value_heads * depth;
  DeltaInputs in{Floats(static_cast<size_t>(length * key_width)),
                 Floats(static_cast<size_t>(length * key_width)),
                 Floats(static_cast<size_t>(length * value_width))};
  for (int64_t r = 0; r < length; ++r) {
    const float* row = convolved + r * channels;
    for (int64_t i = 0; i < key_width; ++i) {
      in.q[r * key_width + i] = silu(row[i]);
      in.k[r * key_width + i] = silu(row[key_width + i]);
    }
    for (int64_t i = 0; i < value_width; ++i)
      in.v[r * value_width + i] = silu(row[2 * key_width + i]);
    for (int64_t hk = 0; hk < c.delta_key_heads; ++hk) {
      float* qh = in.q.data() + r * key_width + hk * depth;
      float* kh = in.k.data() + r * key_width + hk * depth;
      float qn = 1e-6f, kn = 1e-6f;
      for (int64_t d = 0; d < depth; ++d) {
        qn += qh[d] * qh[d];
        kn += kh[d] * kh[d];
      }
      const float qs = 1.0f / (std::sqrt(qn) * std::sqrt(static_cast<float>(depth)));
      const float ks = 1.0f / std::sqrt(kn);
      for (int64_t d = 0; d < depth; ++d) {
        qh[d] *= qs;
        kh[d] *= ks;
      }
    }
  }
  return in;
}

}  // namespace

Floats rms_norm(const float* x, int64_t rows, int64_t width, const Floats& weight, float eps) {
  Floats y(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * width;
    float sum = 0.0f;
    for (int64_t i = 0; i < width; ++i) sum += in[i] * in[i];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
    for (int64_t i = 0; i < width; ++i) y[r * width + i] = in[i] * scale * weight[i];
  }
  return y;
}

void attention_block(const ModelWeights& w, const LayerWeights& l, Attention& cache,
                     const RowGroup& group, const Floats& h, float* x) {
  const ModelConfig& c = w.config;
  const int64_t rows = group.rows(), length = group.length(), tokens = rows * length;
  const int64_t q_width = c.query_heads * c.head_dim, kv_width = c.kv_heads * c.head_dim;
  Floats q(static_cast<size_t>(tokens * q_width)), k(static_cast<size_t>(tokens * kv_width)),
      v(static_cast<size_t>(tokens * kv_width));
  matmul(h.data(), tokens, l.packed.wq, q.data());
  matmul(h.data(), tokens, l.packed.wk, k.data());
  matmul(h.data(), tokens, l.packed.wv, v.data());
  rope(q, group, c.query_heads, c.head_dim, c.rope_theta);
  rope(k, group, c.kv_heads, c.head_dim, c.rope_theta);
  const KVHistory history =
      cache.update(group.batch, to_heads(k, rows, length, c.kv_heads, c.head_dim),
                   to_heads(v, rows, length, c.kv_heads, c.head_dim));
  const AttentionMask mask =
      l.kind == 'A' ? AttentionMask::causal() : AttentionMask::sliding_window(c.window);
  const Array out = sdpa(group.batch, to_heads(q, rows, length, c.query_heads, c.head_dim), history,
                         mask, 1.0f / std::sqrt(static_cast<float>(c.head_dim)));
  matmul(from_heads(out).data(), tokens, l.packed.wo, x, /*accumulate=*/true);
}

void recurrent_block(const ModelWeights& w, const LayerWeights& l, RecurrentCache& cache,
                     const RowGroup& group, const Floats& h, float* x) {
  const ModelConfig& c = w.config;
  const int64_t rows = group.rows(), length = group.length(), tokens = rows * length;
  const int64_t channels = w.conv_dim(), value_heads = c.delta_value_heads,
                key_heads = c.delta_key_heads, depth = c.delta_head_dim;
  Floats mixed(static_cast<size_t>(tokens * channels));
  matmul(h.data(), tokens, l.packed.wqkv, mixed.data());
  Floats gate(static_cast<size_t>(tokens * value_heads)), rate(gate.size());
  matmul(h.data(), tokens, l.packed.wa, gate.data());
  matmul(h.data(), tokens, l.packed.wb, rate.data());
  for (int64_t r = 0; r < tokens; ++r) {
    for (int64_t hv = 0; hv < value_heads; ++hv) {
      float& g = gate[static_cast<size_t>(r * value_heads + hv)];
      g = sigmoid(-(g + l.a_bias[static_cast<size_t>(hv)])) * 0.1f + 0.9f;  // decay in (0.9, 1)
      float& b = rate[static_cast<size_t>(r * value_heads + hv)];
      b = sigmoid(b);
    }
  }

  // Each row runs the kernels on its own state, split where its sequence captures.
  const RecurrentHistory state = cache.get(group.batch, DType::f32);
  std::vector<RecurrentStates> states(static_cast<size_t>(rows));
  const int64_t value_width = value_heads * depth;
  Floats output(static_cast<size_t>(tokens * value_width));
  for (int64_t b = 0; b < rows; ++b) {
    // Views of this row's part of a buffer (the kernels read them in place; nothing keeps them).
    const auto view = [](const Floats& f, int64_t first, Shape shape) {
      return Array::wrap(const_cast<float*>(f.data()) + first, DType::f32, std::move(shape));
    };
    const auto at = [&](const Floats& f, int64_t width, Shape shape) {
      return view(f, b * length * width, std::move(shape));
    };
    const std::vector<int64_t> splits = cache.snapshot_splits(group.batch.seq_id(b), length);
    const RecurrentHistory& row = state.row(b);
    Conv1dResult conv =
        causal_conv1d(at(mixed, channels, {1, length, channels}), l.conv, row.conv_state(), splits);
    const DeltaInputs in = delta_inputs(c, conv.output.data<float>(), length, channels);
    GatedDeltaResult delta = gated_delta(
        view(in.q, 0, {1, length, key_heads, depth}), view(in.k, 0, {1, length, key_heads, depth}),
        view(in.v, 0, {1, length, value_heads, depth}),
        at(gate, value_heads, {1, length, value_heads}),
        at(rate, value_heads, {1, length, value_heads}), row.delta_state(), splits);
    std::copy_n(delta.output.data<float>(), length * value_width,
                output.data() + b * length * value_width);
    states[static_cast<size_t>(b)] = {std::move(conv.tails), std::move(delta.states)};
  }
  cache.put(group.batch, states);
  matmul(output.data(), tokens, l.packed.wo, x, /*accumulate=*/true);
}

void mlp_block(const ModelWeights& w, const LayerWeights& l, int64_t tokens, const Floats& h,
               float* x) {
  // The gate and up projections of at most kKept floats of tokens at a time, in a buffer the
  // thread keeps between calls: a prefill's would be tens of megabytes, allocated per layer at
  // the cost of page faults and zeroing. matmul is batch-invariant, so every token's result is
  // the same as in one product over all of them.
  constexpr int64_t kKept = int64_t{2} << 20;
  const int64_t hidden = w.config.hidden, width = w.config.mlp_hidden;
  const int64_t step = std::clamp<int64_t>(kKept / (2 * width), 1, std::max<int64_t>(tokens, 1));
  thread_local Floats buffer;
  if (buffer.size() < static_cast<size_t>(2 * step * width)) {
    buffer.resize(static_cast<size_t>(2 * step * width));
  }
  for (int64_t t0 = 0; t0 < tokens; t0 += step) {
    const int64_t rows = std::min(step, tokens - t0);
    float *gate = buffer.data(), *up = gate + rows * width;
    matmul(h.data() + t0 * hidden, rows, l.packed.w_gate, gate);
    matmul(h.data() + t0 * hidden, rows, l.packed.w_up, up);
    silu_gated(gate, up, rows * width);
    matmul(gate, rows, l.packed.w_down, x + t0 * hidden, /*accumulate=*/true);
  }
}

}  // namespace detail

namespace {

// Checks the request and groups its chunks by length (in order of first appearance); the
// groups' packed token ranges follow each other. `first[i]` is chunk i's first packed token.
struct Plan {
  std::vector<detail::RowGroup> groups;
  std::vector<int64_t> first;
  int64_t tokens = 0;
};

Plan plan(const ModelConfig& c, std::span<const Model::Chunk> chunks,
          std::span<Cache* const> caches, size_t layers) {
  if (caches.size() != layers) {
    throw Error(fmt::format("Model::forward: {} caches for {} layers", caches.size(), layers));
  }
  if (chunks.empty()) throw Error("Model::forward: no chunks to evaluate");
  for (size_t i = 0; i < caches.size(); ++i) {
    if (caches[i] == nullptr) throw Error(fmt::format("Model::forward: layer {} has no cache", i));
  }
  std::vector<Batch::Chunk> rows;
  std::vector<int64_t> lengths;  // distinct, in order of first appearance
  std::vector<size_t> group_of;  // each row's index in lengths
  std::unordered_map<int64_t, size_t> length_group;
  for (const Model::Chunk& chunk : chunks) {
    if (chunk.tokens.empty()) {
      throw Error(fmt::format("Model::forward: sequence {} has no tokens to evaluate", chunk.seq));
    }
    for (int32_t t : chunk.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        throw Error(fmt::format("Model::forward: token {} outside the vocabulary [0, {})", t,
                                c.vocab_size));
      }
    }
    const int64_t offset = caches.front()->offset(chunk.seq);
    for (size_t i = 1; i < caches.size(); ++i) {
      if (caches[i]->offset(chunk.seq) != offset) {
        throw Error(fmt::format(
            "Model::forward: layer {} holds sequence {} at offset {} (layer 0 at offset {}); every "
            "layer needs a sequence at one offset",
            i, chunk.seq, caches[i]->offset(chunk.seq), offset));
      }
    }
    rows.push_back({chunk.seq, offset, {chunk.tokens.begin(), chunk.tokens.end()}});
    const auto length = static_cast<int64_t>(chunk.tokens.size());
    const auto [at, added] = length_group.try_emplace(length, lengths.size());
    if (added) lengths.push_back(length);
    group_of.push_back(at->second);
  }
  // Each sequence once: the groups below are checked each on its own, and one sequence's chunk
  // in two groups would move the first layers before the next group's rows are refused.
  std::vector<int32_t> seqs;
  for (const Batch::Chunk& row : rows) seqs.push_back(row.seq);
  std::sort(seqs.begin(), seqs.end());
  if (const auto twice = std::adjacent_find(seqs.begin(), seqs.end()); twice != seqs.end()) {
    throw Error(fmt::format(
        "Model::forward: sequence {} is given two chunks; a forward evaluates one per sequence",
        *twice));
  }
  // The rows by group, each group's in the chunks' order.
  std::vector<size_t> order(rows.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return group_of[a] < group_of[b]; });
  Plan p;
  p.first.resize(chunks.size());
  for (size_t begin = 0; begin < order.size();) {
    const size_t group = group_of[order[begin]];
    std::vector<Batch::Chunk> members;
    size_t end = begin;
    for (; end < order.size() && group_of[order[end]] == group; ++end) {
      const size_t i = order[end];
      p.first[i] = p.tokens;
      p.tokens += lengths[group];
      members.push_back(rows[i]);
    }
    begin = end;
    p.groups.push_back({Batch::rows(members)});
    p.groups.back().batch.validate("Model::forward");  // distinct sequences
  }
  return p;
}

// Throws Error unless each layer has a cache of its own of the kind and shape it needs: a
// RecurrentCache of the layer's state sizes, a RotatingKVCache of the model's window on a
// sliding-window layer, a full-attention cache (not a window) on an attention layer. Refused
// here, before any layer moves, rather than by a later layer's cache after earlier layers
// were written.
void check_caches(const detail::ModelWeights& w, std::span<Cache* const> caches,
                  std::span<const Model::Chunk> chunks) {
  const ModelConfig& c = w.config;
  std::vector<std::pair<const Cache*, size_t>> held;  // each layer's cache and the layer
  held.reserve(caches.size());
  for (size_t i = 0; i < caches.size(); ++i) held.emplace_back(caches[i], i);
  // By cache (std::less: a total order on unrelated pointers), then layer: the first pair of
  // layers sharing a cache is reported lowest layer first.
  std::sort(held.begin(), held.end(), [](const auto& a, const auto& b) {
    if (a.first != b.first) return std::less<const Cache*>()(a.first, b.first);
    return a.second < b.second;
  });
  if (const auto twice =
          std::adjacent_find(held.begin(), held.end(),
                             [](const auto& a, const auto& b) { return a.first == b.first; });
      twice != held.end()) {
    throw Error(fmt::format(
        "Model::forward: layers {} and {} are given one cache; each layer holds its own state",
        twice->second, std::next(twice)->second));
  }
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const char kind = w.layers[i].kind;
    const auto* recurrent = dynamic_cast<const RecurrentCache*>(caches[i]);
    const auto* window = dynamic_cast<const RotatingKVCache*>(caches[i]);
    const bool attention = dynamic_cast<const Attention*>(caches[i]) != nullptr;
    std::string needs;
    if (kind == 'R' && recurrent == nullptr) needs = "a RecurrentCache";
    if (kind == 'R' && recurrent != nullptr &&
        (recurrent->conv_tail() != c.conv_kernel - 1 || recurrent->conv_dim() != w.conv_dim() ||
         recurrent->num_v_heads() != c.delta_value_heads ||
         recurrent->head_v_dim() != c.delta_head_dim ||
         recurrent->head_k_dim() != c.delta_head_dim)) {
      needs = fmt::format(
          "a RecurrentCache of conv tail {}, conv dim {}, {} value heads of {}x{} (this one: {}, "
          "{}, {} of {}x{})",
          c.conv_kernel - 1, w.conv_dim(), c.delta_value_heads, c.delta_head_dim, c.delta_head_dim,
          recurrent->conv_tail(), recurrent->conv_dim(), recurrent->num_v_heads(),
          recurrent->head_v_dim(), recurrent->head_k_dim());
    }
    for (size_t k = 0; kind == 'R' && recurrent != nullptr && needs.empty() && k < chunks.size();
         ++k) {
      const std::optional<DType> held_dtype = recurrent->state_dtype(chunks[k].seq);
      if (held_dtype && *held_dtype != DType::f32) {
        needs = fmt::format("f32 state: sequence {} holds {} state (fixed until reset)",
                            chunks[k].seq, dtype_name(*held_dtype));
      }
    }
    if (kind == 'S' && (window == nullptr || window->max_size() != c.window)) {
      needs = fmt::format("a RotatingKVCache of the model's window, {} tokens", c.window);
    }
    if (kind == 'A' && (!attention || window != nullptr)) {
      needs = "a full-attention cache (KVCache or PagedKVCache), not a window";
    }
    if (!needs.empty()) throw Error(fmt::format("Model::forward: layer {} needs {}", i, needs));
  }
}

}  // namespace

Array Model::forward(std::span<const Chunk> chunks, std::span<Cache* const> caches,
                     bool all_positions) const {
  const detail::ModelWeights& w = *weights_;
  const ModelConfig& c = w.config;
  const Plan p = plan(c, chunks, caches, w.layers.size());
  check_caches(w, caches, chunks);
  const int64_t hidden = c.hidden;
  detail::Floats x(static_cast<size_t>(p.tokens * hidden));
  for (size_t i = 0; i < chunks.size(); ++i) {
    for (size_t t = 0; t < chunks[i].tokens.size(); ++t) {
      std::copy_n(w.embed.data() + chunks[i].tokens[t] * hidden, hidden,
                  x.data() + (p.first[i] + static_cast<int64_t>(t)) * hidden);
    }
  }
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const detail::LayerWeights& l = w.layers[i];
    int64_t begin = 0;
    for (const detail::RowGroup& group : p.groups) {
      float* rows = x.data() + begin * hidden;
      const int64_t tokens = group.rows() * group.length();
      const detail::Floats h = detail::rms_norm(rows, tokens, hidden, l.input_norm, c.rms_eps);
      if (l.kind == 'R') {
        detail::recurrent_block(w, l, *dynamic_cast<RecurrentCache*>(caches[i]), group, h, rows);
      } else {
        detail::attention_block(w, l, *dynamic_cast<Attention*>(caches[i]), group, h, rows);
      }
      begin += tokens;
    }
    detail::mlp_block(w, l, p.tokens,
                      detail::rms_norm(x.data(), p.tokens, hidden, l.post_norm, c.rms_eps),
                      x.data());
  }
  // The head over the tokens asked for, in chunk order.
  detail::Floats picked;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const auto length = static_cast<int64_t>(chunks[i].tokens.size());
    const int64_t from = all_positions ? p.first[i] : p.first[i] + length - 1;
    picked.insert(picked.end(), x.begin() + from * hidden,
                  x.begin() + (p.first[i] + length) * hidden);
  }
  const int64_t out_rows = static_cast<int64_t>(picked.size()) / hidden;
  const detail::Floats h =
      detail::rms_norm(picked.data(), out_rows, hidden, w.final_norm, c.rms_eps);
  Array logits = Array::uninitialized(DType::f32, {out_rows, c.vocab_size});
  detail::matmul(h.data(), out_rows, w.head, logits.mutable_data<float>());
  return logits;
}

Array Model::forward(std::span<const int32_t> tokens, std::span<Cache* const> caches,
                     bool all_positions) const {
  const Chunk chunk{0, tokens};
  return forward(std::span<const Chunk>(&chunk, 1), caches, all_positions);
}

}  // namespace kvsnap
