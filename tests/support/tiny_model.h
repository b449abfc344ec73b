// Test support: the built-in model at a size that runs a whole workload in milliseconds.
#pragma once

#include <cstdint>

#include "model/model.h"

namespace kvsnap::testing {

// Three layers (recurrent, sliding window of `window` tokens, attention), hidden size 32.
inline ModelConfig tiny_model(int64_t window = 24) {
  ModelConfig c;
  c.hidden = 32;
  c.mlp_hidden = 48;
  c.query_heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.window = window;
  c.pattern = "RSA";
  c.delta_key_heads = 1;
  c.delta_value_heads = 2;
  c.delta_head_dim = 8;
  return c;
}

}  // namespace kvsnap::testing
