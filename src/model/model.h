// The built-in tiny hybrid transformer: what `kvsnap replay` runs, built only from kvsnap's
// caches and reference kernels. Part of the tools (not installed): it links kvsnap_internal.
//
// Token embedding, then a pattern of layers — 'A' full attention with RoPE and GQA (KVCache),
// 'S' sliding-window attention (RotatingKVCache), 'R' a gated-delta-net layer with a short causal
// conv (RecurrentCache) — each followed by a SwiGLU MLP, RMSNorm before every block, and an
// output head tied to the embedding. Weights come deterministically from a seed or from a
// safetensors file with a JSON config.
//
//   kvsnap::Model model(kvsnap::ModelConfig{});       // default size, seed 42
//   auto caches = model.make_caches();
//   kvsnap::Array logits = model.forward(prompt, kvsnap::cache_pointers(caches));
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvsnap/array.h"
#include "kvsnap/cache.h"

namespace kvsnap {

struct ModelConfig {
  int64_t vocab_size = 512;
  int64_t hidden = 256;
  int64_t mlp_hidden = 768;
  int64_t query_heads = 8;
  int64_t kv_heads = 2;
  int64_t head_dim = 32;
  int64_t window = 256;            // tokens a sliding-window layer sees
  std::string pattern = "RSARSA";  // layer kinds from the input up
  int64_t conv_kernel = 4;         // recurrent layers' causal conv width
  int64_t delta_key_heads = 2;
  int64_t delta_value_heads = 4;
  int64_t delta_head_dim = 32;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-6f;
  uint64_t seed = 42;
  // The most tokens one sequence may hold: prompt plus reply. Callers (`kvsnap replay`) refuse
  // a request over it up front, as serving engines do; forward itself does not check it.
  int64_t context_length = 32768;

  // Throws Error naming the field and the rule when a value is out of range.
  void validate() const;
  // JSON with the fields above (missing fields keep their defaults; unknown ones are errors).
  static ModelConfig from_json(const std::string& text);
  // from_json of the file at `path`: at most 1 MiB, read without blocking on a FIFO; Error
  // "ModelConfig::from_file: ..." naming the path when it cannot be read.
  static ModelConfig from_file(const std::string& path);
  std::string to_json() const;
  // Parameters the model holds.
  int64_t parameter_count() const;
  // The floating-point operations (2 per multiply-add) of a forward of `tokens` tokens of one
  // sequence at positions [offset, offset + tokens) that returns its last token's logits: the
  // matrix products, attention's scores and weighted values over the columns each token sees
  // (every one up to it; its last `window` in a sliding-window layer), the recurrent layers'
  // convolution and state updates (three multiply-adds per state element). Norms, activations,
  // softmax, RoPE and the state's decay (one multiply per element) are not counted. The work
  // that `kvsnap bench` sets against the fma peak; 0 for tokens <= 0.
  double forward_flops(int64_t offset, int64_t tokens) const;
};

namespace detail {
struct ModelWeights;
}

class Model {
 public:
  // Weights generated deterministically from config.seed.
  explicit Model(ModelConfig config);
  // Loads a JSON config and safetensors weights (as written by save); throws Error for weights
  // save did not write (metadata "format" other than "kvsnap-model"), a missing tensor, one
  // that is not f32, or a shape that disagrees with the config.
  static Model load(const std::string& config_path, const std::string& weights_path);
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  ~Model();

  // Writes the weights and the config, each to a temporary beside it (mode 0600, as every file
  // kvsnap writes), synced, then renames both over their files, the weights first; throws Error
  // naming the file that failed. An error while writing (a full disk) replaces neither file.
  void save(const std::string& config_path, const std::string& weights_path) const;
  const ModelConfig& config() const;
  // 32 hex digits: an XXH3-128 digest of every weight's bytes, in a fixed order. What makes
  // saved state valid for this model besides its config: weights generated from one seed differ
  // where another standard library or libm draws other values.
  std::string weights_digest() const;

  struct CacheOptions {
    bool paged = false;         // full-attention layers in a PagedKVCache (else a KVCache)
    int64_t block_tokens = 16;  // the paged caches' block size
  };
  // One cache per layer, in layer order, of the kind the layer needs.
  std::vector<std::unique_ptr<Cache>> make_caches() const;
  std::vector<std::unique_ptr<Cache>> make_caches(CacheOptions options) const;

  // Evaluates `tokens` for sequence 0 at the caches' common offset and advances them. Returns
  // f32 logits [L, vocab] when `all_positions`, else [1, vocab] for the last token.
  Array forward(std::span<const int32_t> tokens, std::span<Cache* const> caches,
                bool all_positions = false) const;

  // Tokens of one sequence for a batched forward.
  struct Chunk {
    int32_t seq = 0;
    std::span<const int32_t> tokens;
  };
  // Evaluates every chunk for its sequence at that sequence's offset (the same in every
  // layer's cache) in one forward — continuous batching: one chunk may be a prefill while
  // the others decode a token — and advances each sequence. Chunks of equal length share each
  // layer's cache call. Returns f32 logits for each chunk's last token [chunks, vocab], or
  // with `all_positions` for all tokens [total tokens, vocab], chunk after chunk. Throws Error
  // (nothing evaluated) for an empty chunk, a token outside the vocabulary, a sequence twice,
  // a sequence whose layers disagree on its offset, or caches that do not fit the layers (one
  // cache for two layers, another kind, a recurrent state of other sizes, a window of another
  // size). A failure once layers run — out of memory, or an attention cache whose keys another
  // model's heads set — leaves the chunks' sequences at different offsets in different layers:
  // reset them (or restore them) before the next forward.
  Array forward(std::span<const Chunk> chunks, std::span<Cache* const> caches,
                bool all_positions = false) const;

 private:
  struct Unfilled {};
  // The config checked and the layers listed, their tensors empty (load fills them).
  Model(ModelConfig config, Unfilled);
  std::unique_ptr<detail::ModelWeights> weights_;
};

// Raw pointers to owned caches, in order (for Model::forward and PrefixCache).
std::vector<Cache*> cache_pointers(const std::vector<std::unique_ptr<Cache>>&);

}  // namespace kvsnap
