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
// _mm512_fmadd_ps / _mm256_fmadd_ps lane by lane; a * b + c in the default one, and the file is
// built with -ffp-contract=off), so no compiler heuristic can fuse one instantiation's sums and
// not another's; the AVX-512 and AVX2 variants compute exactly the same sums (each output the
// plain fma chain over k: a test holds every fused variant to it).
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
  // over W's rows in order, from zero; each weight is loaded once for all R rows. (No fetching
  // ahead: Fetch is for the intrinsics variants.)
  template <int R, int P, bool Fetch = false>
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
// Asks the caches for the panel 32 of its rows (4 KB) ahead of wk: computed as an integer, a hint
// never faults, and the address may lie past W's end. No target attribute: it inlines into every
// variant's blocks.
[[gnu::always_inline]] inline void fetch_row(uintptr_t at) {
  __builtin_prefetch(reinterpret_cast<const char*>(at), 0, 3);
  __builtin_prefetch(reinterpret_cast<const char*>(at + 64), 0, 3);
}
[[gnu::always_inline]] inline void fetch_ahead(const float* wk) {
  constexpr uintptr_t kAhead = 32 * kPanel * sizeof(float);
  fetch_row(reinterpret_cast<uintptr_t>(wk) + kAhead);
}

// Which lines of W a block of rows asks the caches for while it computes: none; its own panel 32
// rows ahead; or a share of the rows that follow the stretch of W it computes over (Share).
enum class Fetch { none, ahead, share };

// A block's share of the rows of W that follow its stretch: one row (kPanel floats, two lines)
// on every `every`-th k, from the address `from` on (an integer, like fetch_ahead's: a share
// may reach past W's end).
struct Share {
  uintptr_t from = 0;
  int64_t every = 1;
};

// The k's [first, last) a pass goes over, and where a pass that stops before W's last row
// leaves its sums and one that starts after its first finds them (`partial`: the block's rows x
// kPanel floats). Each sum stays one fma chain over k in order: a float carried through memory
// is the same float.
struct Stretch {
  int64_t first = 0, last = 0;
  float* partial = nullptr;
};

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
  template <int R, int P, bool Fetch = R >= 4>
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
        if (Fetch) fetch_ahead(wk);
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

// The same blocks in AVX2 intrinsics, for 16 registers: lane c of sum[r][p][v] is the Portable
// sum of row r, column j + p * kPanel + 8 (v0 + v) + c. A block of R rows and P panels keeps
// R x P x V <= 12 sums (fmas take five cycles and two issue a cycle, so ten chains at least keep
// them busy) and goes over each panel's four vectors in passes of V, the panels staying in the
// caches between passes. Each k either loads the P x V weight vectors once and broadcasts each
// row's x (when there are more rows than weight vectors), or broadcasts the R rows' x once and
// loads each weight vector once: at most 16 registers either way.
struct Avx2 {
  template <int R, int P>
  static constexpr int kVectors = 12 / (R * P) >= 4   ? 4
                                  : 12 / (R * P) >= 2 ? 2
                                                      : 1;

  // One pass: vectors [v0, v0 + V) of each of the P panels over the stretch's k's, fetching as F
  // says (a branch in the loop would make GCC keep the sums in memory).
  template <int R, int P, int V, Fetch F>
  [[gnu::target("avx2,fma"), gnu::always_inline]] static void pass(const float* x, int64_t in,
                                                                   const float* panel, Out y,
                                                                   int64_t j, int v0, Stretch ks,
                                                                   Share share = {}) {
    // The loops over rows, panels and vectors unrolled before GCC places the sums: unrolled later,
    // it kept them in registers but stored every one on every k.
    __m256 sum[R][P][V];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) {
          sum[r][p][v] = ks.first == 0
                             ? _mm256_setzero_ps()
                             : _mm256_load_ps(ks.partial + (r * P + p) * kPanel + 8 * (v0 + v));
        }
      }
    }
    int64_t countdown = 1;  // Fetch::share: k's until the next row is fetched
    for (int64_t k = ks.first; k < ks.last; ++k) {
      const float* wk[P];
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) wk[p] = panel + p * in * kPanel + k * kPanel + 8 * v0;
      if constexpr (F == Fetch::ahead) {
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) fetch_ahead(wk[p]);
      }
      if constexpr (F == Fetch::share) {
        if (--countdown == 0) {
          fetch_row(share.from);
          share.from += kPanel * sizeof(float);
          countdown = share.every;
        }
      }
      if constexpr (P * V <= R) {
        __m256 w[P][V];
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
          for (int v = 0; v < V; ++v) w[p][v] = _mm256_loadu_ps(wk[p] + 8 * v);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 xr = _mm256_broadcast_ss(x + r * in + k);
#pragma GCC unroll 16
          for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
            for (int v = 0; v < V; ++v) sum[r][p][v] = _mm256_fmadd_ps(xr, w[p][v], sum[r][p][v]);
          }
        }
      } else {
        __m256 xr[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) xr[r] = _mm256_broadcast_ss(x + r * in + k);
#pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
          for (int v = 0; v < V; ++v) {
            const __m256 w = _mm256_loadu_ps(wk[p] + 8 * v);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) sum[r][p][v] = _mm256_fmadd_ps(xr[r], w, sum[r][p][v]);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) {
          if (ks.last < in) {
            _mm256_store_ps(ks.partial + (r * P + p) * kPanel + 8 * (v0 + v), sum[r][p][v]);
            continue;
          }
          float* to = y.y + r * y.out + j + p * kPanel + 8 * (v0 + v);
          _mm256_storeu_ps(
              to, y.accumulate ? _mm256_add_ps(_mm256_loadu_ps(to), sum[r][p][v]) : sum[r][p][v]);
        }
      }
    }
  }

  // R rows by P whole panels over all of W's rows; Fetch: ahead of the product.
  template <int R, int P, bool Fetch = false>
  [[gnu::target("avx2,fma"), gnu::noinline]] static void panels(const float* x, int64_t in,
                                                                const float* panel, Out y,
                                                                int64_t j) {
    constexpr int V = kVectors<R, P>;
    pass<R, P, V, Fetch ? Fetch::ahead : Fetch::none>(x, in, panel, y, j, 0, {0, in});
    for (int v0 = V; v0 < kPanel / 8; v0 += V) {
      pass<R, P, V, Fetch::none>(x, in, panel, y, j, v0, {0, in});
    }
  }

  // R rows over one panel's stretch of k's, fetching a share of the rows that follow it.
  template <int R>
  [[gnu::target("avx2,fma"), gnu::noinline]] static void stretch(const float* x, int64_t in,
                                                                 const float* panel, Out y,
                                                                 int64_t j, Stretch ks,
                                                                 Share share) {
    constexpr int V = kVectors<R, 1>;
    pass<R, 1, V, Fetch::share>(x, in, panel, y, j, 0, ks, share);
    for (int v0 = V; v0 < kPanel / 8; v0 += V) {
      pass<R, 1, V, Fetch::none>(x, in, panel, y, j, v0, ks);
    }
  }
};
#endif

// Rows [0, R) of y, columns [first, last) (first a multiple of kPanel; last one too, or the
// matrix's end): P panels at a time (several keep enough sums in flight when R is small), then
// one, then the narrow last panel — each column the same sum in the same order, so how columns
// are split (into blocks, or between threads) never changes a result.
template <class Blocks, bool Fused, int R, int P, bool Fetch = R >= 4>
[[gnu::always_inline]] inline void rows(const float* x, const PackedMatrix& w, Out y, int64_t first,
                                        int64_t last) {
  const int64_t in = w.in(), full = first + (last - first) / kPanel * kPanel;
  int64_t j = first;
  for (; j + P * kPanel <= full; j += P * kPanel) {
    Blocks::template panels<R, P, Fetch>(x, in, w.panel(j), y, j);
  }
  for (; j < full; j += kPanel) Blocks::template panels<R, 1, Fetch>(x, in, w.panel(j), y, j);
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
// Blocks of up to 24 rows, each going over W's panels once. A block of up to kStretchedRows rows
// (a decode step's) goes over a panel in stretches of kStretch of its rows: the rows take a
// stretch in threes (12 sums each) and a last one or two, which find it in L1 after the first,
// and the threes share out fetching the stretch that follows in memory (the rest of the panel,
// then the next), so W streams in while it is computed rather than between the multiply-adds.
// Measured on the default model's matrices, 8 rows, just after a 64 MB stream has pushed them
// out of the caches: 1.38 ms, against 1.62 ms when each panel was fetched by its own first three
// rows and the later ones fetched the next panel (4 rows: 1.13 against 1.37). Larger blocks take
// a panel whole, their threes sharing out fetching the next panel: stretches cost them ~20%
// (64 and 512 rows), carrying their many sums through memory. One or two rows alone keep 12
// sums over three panels at a time.
[[gnu::target("avx2,fma")]] void product_avx2(const float* x, int64_t count, const PackedMatrix& w,
                                              Out y, int64_t first, int64_t last) {
  constexpr int64_t kBlockRows = 24, kStretch = 32, kStretchedRows = 12;
  const int64_t in = w.in(), out = y.out, full = first + (last - first) / kPanel * kPanel;
  const auto at = [&](int64_t r) { return Out{y.y + r * out, out, y.accumulate}; };
  if (in == 0) {  // every sum is 0 (a stretch loop over no k's would write none)
    for (int64_t r = 0; r < count; ++r) {
      for (int64_t c = first; c < last; ++c) y.put(r, c, 0.0f);
    }
    return;
  }
  if (count < 3) {
    if (count == 2) rows<Avx2, true, 2, 3, false>(x, w, y, first, last);
    if (count == 1) rows<Portable<true>, true, 1, 4>(x, w, y, first, last);
    return;
  }
  alignas(32) float partial[kBlockRows / 3][3 * kPanel];  // each three rows' sums between stretches
  for (int64_t r0 = 0; r0 < count; r0 += kBlockRows) {
    const int64_t end = std::min(count, r0 + kBlockRows), threes = (end - r0 + 2) / 3;
    const int64_t stretch = end - r0 <= kStretchedRows ? kStretch : in;
    const int64_t share = (stretch + threes - 1) / threes;  // following rows each three fetch
    for (int64_t j = first; j < last; j += kPanel) {
      if (j == full) {  // the narrow last panel
        for (int64_t r = r0; r < end; ++r) {
          narrow_panel<true, 1>(x + r * in, in, w.panel(j), last - j, at(r), j);
        }
        continue;
      }
      const float* panel = w.panel(j);
      for (int64_t k0 = 0; k0 < in; k0 += stretch) {
        const int64_t k1 = std::min(in, k0 + stretch);
        // The rows that follow in memory: this panel's next stretch, or the next panel's first.
        const auto after = reinterpret_cast<uintptr_t>(panel + k1 * kPanel);
        const int64_t every = (k1 - k0 + share - 1) / share;
        for (int64_t r = r0, three = 0; r < end; ++three) {
          const float* xr = x + r * in;
          const int64_t take = std::min<int64_t>(3, end - r);
          const Stretch ks{k0, k1, partial[three]};
          const Share fetch{after + static_cast<uintptr_t>(three * share * kPanel) * sizeof(float),
                            every};
          if (take == 3) {
            Avx2::stretch<3>(xr, in, panel, at(r), j, ks, fetch);
          } else if (take == 2) {
            Avx2::stretch<2>(xr, in, panel, at(r), j, ks, fetch);
          } else {
            Avx2::stretch<1>(xr, in, panel, at(r), j, ks, fetch);
          }
          r += take;
        }
      }
    }
  }
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
