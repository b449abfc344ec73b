// Internal: the built-in model's weights, and the blocks its forward is made of.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kvsnap/attention.h"
#include "kvsnap/cache.h"
#include "kvsnap/recurrent_cache.h"
#include "model/model.h"

namespace kvsnap::detail {

using Floats = std::vector<float>;

// W [in, out] as matmul reads it: column panels of kPanel columns, each stored [in, width]
// contiguously (width kPanel; the last panel out % kPanel when that is not 0), so a product
// streams each panel front to back instead of striding across W's rows. Derived from the
// row-major matrix; the values, and so every product, are the same. Stored in an Array of its
// own, or at a place in one shared by all of a model's matrices (ModelWeights::derive), which is
// large enough for huge pages (kvsnap/allocator.h): a decode step streams all of them.
class PackedMatrix {
 public:
  static constexpr int64_t kPanel = 32;
  PackedMatrix() = default;
  PackedMatrix(const Floats& w, int64_t in, int64_t out)
      : PackedMatrix(w, in, out, Array::zeros(DType::f32, Shape{in * out}), 0) {}
  // Packs w into `storage` (f32) from float `at` on, which must hold in * out floats.
  PackedMatrix(const Floats& w, int64_t in, int64_t out, const Array& storage, int64_t at)
      : in_(in), out_(out), storage_(storage), data_(storage.data<float>() + at) {
    float* const into = storage_.mutable_data<float>() + at;
    for (int64_t j = 0; j < out; j += kPanel) {
      const int64_t width = this->width(j);
      float* to = into + j * in;
      for (int64_t k = 0; k < in; ++k) {
        std::copy_n(w.data() + k * out + j, width, to + k * width);
      }
    }
  }
  int64_t in() const { return in_; }
  int64_t out() const { return out_; }
  // The panel whose first column is j (a multiple of kPanel), and its width.
  const float* panel(int64_t j) const { return data_ + j * in_; }
  int64_t width(int64_t j) const { return std::min(kPanel, out_ - j); }

 private:
  int64_t in_ = 0, out_ = 0;
  Array storage_;  // holds data_
  const float* data_ = nullptr;
};

// What matmul reads: each layer matrix packed (PackedMatrix); derived, not saved.
struct PackedLayer {
  PackedMatrix wq, wk, wv, wqkv, wa, wb, wo, w_gate, w_up, w_down;
};

// Matrices are row-major [in, out] so a block computes y = x W.
struct LayerWeights {
  char kind = 'A';
  Floats input_norm, post_norm;
  Floats wq, wk, wv;            // attention
  Floats wqkv, wa, a_bias, wb;  // recurrent
  Array conv;                   // recurrent: [conv_dim, kernel]
  Floats wo;                    // both: output projection
  Floats w_gate, w_up, w_down;  // MLP
  PackedLayer packed;           // the matrices above as matmul reads them (derive())
};

struct ModelWeights {
  ModelConfig config;
  Floats embed;       // [vocab, hidden]; also the output head
  PackedMatrix head;  // embed transposed, [hidden, vocab]: derived (derive()), not saved
  Floats final_norm;
  std::vector<LayerWeights> layers;

  // Fills what is derived from the weights (head, the packed matrices) once they are set. The
  // packed matrices lie one after another (each from a cache line on) in one Array, in the
  // order a forward reads them.
  void derive() {
    const ModelConfig& c = config;
    Floats transposed(embed.size());
    for (int64_t v = 0; v < c.vocab_size; ++v) {
      for (int64_t h = 0; h < c.hidden; ++h) {
        transposed[h * c.vocab_size + v] = embed[v * c.hidden + h];
      }
    }
    const int64_t q = c.query_heads * c.head_dim, kv = c.kv_heads * c.head_dim,
                  value = c.delta_value_heads * c.delta_head_dim;
    struct Job {
      const Floats* w;
      int64_t in, out;
      PackedMatrix* into;
    };
    std::vector<Job> jobs;
    head = PackedMatrix();  // the storage a previous derive() made goes before the new one comes
    for (LayerWeights& l : layers) {
      PackedLayer& p = l.packed;
      for (const Job& job :
           {Job{&l.wqkv, c.hidden, conv_dim(), &p.wqkv},
            Job{&l.wa, c.hidden, c.delta_value_heads, &p.wa},
            Job{&l.wb, c.hidden, c.delta_value_heads, &p.wb}, Job{&l.wq, c.hidden, q, &p.wq},
            Job{&l.wk, c.hidden, kv, &p.wk}, Job{&l.wv, c.hidden, kv, &p.wv},
            Job{&l.wo, l.kind == 'R' ? value : q, c.hidden, &p.wo},
            Job{&l.w_gate, c.hidden, c.mlp_hidden, &p.w_gate},
            Job{&l.w_up, c.hidden, c.mlp_hidden, &p.w_up},
            Job{&l.w_down, c.mlp_hidden, c.hidden, &p.w_down}}) {
        *job.into = PackedMatrix();
        if (!job.w->empty()) jobs.push_back(job);
      }
    }
    jobs.push_back({&transposed, c.hidden, c.vocab_size, &head});
    constexpr int64_t kLine = 16;  // floats per cache line
    const auto place = [&](const Job& job) {
      return (job.in * job.out + kLine - 1) / kLine * kLine;
    };
    int64_t total = 0;
    for (const Job& job : jobs) total += place(job);
    const Array storage = Array::zeros(DType::f32, Shape{total});
    int64_t at = 0;
    for (const Job& job : jobs) {
      *job.into = PackedMatrix(*job.w, job.in, job.out, storage, at);
      at += place(job);
    }
  }

  int64_t conv_dim() const {
    return 2 * config.delta_key_heads * config.delta_head_dim +
           config.delta_value_heads * config.delta_head_dim;
  }

  // Visits every tensor by name with its shape, in a fixed order (init, save and load agree).
  template <class Visit>
  void for_each(Visit&& visit) {
    const ModelConfig& c = config;
    visit("embed", embed, Shape{c.vocab_size, c.hidden}, 1.0f);
    visit("final_norm", final_norm, Shape{c.hidden}, 0.0f);
    const int64_t q = c.query_heads * c.head_dim, kv = c.kv_heads * c.head_dim;
    for (size_t i = 0; i < layers.size(); ++i) {
      LayerWeights& l = layers[i];
      const auto name = [&](const char* field) { return fmt::format("layers.{}.{}", i, field); };
      const float in = 1.0f / std::sqrt(static_cast<float>(c.hidden));
      visit(name("input_norm"), l.input_norm, Shape{c.hidden}, 0.0f);
      visit(name("post_norm"), l.post_norm, Shape{c.hidden}, 0.0f);
      if (l.kind == 'R') {
        const int64_t value = c.delta_value_heads * c.delta_head_dim;
        visit(name("wqkv"), l.wqkv, Shape{c.hidden, conv_dim()}, in);
        visit(name("wa"), l.wa, Shape{c.hidden, c.delta_value_heads}, in);
        visit(name("a_bias"), l.a_bias, Shape{c.delta_value_heads}, -4.0f);
        visit(name("wb"), l.wb, Shape{c.hidden, c.delta_value_heads}, in);
        visit(name("wo"), l.wo, Shape{value, c.hidden},
              1.0f / std::sqrt(static_cast<float>(value)));
      } else {
        visit(name("wq"), l.wq, Shape{c.hidden, q}, in);
        visit(name("wk"), l.wk, Shape{c.hidden, kv}, in);
        visit(name("wv"), l.wv, Shape{c.hidden, kv}, in);
        visit(name("wo"), l.wo, Shape{q, c.hidden}, 1.0f / std::sqrt(static_cast<float>(q)));
      }
      visit(name("w_gate"), l.w_gate, Shape{c.hidden, c.mlp_hidden}, in);
      visit(name("w_up"), l.w_up, Shape{c.hidden, c.mlp_hidden}, in);
      visit(name("w_down"), l.w_down, Shape{c.mlp_hidden, c.hidden},
            1.0f / std::sqrt(static_cast<float>(c.mlp_hidden)));
    }
  }
};

// Rows of one forward that hold the same number of tokens: one Batch (no padding) whose
// activations are packed row after row, token after token: [rows * length, width].
struct RowGroup {
  Batch batch;
  int64_t rows() const { return batch.batch_size(); }
  int64_t length() const { return batch.length(); }
};

// y[rows, out] (+)= x[rows, in] W[in, out]. Batch-invariant (matmul.cc): row r's result is
// bitwise the same whatever the other rows are and however many.
void matmul(const float* x, int64_t rows, const PackedMatrix& w, float* y, bool accumulate = false);

// Every variant of matmul's kernel this CPU runs — "portable" (multiply, then add), then where
// supported "avx2" and "avx512" (fused multiply-adds, bitwise equal to each other); matmul uses
// the last — each run on the calling thread over all columns, so that tests cover them all.
struct MatmulVariant {
  const char* name;
  void (*run)(const float* x, int64_t rows, const PackedMatrix& w, float* y, bool accumulate);
};
std::vector<MatmulVariant> matmul_variants();
Floats rms_norm(const float* x, int64_t rows, int64_t width, const Floats& weight, float eps);

// The blocks of one group, each adding its output to the group's residual stream x
// [tokens, hidden] given the normalized input h.
void attention_block(const ModelWeights& w, const LayerWeights& l, Attention& cache,
                     const RowGroup& group, const Floats& h, float* x);
void recurrent_block(const ModelWeights& w, const LayerWeights& l, RecurrentCache& cache,
                     const RowGroup& group, const Floats& h, float* x);
void mlp_block(const ModelWeights& w, const LayerWeights& l, int64_t tokens, const Floats& h,
               float* x);

}  // namespace kvsnap::detail
