// The built-in model's matrix products y = x W: register-blocked kernels that stream W's column
// panels (PackedMatrix, weights.h) once for a block of rows, for every row count.
//
// Why not cblas_sgemm: (1) batch invariance — every output element is one sum over k in order,
// whatever the number of rows and wherever a row sits in the batch, so a sequence's projections
// are bitwise the same decoded alone, fused with seven others, or prefilled in a chunk, and the
// parallel replay agrees with the sequential one up to attention alone; sgemm (and sgemv for one
// row) change their blocking and so their rounding with the row count. (2) Speed at the sizes a
// decode step has: sgemm packs all of W on every call, which costs more than a product of a few
// rows (bench/matmul_benchmarks.cc measures both against a memcpy of W). W is packed once, when
// the weights are set.
//
// Every multiply-add is written out (fused where the chosen variant has FMA: std::fma, or
// _mm512_fmadd_ps lane by lane; a * b + c in the default one, and the file is built with
// -ffp-contract=off), so no compiler heuristic can fuse one instantiation's sums and not
// another's; the AVX-512 variant's intrinsics compute exactly the AVX2 variant's sums.
#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSNAP_MATMUL_X86 1
#endif

#include "model/weights.h"
#include "ops/parallel.h"
#include "ops/vector_isa.h"

namespace kvsnap::detail {
namespace {

constexpr int64_t kPanel = PackedMatrix::kPanel;

template <bool Fused>
[[gnu::always_inline]] inline float madd(float a, float b, float c) {
  return Fused ? std::fma(a, b, c) : a * b + c;  // this file: -ffp-contract=off
}

// Where a block writes: y[r * out + j + c] for its rows r and columns j + c. Accumulating adds
// the finished sum to y (adding each product to a large residual instead would round 256+ times).
struct Out {
  float* y;
  int64_t out;
  bool accumulate;
  [[gnu::always_inline]] void put(int64_t r, int64_t column, float sum) const {
    float& to = y[r * out + column];
    to = accumulate ? to + sum : sum;
  }
};

// Portable blocks (the compiler vectorizes them for the chosen target).
template <bool Fused>
struct Portable {
  // Rows [0, R) by P full panels starting at column j: R x P * kPanel sums held while k runs
  // over W's rows in order, from zero; each weight is loaded once for all R rows.
  template <int R, int P>
  [[gnu::always_inline]] static void panels(const float* x, int64_t in, const float* panel, Out y,
                                            int64_t j) {
    float sum[R][P * kPanel];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < P * kPanel; ++c) sum[r][c] = 0.0f;
    }
    for (int64_t k = 0; k < in; ++k) {
      for (int p = 0; p < P; ++p) {
        const float* wk = panel + p * in * kPanel + k * kPanel;
        for (int r = 0; r < R; ++r) {
          const float xr = x[r * in + k];
          for (int c = 0; c < kPanel; ++c) {
            sum[r][p * kPanel + c] = madd<Fused>(xr, wk[c], sum[r][p * kPanel + c]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < P * kPanel; ++c) y.put(r, j + c, sum[r][c]);
    }
  }
};

// The last, narrower panel (width < kPanel) one column at a time: the same sums.
template <bool Fused, int R>
[[gnu::always_inline]] inline void narrow_panel(const float* x, int64_t in, const float* panel,
                                                int64_t width, Out y, int64_t j) {
  for (int64_t c = 0; c < width; ++c) {
    float sum[R] = {};
    for (int64_t k = 0; k < in; ++k) {
      const float w = panel[k * width + c];
      for (int r = 0; r < R; ++r) sum[r] = madd<Fused>(x[r * in + k], w, sum[r]);
    }
    for (int r = 0; r < R; ++r) y.put(r, j + c, sum[r]);
  }
}

#ifdef KVSNAP_MATMUL_X86
// The same blocks in AVX-512 intrinsics (a compiler's auto-vectorization of Portable keeps the
// sums in registers at some optimization levels and not at others): lane c of sum[r][v] is
// the Portable sum of row r, column j + 16 v + c. Not inlined into the portable loops that call
// it (a function compiled for another target cannot be); a call per block of in x P * kPanel
// weights costs nothing measurable.
struct Avx512 {
  // With 4+ rows a block computes as long as it loads, and the hardware's own prefetch leaves
  // W's stream waiting on memory between the multiply-adds (a decode step of 8 sequences: 1.4x a
  // memcpy of W without, 1.2x with; bench/matmul_benchmarks.cc). So those blocks fetch the panel
  // 32 of its rows (4 KB) ahead — computed as an integer: a hint never faults, and the address may
  // lie past W's end. One row alone is bound by memory either way and is left to the hardware.
  [[gnu::target("avx512f,fma"), gnu::always_inline]] static void fetch_ahead(const float* wk) {
    constexpr uintptr_t kAhead = 32 * kPanel * sizeof(float);
    const uintptr_t at = reinterpret_cast<uintptr_t>(wk) + kAhead;
    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(at + 64), _MM_HINT_T0);
  }

  template <int R, int P>
  [[gnu::target("avx512f,fma"), gnu::noinline]] static void panels(const float* x, int64_t in,
                                                                   const float* panel, Out y,
                                                                   int64_t j) {
    __m512 sum[R][2 * P];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 2 * P; ++v) sum[r][v] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < in; ++k) {
      __m512 w[2 * P];
      for (int p = 0; p < P; ++p) {
        const float* wk = panel + p * in * kPanel + k * kPanel;
        w[2 * p] = _mm512_loadu_ps(wk);
        w[2 * p + 1] = _mm512_loadu_ps(wk + 16);
        if (R >= 4) fetch_ahead(wk);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * in + k]);
        for (int v = 0; v < 2 * P; ++v) sum[r][v] = _mm512_fmadd_ps(xr, w[v], sum[r][v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 2 * P; ++v) {
        float* to = y.y + r * y.out + j + 16 * v;
        _mm512_storeu_ps(to,
                         y.accumulate ? _mm512_add_ps(_mm512_loadu_ps(to), sum[r][v]) : sum[r][v]);
      }
    }
  }
};
#endif

// Rows [0, R) of y, columns [first, last) (first a multiple of kPanel; last one too, or the
// matrix's end): P panels at a time (several keep enough sums in flight when R is small), then
// one, then the narrow last panel — each column the same sum in the same order, so how columns
// are split (into blocks, or between threads) never changes a result.
template <class Blocks, bool Fused, int R, int P>
[[gnu::always_inline]] inline void rows(const float* x, const PackedMatrix& w, Out y, int64_t first,
                                        int64_t last) {
  const int64_t in = w.in(), full = first + (last - first) / kPanel * kPanel;
  int64_t j = first;
  for (; j + P * kPanel <= full; j += P * kPanel) {
    Blocks::template panels<R, P>(x, in, w.panel(j), y, j);
  }
  for (; j < full; j += kPanel) Blocks::template panels<R, 1>(x, in, w.panel(j), y, j);
  if (j < last) narrow_panel<Fused, R>(x, in, w.panel(j), last - j, y, j);
}

template <class Blocks, bool Fused>
[[gnu::always_inline]] inline void product(const float* x, int64_t count, const PackedMatrix& w,
                                           Out y, int64_t first, int64_t last) {
  const int64_t in = w.in(), out = y.out;
  const auto at = [&](int64_t r) { return Out{y.y + r * out, out, y.accumulate}; };
  int64_t r = 0;
  for (; r + 8 <= count; r += 8) rows<Blocks, Fused, 8, 1>(x + r * in, w, at(r), first, last);
  for (; r + 4 <= count; r += 4) rows<Blocks, Fused, 4, 3>(x + r * in, w, at(r), first, last);
  for (; r + 2 <= count; r += 2) rows<Blocks, Fused, 2, 4>(x + r * in, w, at(r), first, last);
  for (; r < count; ++r) rows<Blocks, Fused, 1, 4>(x + r * in, w, at(r), first, last);
}

using Product = void (*)(const float*, int64_t, const PackedMatrix&, Out, int64_t, int64_t);

void product_default(const float* x, int64_t count, const PackedMatrix& w, Out y, int64_t first,
                     int64_t last) {
  product<Portable<false>, false>(x, count, w, y, first, last);
}

#ifdef KVSNAP_MATMUL_X86
// Variants chosen once by what the CPU supports (one binary runs everywhere).
[[gnu::target("avx512f,fma")]] void product_avx512(const float* x, int64_t count,
                                                   const PackedMatrix& w, Out y, int64_t first,
                                                   int64_t last) {
  product<Avx512, true>(x, count, w, y, first, last);
}
[[gnu::target("avx2,fma")]] void product_avx2(const float* x, int64_t count, const PackedMatrix& w,
                                              Out y, int64_t first, int64_t last) {
  product<Portable<true>, true>(x, count, w, y, first, last);
}
#endif

// A variant over every column on the calling thread (matmul_variants).
template <Product P>
void whole(const float* x, int64_t rows, const PackedMatrix& w, float* y, bool accumulate) {
  P(x, rows, w, Out{y, w.out(), accumulate}, 0, w.out());
}

struct Kernel {
  MatmulVariant variant;
  Product product;
};

// The variants this CPU runs, portable first; matmul uses the last.
template <Product P>
Kernel kernel(const char* name) {
  return {{name, whole<P>}, P};
}
std::vector<Kernel> kernels() {
  std::vector<Kernel> out{kernel<product_default>("portable")};
#ifdef KVSNAP_MATMUL_X86
  const VectorIsa isa = vector_isa();
  if (isa == VectorIsa::avx2 || isa == VectorIsa::avx512) {
    out.push_back(kernel<product_avx2>("avx2"));
  }
  if (isa == VectorIsa::avx512) out.push_back(kernel<product_avx512>("avx512"));
#endif
  return out;
}

}  // namespace

std::vector<MatmulVariant> matmul_variants() {
  std::vector<MatmulVariant> out;
  for (const Kernel& k : kernels()) out.push_back(k.variant);
  return out;
}

void matmul(const float* x, int64_t rows, const PackedMatrix& w, float* y, bool accumulate) {
  static const Product chosen = kernels().back().product;
  const int64_t in = w.in(), out = w.out();
  const Out to{y, out, accumulate};
  // Split between the kernels' threads (ops/parallel.h) when there is enough work: prefill-sized
  // products by rows (8-row blocks), decode-sized ones by columns (each thread reads its panels
  // of W). A row's sums are the same whichever thread computes them.
  constexpr int64_t kMinimumWork = int64_t(1) << 17;  // multiply-adds; below, a region costs more
  const int64_t threads = parallel_threads();
  const int64_t work = rows * in * out;
  if (threads > 1 && work >= kMinimumWork && rows >= 16 * threads) {
    const int64_t blocks = (rows + 7) / 8;
    parallel_for(threads, [&](int64_t t) {
      const int64_t first = blocks * t / threads * 8,
                    last = std::min(rows, blocks * (t + 1) / threads * 8);
      chosen(x + first * in, last - first, w, Out{y + first * out, out, accumulate}, 0, out);
    });
    return;
  }
  if (threads > 1 && work >= kMinimumWork && out >= 2 * kPanel * threads) {
    const int64_t panels = (out + kPanel - 1) / kPanel;
    parallel_for(threads, [&](int64_t t) {
      const int64_t first = panels * t / threads * kPanel,
                    last = std::min(out, panels * (t + 1) / threads * kPanel);
      chosen(x, rows, w, to, first, last);
    });
    return;
  }
  chosen(x, rows, w, to, 0, out);
}

}  // namespace kvsnap::detail
