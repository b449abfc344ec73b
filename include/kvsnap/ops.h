// Reference kernels in float32: scaled-dot-product attention over a cache's history, and for
// recurrent layers causal depthwise conv1d with a carried tail and the gated delta rule.
//
// Both run over one forward chunk and can stop at interior `boundaries`, returning the state
// at each boundary and at the end — what RecurrentCache::put wants. Running a sequence in
// segments, carrying the returned state, gives the same outputs and states as one run:
//
//   auto conv = kvsnap::causal_conv1d(x, weight, tail, /*boundaries=*/{4});
//   // conv.output [B, L, C]; conv.tails[0] is the tail after 4 tokens, tails[1] after L.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvsnap/array.h"
#include "kvsnap/attention.h"
#include "kvsnap/export.h"

namespace kvsnap {

// Threads the kernels use — sdpa over a batch, and the built-in model's matrix products — the
// calling thread included; 1 (the default) runs everything on the calling thread. Work is split
// by output rows, columns or heads, never inside a sum, so results are bitwise the same for every
// count. One parallel region runs at a time: calls from several threads at once are correct,
// those that find the workers busy run on their own thread. Throws Error outside [1, 256] or
// when called from inside a task the workers run (a region run on the calling thread alone —
// one task, one thread, or the workers busy — holds nothing, and does not refuse it).
// Attention's products go through BLAS: with a
// multithreaded OpenBLAS, give it one thread (OPENBLAS_NUM_THREADS=1) so the two do not
// multiply.
KVSNAP_EXPORT void set_threads(int threads);
KVSNAP_EXPORT int threads();

// Reference scaled-dot-product attention in float32. q [B, Hq, L, D] (any float dtype), the
// history's keys [B, H, K, D] and values [B, H, K, Dv]; GQA when Hq is a multiple of H (query
// head h reads key head h / (Hq / H)). Returns f32 [B, Hq, L, Dv]:
//   out[b,h,l] = softmax_k(scale * q[b,h,l]·key[b,h',k] + mask[b,h,l,k]) · value[b,h',k]
// A query that sees no key (padding) gets zeros. Cost O(B·Hq·L·K·(D+Dv)).
KVSNAP_EXPORT Array sdpa(const Batch&, const Array& q, const KVHistory&,
                         const AttentionMask& logical, float scale);

struct Conv1dResult {
  Array output;              // f32 [B, L, C]
  std::vector<Array> tails;  // one per boundary, then the end; each [B, W-1, C] in x's dtype
};

// Causal depthwise conv1d. x [B, L, C], weight [C, W], tail [B, W-1, C] holding the W-1
// inputs before x (an empty Array means zeros). With xx = concat(tail, x) along time:
//   output[b, t, c] = sum_{i=0}^{W-1} weight[c, i] * xx[b, t + i, c]
// The tail at time t (0 < t <= L) is xx[b, t : t + W - 1, :], the last W-1 inputs up to t.
// `boundaries` are ascending interior times in (0, L). No activation is applied.
KVSNAP_EXPORT Conv1dResult causal_conv1d(const Array& x, const Array& weight, const Array& tail,
                                         std::span<const int64_t> boundaries = {});

struct GatedDeltaResult {
  Array output;               // f32 [B, L, Hv, Dv]
  std::vector<Array> states;  // one per boundary, then the end; each f32 [B, Hv, Dv, Dk]
};

// Gated delta rule recurrence. q, k [B, L, Hk, Dk]; v [B, L, Hv, Dv] with Hv a multiple of Hk
// (value head h reads key head h / (Hv / Hk)); g, beta [B, L, Hv]; state [B, Hv, Dv, Dk] f32
// (an empty Array means zeros). Per row b, value head h and time t, with S = state[b, h]
// ([Dv, Dk]), q_t and k_t the key-head vectors, v_t the value vector:
//   S   <- g_t * S                          (decay, g_t in (0, 1])
//   u   =  S k_t                            (what the state recalls for k_t, [Dv])
//   S   <- S + beta_t * (v_t - u) k_t^T     (delta-rule write)
//   o_t =  S q_t                            (output, [Dv])
// q is used as given (apply any 1/sqrt(Dk) scaling or normalization before the call).
// `boundaries` are ascending interior times in (0, L).
KVSNAP_EXPORT GatedDeltaResult gated_delta(const Array& q, const Array& k, const Array& v,
                                           const Array& g, const Array& beta, const Array& state,
                                           std::span<const int64_t> boundaries = {});

}  // namespace kvsnap
