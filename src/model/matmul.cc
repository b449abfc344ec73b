// The built-in model's matrix products y = x W (W row-major [in, out]): a register-blocked kernel
// that reads W in place, for every row count.
//
// Why not cblas_sgemm: (1) batch invariance — every output element is one sum over k in order,
// whatever the number of rows and wherever a row sits in the batch, so a sequence's projections
// are bitwise the same decoded alone, fused with seven others, or prefilled in a chunk, and the
// parallel replay agrees with the sequential one up to attention alone; sgemm (and sgemv for one
// row) change their blocking and so their rounding with the row count. (2) Speed at the sizes a
// decode step has: sgemm packs all of W on every call, which costs more than a product of a few
// rows (bench/matmul_benchmarks.cc measures both against a memcpy of W).
//
// Every multiply-add is written out (std::fma where the chosen variant has FMA, a * b + c in the
// default one, and the file is built with -ffp-contract=off), so no compiler heuristic can fuse
// one instantiation's sums and not another's.
#include <algorithm>
#include <cmath>

#include "model/weights.h"
#include "ops/parallel.h"
#include "ops/vector_isa.h"

namespace kvsnap::detail {
namespace {

// Rows [0, R) of y, output columns [j, j + W): R x W sums held in registers while k runs over
// W's rows in order, from zero; each weight is loaded once for all R rows. Accumulating adds the
// finished sum to y (adding each product to a large residual instead would round 256+ times).
template <bool Fused>
[[gnu::always_inline]] inline float madd(float a, float b, float c) {
  return Fused ? std::fma(a, b, c) : a * b + c;  // this file: -ffp-contract=off
}

template <bool Fused, int R, int W>
[[gnu::always_inline]] inline void block(const float* x, int64_t in, const float* w, int64_t out,
                                         float* y, int64_t j, bool accumulate) {
  float sum[R][W];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < W; ++c) sum[r][c] = 0.0f;
  }
  for (int64_t k = 0; k < in; ++k) {
    const float* wk = w + k * out + j;
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * in + k];
      for (int c = 0; c < W; ++c) sum[r][c] = madd<Fused>(xr, wk[c], sum[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < W; ++c) {
      float& to = y[r * out + j + c];
      to = accumulate ? to + sum[r][c] : sum[r][c];
    }
  }
}

// Rows [0, R) of y, columns [first, last): blocks of W columns (wide blocks keep enough sums in
// flight when R is small), then of 32, then one column at a time — each the same sum in the same
// order, so how columns are split (into blocks, or between threads) never changes a result.
template <bool Fused, int R, int W>
[[gnu::always_inline]] inline void rows(const float* x, int64_t in, const float* w, int64_t out,
                                        float* y, int64_t first, int64_t last, bool accumulate) {
  int64_t j = first;
  for (; j + W <= last; j += W) block<Fused, R, W>(x, in, w, out, y, j, accumulate);
  for (; j + 32 <= last; j += 32) block<Fused, R, 32>(x, in, w, out, y, j, accumulate);
  for (; j < last; ++j) block<Fused, R, 1>(x, in, w, out, y, j, accumulate);
}

template <bool Fused>
[[gnu::always_inline]] inline void product(const float* x, int64_t count, int64_t in,
                                           const float* w, int64_t out, float* y, int64_t first,
                                           int64_t last, bool accumulate) {
  int64_t r = 0;
  for (; r + 8 <= count; r += 8) {
    rows<Fused, 8, 32>(x + r * in, in, w, out, y + r * out, first, last, accumulate);
  }
  for (; r + 4 <= count; r += 4) {
    rows<Fused, 4, 64>(x + r * in, in, w, out, y + r * out, first, last, accumulate);
  }
  for (; r + 2 <= count; r += 2) {
    rows<Fused, 2, 64>(x + r * in, in, w, out, y + r * out, first, last, accumulate);
  }
  for (; r < count; ++r) {
    rows<Fused, 1, 128>(x + r * in, in, w, out, y + r * out, first, last, accumulate);
  }
}

using Product = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t,
                         int64_t, bool);

void product_default(const float* x, int64_t count, int64_t in, const float* w, int64_t out,
                     float* y, int64_t first, int64_t last, bool accumulate) {
  product<false>(x, count, in, w, out, y, first, last, accumulate);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The same kernel compiled for wider vectors with explicit fused multiply-adds, chosen once by
// what the CPU supports (one binary runs everywhere).
[[gnu::target("avx512f,fma")]] void product_avx512(const float* x, int64_t count, int64_t in,
                                                   const float* w, int64_t out, float* y,
                                                   int64_t first, int64_t last, bool accumulate) {
  product<true>(x, count, in, w, out, y, first, last, accumulate);
}
[[gnu::target("avx2,fma")]] void product_avx2(const float* x, int64_t count, int64_t in,
                                              const float* w, int64_t out, float* y, int64_t first,
                                              int64_t last, bool accumulate) {
  product<true>(x, count, in, w, out, y, first, last, accumulate);
}
Product pick() {
  switch (vector_isa()) {
    case VectorIsa::avx512:
      return product_avx512;
    case VectorIsa::avx2:
      return product_avx2;
    case VectorIsa::baseline:
      break;
  }
  return product_default;
}
#else
Product pick() { return product_default; }
#endif

}  // namespace

void matmul(const float* x, int64_t rows, int64_t in, const Floats& w, int64_t out, float* y,
            bool accumulate) {
  static const Product chosen = pick();
  // Split between the kernels' threads (ops/parallel.h) when there is enough work: prefill-sized
  // products by rows (8-row blocks), decode-sized ones by columns (each thread reads its part of
  // W). A row's sums are the same whichever thread computes them.
  constexpr int64_t kMinimumWork = int64_t(1) << 17;  // multiply-adds; below, a region costs more
  const int64_t threads = parallel_threads();
  const int64_t work = rows * in * out;
  if (threads > 1 && work >= kMinimumWork && rows >= 16 * threads) {
    const int64_t blocks = (rows + 7) / 8;
    parallel_for(threads, [&](int64_t t) {
      const int64_t first = blocks * t / threads * 8,
                    last = std::min(rows, blocks * (t + 1) / threads * 8);
      chosen(x + first * in, last - first, in, w.data(), out, y + first * out, 0, out, accumulate);
    });
    return;
  }
  if (threads > 1 && work >= kMinimumWork && out >= 64 * threads) {
    const int64_t blocks = (out + 31) / 32;
    parallel_for(threads, [&](int64_t t) {
      const int64_t first = blocks * t / threads * 32,
                    last = std::min(out, blocks * (t + 1) / threads * 32);
      chosen(x, rows, in, w.data(), out, y, first, last, accumulate);
    });
    return;
  }
  chosen(x, rows, in, w.data(), out, y, 0, out, accumulate);
}

}  // namespace kvsnap::detail
