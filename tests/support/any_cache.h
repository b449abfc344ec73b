// Writing to any built-in cache kind by sequence, for tests that run over every kind.
#pragma once

#include <kvsnap/kvsnap.h>

#include <cstdint>
#include <vector>

#include "support/cache_support.h"
#include "support/recurrent_support.h"

namespace kvsnap::testing {

// Writes `ids` to sequence `seq` at its offset: a forward of the default RecurrentLayer, or an
// update with the default TokenKV's keys and values.
inline void write_to(Cache& cache, SeqId seq, const std::vector<int64_t>& ids) {
  if (auto* recurrent = dynamic_cast<RecurrentCache*>(&cache)) {
    (void)RecurrentLayer{}.forward(*recurrent, ids, seq);
    return;
  }
  const TokenKV kv;
  const std::vector<int32_t> tokens(ids.size(), 1);
  (void)dynamic_cast<Attention&>(cache).update(Batch::rows({{seq, cache.offset(seq), tokens}}),
                                               kv.keys(ids), kv.values(ids));
}

}  // namespace kvsnap::testing
